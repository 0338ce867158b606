"""Reading corpora: :func:`read_documents` streams :class:`Document` records from JSONL, CSV, TSV, DPR ``psgs_w100.tsv``,
plain-text files or folders, and ``datasets`` datasets (objects or ``save_to_disk`` directories).

Every error names the file and line (or dataset row) and the field at fault, and says how to fix it. Splitting the
documents into passages is :mod:`rag.knowledge.passages`.
"""

from __future__ import annotations

import bz2
import codecs
import csv
import gzip
import lzma
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Callable, Iterable, Iterator, Literal, Sequence

from rag.utils.errors import CorpusError
from rag.utils.files import MAX_JSON_BYTES, bounded_lines, parse_json, regular_file
from rag.utils.validate import check_bool, check_positive_int, is_integer

if TYPE_CHECKING:  # pragma: no cover
    import datasets
__all__ = ["Document", "Format", "SkippedFilesWarning", "read_documents", "detect_format", "check_sources", "MAX_DOCUMENT_CHARS"]

MAX_DOCUMENT_CHARS = 1 << 25
"""Default bound on one document (a text file, a JSONL line, a CSV/TSV row) in characters: 33,554,432 (~32 MB of
text, a hundred books); ``max_document_chars=`` / ``--max-document-chars`` changes it. Nothing longer is read into
memory, so a file without line breaks (or a device) cannot exhaust it."""

Format = Literal["auto", "jsonl", "csv", "tsv", "psgs_w100", "text", "dataset"]
_FORMATS = ("auto", "jsonl", "csv", "tsv", "psgs_w100", "text", "dataset")
_PSGS_W100_HEADER = ["id", "text", "title"]
_COMPRESSED: dict[str, Callable[..., IO[Any]]] = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
_FIX_FIELDS = "pass the right column names with --title-field/--text-field (title_field=/text_field=)"


@dataclass(frozen=True)
class Document:
    """One record read from a corpus source, before splitting.

    `id` is None when the source has no id for it (a content hash is used then);
    `source` locates it for error messages (``"file.jsonl:12"``, ``"dataset[3]"``);
    `keep_whole` marks records that already are passages (DPR ``psgs_w100``), which
    :func:`split_passages` never splits.
    """

    id: str | None
    title: str
    text: str
    source: str
    keep_whole: bool = False


# --------------------------------------------------------------------------- reading


def read_documents(
    source: str | os.PathLike | "datasets.Dataset" | Sequence[str | os.PathLike],
    *,
    format: Format = "auto",
    title_field: str | None = "title",
    text_field: str = "text",
    id_field: str | None = "id",
    encoding: str = "utf-8",
    max_document_chars: int = MAX_DOCUMENT_CHARS,
    follow_symlinks: bool = False,
) -> Iterator[Document]:
    """Stream the documents of one source, or of a list of sources in order.

    `source` is a file (``.jsonl``/``.json``, ``.csv``, ``.tsv``, ``.txt``, optionally
    ``.gz``/``.bz2``/``.xz`` compressed), a folder (a ``save_to_disk`` dataset when it
    holds ``dataset_info.json``/``state.json``/``dataset_dict.json``, else a folder read
    recursively in sorted order: its ``.txt`` files one document each, then its
    ``.jsonl``/``.json``/``.ndjson``/``.csv``/``.tsv`` files as such (``format="text"``: the
    ``.txt`` files only); other files are skipped with a :class:`SkippedFilesWarning`), a ``datasets.Dataset``, or a list
    of these. `format="auto"` picks the format from the extension; a TSV whose header
    is exactly ``id, text, title`` is read as DPR ``psgs_w100`` (rows kept whole).
    `title_field=None` means the corpus has no titles (all titles ""). A missing id
    field is allowed (content-hash ids). Files are read lazily, row by row, so a
    21M-row TSV is never held in memory. Raises CorpusError for bad input: among others a source that is not a regular
    file or folder (a device such as ``/dev/zero``, a pipe), a document, line or row longer than `max_document_chars`
    characters, and text that is not valid Unicode (a lone surrogate from a JSON ``\\ud800`` escape). A folder's
    symbolic links that point outside it are skipped with a :class:`SkippedFilesWarning` naming them, unless
    `follow_symlinks`.
    """
    if format not in _FORMATS:
        raise CorpusError(f"unknown corpus format {format!r}; choose one of {', '.join(_FORMATS)} (--format)")
    if not text_field:
        raise CorpusError("text_field must name the column that holds the text (--text-field)")
    try:
        codecs.lookup(encoding)
    except LookupError:
        raise CorpusError(f"unknown encoding {encoding!r}; pass a Python codec name such as utf-8 or "
                          f"latin-1 (--encoding)") from None
    check_positive_int(max_document_chars, "max_document_chars (--max-document-chars)", error=CorpusError)
    check_bool(follow_symlinks, "follow_symlinks (--follow-symlinks)", error=CorpusError)
    fields = _Fields(title_field or None, text_field, id_field or None, max_document_chars, follow_symlinks)
    if is_dataset(source):
        yield from _checked(_read_dataset(source, "dataset", fields), fields)
        return
    if isinstance(source, (str, os.PathLike)):
        sources: list[Any] = [source]
    elif isinstance(source, Iterable):
        sources = list(source)
        if not sources:
            raise CorpusError("the list of corpus sources is empty; pass at least one file, folder or dataset")
    else:
        raise CorpusError(
            f"cannot read a corpus from a {type(source).__name__}; pass a path, a list of paths or a datasets.Dataset"
        )
    for one in sources:
        if is_dataset(one):
            yield from _checked(_read_dataset(one, "dataset", fields), fields)
            continue
        if not isinstance(one, (str, os.PathLike)):
            raise CorpusError(f"cannot read a corpus from a {type(one).__name__}; pass a path or a datasets.Dataset")
        path = Path(one)
        if not path.exists():
            raise CorpusError(f"corpus source {path} does not exist; check the path")
        if not path.is_dir():
            regular_file(path, "a corpus source (--corpus)", error=CorpusError)
        fmt = detect_format(path, encoding) if format == "auto" else format
        reader = _read_folder if format == "auto" and fmt == "text" and path.is_dir() else _READERS[fmt]
        count = 0
        for doc in _checked(reader(path, fields, encoding), fields):
            count += 1
            yield doc
        if count == 0:
            what = "folder" if path.is_dir() else "file"
            raise CorpusError(
                f"{what} {path} contains no documents (read as {fmt}); check the path, "
                f"or that the {what} is not empty or header-only"
            )


def check_sources(paths: Sequence[str | os.PathLike]) -> None:
    """CorpusError unless each path is an existing folder or regular file: cheap, so that ``rag index build`` refuses a
    missing path, a device or a pipe before it loads the encoder (:func:`read_documents` checks again as it reads)."""
    for one in paths:
        path = Path(one)
        if not path.exists():
            raise CorpusError(f"corpus source {path} does not exist; check the path")
        if not path.is_dir():
            regular_file(path, "a corpus source (--corpus)", error=CorpusError)


def detect_format(path: str | os.PathLike, encoding: str = "utf-8") -> str:
    """Format of a path from its extension (and a TSV's header, for ``psgs_w100``)."""
    path = Path(path)
    if path.is_dir():
        markers = ("dataset_info.json", "state.json", "dataset_dict.json")
        return "dataset" if any((path / m).is_file() for m in markers) else "text"
    suffix = _data_suffix(path)
    if suffix in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    if suffix == ".csv":
        return "csv"
    if suffix == ".tsv":
        with _open_text(path, encoding) as f:
            try:
                header = next(csv.reader(_RowBound(f, str(path), MAX_DOCUMENT_CHARS), delimiter="\t"), [])
            except csv.Error:
                header = []
            except UnicodeDecodeError:
                raise _decode_error(path, encoding) from None
        return "psgs_w100" if header == _PSGS_W100_HEADER else "tsv"
    if suffix == ".txt":
        return "text"
    raise CorpusError(
        f"cannot tell the format of {path} from its extension {suffix or '(none)'!r}; "
        f"pass format= (--format) as one of jsonl, csv, tsv, psgs_w100, text, dataset"
    )


@dataclass(frozen=True)
class _Fields:
    """Which fields hold what, and how much may be read (every reader takes it)."""

    title: str | None
    text: str
    id: str | None
    max_chars: int = MAX_DOCUMENT_CHARS
    follow_symlinks: bool = False


def _checked(docs: Iterator[Document], fields: _Fields) -> Iterator[Document]:
    """`docs`, each within the length bound and holding only valid Unicode: a lone surrogate (a JSON ``\\ud800`` escape)
    cannot be written as UTF-8, so the knowledge base could not store it."""
    for doc in docs:
        if len(doc.text) + len(doc.title) > fields.max_chars:
            raise _too_long(doc.source, fields.max_chars)
        for name, value in (("text", doc.text), ("title", doc.title), ("id", doc.id or "")):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise CorpusError(f"{doc.source}: the {name} holds {value[e.start]!r} at character {e.start}, a lone UTF-16 "
                                  "surrogate that is not valid Unicode (a JSON escape such as \\ud800 without its pair); fix "
                                  "the escape or remove the character") from None
        yield doc


_LIMIT_FIX = ("split the document, check that the file is text with line breaks, or raise the limit "
              "(--max-document-chars / max_document_chars=)")


def _too_long(where: str, limit: int) -> CorpusError:
    return CorpusError(f"{where}: a document, line or row longer than {limit:,} characters; {_LIMIT_FIX}")


def _bounded_lines(f: IO[str], where: str, limit: int) -> Iterator[str]:
    return bounded_lines(f, where, limit, error=CorpusError, fix=_LIMIT_FIX)


class _RowBound:
    """Lines for csv.reader, refusing a row (which quoted line breaks may spread over many lines) longer than
    `limit` characters; :meth:`next_row` starts counting a new row."""

    def __init__(self, f: IO[str], where: str, limit: int):
        self._lines = _bounded_lines(f, where, limit)
        self._where, self._limit, self._used, self._line, self._start = where, limit, 0, 0, 1

    def next_row(self) -> None:
        self._used, self._start = 0, self._line + 1

    def __iter__(self) -> "_RowBound":
        return self

    def __next__(self) -> str:
        line = next(self._lines)
        self._line += 1
        self._used += len(line)
        if self._used > self._limit:
            raise _too_long(f"{self._where}:{self._start}", self._limit)
        return line


def _data_suffix(path: Path) -> str:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in _COMPRESSED:
        suffixes = suffixes[:-1]
    return suffixes[-1] if suffixes else ""


def _python_encoding(encoding: str) -> str:
    # A UTF-8 byte-order mark would otherwise end up glued to the first header field.
    return "utf-8-sig" if codecs.lookup(encoding).name == "utf-8" else encoding


def _open_binary(path: Path) -> IO[bytes]:
    opener = _COMPRESSED.get(path.suffix.lower())
    return opener(path, "rb") if opener else open(path, "rb")


def _open_text(path: Path, encoding: str, newline: str | None = "") -> IO[str]:
    opener = _COMPRESSED.get(path.suffix.lower())
    enc = _python_encoding(encoding)
    if opener:
        return opener(path, "rt", encoding=enc, errors="strict", newline=newline)
    return open(path, encoding=enc, errors="strict", newline=newline)


def _decode_error(path: Path, encoding: str) -> CorpusError:
    """Locate the first undecodable byte of a file (line and byte offset) for the message."""
    decoder = codecs.getincrementaldecoder(_python_encoding(encoding))(errors="strict")
    offset, lineno = 0, 1
    with _open_binary(path) as f:
        for block in iter(lambda: f.read(1 << 20), b""):  # blocks, not lines: a line may be any length
            try:
                decoder.decode(block)
            except UnicodeDecodeError as e:
                bad = e.object[e.start : e.end]
                lineno += block.count(b"\n", 0, max(0, e.start))
                return CorpusError(
                    f"{path}:{lineno}: cannot decode byte(s) {bad!r} at byte offset {offset + e.start} "
                    f"as {encoding} ({e.reason}); pass the file's real encoding with --encoding "
                    f"(encoding=, e.g. latin-1) or fix those bytes (they are never replaced silently)"
                )
            offset += len(block)
            lineno += block.count(b"\n")
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError as e:
            return CorpusError(
                f"{path}: the file ends in the middle of a {encoding} character ({e.reason}) at byte offset "
                f"{offset}; pass the right encoding with --encoding or fix the file"
            )
    return CorpusError(f"{path}: cannot decode the file as {encoding}; pass the right encoding with --encoding or fix the file")


def _guard_decoding(path: Path, encoding: str, rows: Iterator[Document]) -> Iterator[Document]:
    try:
        yield from rows
    except UnicodeDecodeError:
        raise _decode_error(path, encoding) from None


def _string_field(value: Any, name: str, where: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    raise CorpusError(
        f"{where}: field {name!r} holds a {type(value).__name__} ({str(value)[:40]!r}), expected a string; "
        f"fix the row or {_FIX_FIELDS}"
    )


def _id_field(value: Any, name: str, where: str) -> str | None:
    if value is None or value == "":
        return None
    if not (isinstance(value, str) or is_integer(value)):
        raise CorpusError(
            f"{where}: id field {name!r} holds a {type(value).__name__} ({str(value)[:40]!r}), expected a string "
            f"or integer; fix the row, or pass --id-field (id_field=) naming another column"
        )
    return str(value)


def _missing_field(where: str, kind: str, name: str, present: Iterable[Any]) -> CorpusError:
    listed = ", ".join(repr(p) for p in present) or "(none)"
    hint = ", or title_field=None if the corpus has no titles" if kind == "title" else ""
    return CorpusError(
        f"{where}: {kind} field {name!r} is missing; the fields present are {listed}; {_FIX_FIELDS}{hint}"
    )


def _make_document(row: dict, fields: _Fields, where: str, keep_whole: bool = False) -> Document:
    if fields.text not in row:
        raise _missing_field(where, "text", fields.text, row.keys())
    if fields.title is not None and fields.title not in row:
        raise _missing_field(where, "title", fields.title, row.keys())
    text = _string_field(row[fields.text], fields.text, where)
    title = _string_field(row[fields.title], fields.title, where) if fields.title is not None else ""
    doc_id = _id_field(row.get(fields.id), fields.id, where) if fields.id is not None else None
    return Document(id=doc_id, title=title, text=text, source=where, keep_whole=keep_whole)


def _read_jsonl(path: Path, fields: _Fields, encoding: str) -> Iterator[Document]:
    return _guard_decoding(path, encoding, _jsonl_rows(path, fields, encoding))


def _jsonl_rows(path: Path, fields: _Fields, encoding: str) -> Iterator[Document]:
    with _open_text(path, encoding, newline=None) as f:
        first = ""
        if _data_suffix(path) == ".json":
            first = f.read(1)
            while first and first.isspace():
                first = f.read(1)
        if first == "[":
            # A .json file holding one array: it cannot be streamed, so it is parsed whole (up to MAX_JSON_BYTES).
            f.seek(0)
            text = f.read(MAX_JSON_BYTES + 1)
            if len(text) > MAX_JSON_BYTES:
                raise CorpusError(f"{path}: a JSON array larger than {MAX_JSON_BYTES:,} characters is not read whole; convert "
                                  "it to JSONL (one object per line), which is read as a stream")
            rows = parse_json(text, str(path), fix="fix the file", error=CorpusError)
            for i, row in enumerate(rows):
                where = f"{path}[{i}]"
                if not isinstance(row, dict):
                    raise CorpusError(f"{where}: expected a JSON object with {fields.text!r}, got a "
                                      f"{type(row).__name__}; fix the file")
                yield _make_document(row, fields, where)
            return
        f.seek(0)
        for lineno, line in enumerate(_bounded_lines(f, str(path), fields.max_chars), start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            row = parse_json(line, where, error=CorpusError, fix="each line must be one JSON object such as "
                             "{\"title\": ..., \"text\": ...}; fix or remove the line")
            if not isinstance(row, dict):
                raise CorpusError(
                    f"{where}: expected a JSON object with field {fields.text!r}, got a JSON {type(row).__name__}; "
                    f"fix or remove the line"
                )
            yield _make_document(row, fields, where)


def _enable_long_csv_fields() -> None:
    # The csv module refuses fields over 128 KiB by default; long documents are normal here.
    # (Process-wide setting, but only ever raised, never lowered.)
    limit = sys.maxsize
    while limit > csv.field_size_limit():
        try:
            csv.field_size_limit(limit)
            return
        except OverflowError:
            limit //= 2


def _delimited_rows(path: Path, fields: _Fields, encoding: str, delimiter: str, psgs_w100: bool) -> Iterator[Document]:
    _enable_long_csv_fields()  # rows are bounded by _RowBound (fields.max_chars) instead
    with _open_text(path, encoding) as f:
        lines = _RowBound(f, str(path), fields.max_chars)
        # strict: an unterminated quote is an error ("unexpected end of data"), not one field that swallows every row after it
        reader = csv.reader(lines, delimiter=delimiter, strict=True)
        header: list[str] = []
        while not header:  # blank lines before the header are skipped
            try:
                header = next(reader)
            except StopIteration:
                return
            except csv.Error as e:
                raise CorpusError(f"{path}:{reader.line_num}: cannot parse the header ({e}); fix the file") from None
        where0 = f"{path}:{reader.line_num} (header)"
        if psgs_w100:
            if header != _PSGS_W100_HEADER:
                raise CorpusError(
                    f"{where0}: a psgs_w100 file starts with the header 'id<TAB>text<TAB>title', found "
                    f"{header!r}; read it with format='tsv' (--format tsv) and --title-field/--text-field"
                )
            fields = _Fields("title", "text", "id")
        if fields.text not in header:
            raise _missing_field(where0, "text", fields.text, header)
        if fields.title is not None and fields.title not in header:
            raise _missing_field(where0, "title", fields.title, header)
        text_i = header.index(fields.text)
        title_i = header.index(fields.title) if fields.title is not None else None
        id_i = header.index(fields.id) if fields.id is not None and fields.id in header else None
        last_line = reader.line_num
        while True:
            lines.next_row()
            try:
                values = next(reader)
            except StopIteration:
                return
            except csv.Error as e:
                if "end of data" in str(e):
                    raise CorpusError(f"{path}:{last_line + 1}: a quote opened in this row is never closed, so it would swallow "
                                      "every row after it; close the quote (write a quote inside a quoted "
                                      "field as \"\")") from None
                raise CorpusError(f"{path}:{last_line + 1}: cannot parse the row ({e}); fix the quoting of that row") from None
            where = f"{path}:{last_line + 1}"
            last_line = reader.line_num
            if not values:
                continue
            if len(values) != len(header):
                sep = "tab" if delimiter == "\t" else "comma"
                raise CorpusError(
                    f"{where}: the row has {len(values)} fields but the header has {len(header)} "
                    f"({', '.join(header)}); a stray {sep} or quote inside a field? quote the field or fix the row"
                )
            title = values[title_i] if title_i is not None else ""
            doc_id = (values[id_i] or None) if id_i is not None else None
            yield Document(id=doc_id, title=title, text=values[text_i], source=where, keep_whole=psgs_w100)


def _read_csv(path: Path, fields: _Fields, encoding: str) -> Iterator[Document]:
    return _guard_decoding(path, encoding, _delimited_rows(path, fields, encoding, ",", False))


def _read_tsv(path: Path, fields: _Fields, encoding: str) -> Iterator[Document]:
    return _guard_decoding(path, encoding, _delimited_rows(path, fields, encoding, "\t", False))


def _read_psgs_w100(path: Path, fields: _Fields, encoding: str) -> Iterator[Document]:
    return _guard_decoding(path, encoding, _delimited_rows(path, fields, encoding, "\t", True))


_DATA_SUFFIXES = (".jsonl", ".json", ".ndjson", ".csv", ".tsv")


class SkippedFilesWarning(UserWarning):
    """Files in a corpus folder that were not read (their format is not one a folder's files are read as)."""


def _folder_files(path: Path, follow_symlinks: bool = False) -> tuple[list[Path], list[Path], list[Path]]:
    """A folder's non-hidden regular files, recursively, sorted by relative path: (text files, data files, others).

    A symbolic link whose target lies outside the folder is skipped with a :class:`SkippedFilesWarning` naming it (a
    link to a system file would otherwise become a passage that retrieval serves), unless `follow_symlinks`."""
    texts, data, other, outside = [], [], [], []
    root = path.resolve()
    for p in sorted((p for p in path.rglob("*") if p.is_file()), key=lambda p: p.relative_to(path).as_posix()):
        if any(part.startswith(".") for part in p.relative_to(path).parts):
            continue
        if not follow_symlinks and not p.resolve().is_relative_to(root):
            outside.append(p)
            continue
        suffix = _data_suffix(p)
        (texts if suffix == ".txt" else data if suffix in _DATA_SUFFIXES else other).append(p)
    _warn_skipped(path, outside, "symbolic links to files outside the folder are not read (pass --follow-symlinks, "
                  "follow_symlinks=True, to read them)", stacklevel=4)
    return texts, data, other


def _warn_skipped(path: Path, skipped: list[Path], why: str, stacklevel: int = 2) -> None:
    if skipped:
        names = ", ".join(p.relative_to(path).as_posix() for p in skipped[:5]) + (", ..." if len(skipped) > 5 else "")
        warnings.warn(f"corpus folder {path}: skipped {len(skipped)} file(s) ({names}): {why}", SkippedFilesWarning,
                      stacklevel=stacklevel)


def _text_documents(path: Path, files: list[Path], encoding: str, limit: int) -> Iterator[Document]:
    for p in files:
        try:
            with _open_text(p, encoding, newline=None) as f:
                text = f.read(limit + 1)
        except UnicodeDecodeError:
            raise _decode_error(p, encoding) from None
        if len(text) > limit:
            raise _too_long(str(p), limit)
        name = p.name[: -len(p.suffix)] if p.suffix.lower() in _COMPRESSED else p.name
        rel = p.relative_to(path).as_posix() if p != path else p.name
        yield Document(id=rel, title=Path(name).stem, text=text, source=f"{p}:1")


def _read_text(path: Path, fields: _Fields, encoding: str) -> Iterator[Document]:
    if not path.is_dir():
        return _text_documents(path, [path], encoding, fields.max_chars)
    texts, data, other = _folder_files(path, fields.follow_symlinks)
    _warn_skipped(path, data + other, "format='text' (--format text) reads only .txt files; --format auto also reads "
                  ".jsonl/.json/.csv/.tsv files")
    return _text_documents(path, texts, encoding, fields.max_chars)


def _read_folder(path: Path, fields: _Fields, encoding: str) -> Iterator[Document]:
    """A folder read with format='auto': its .txt files (one document each, id = relative path), then its
    .jsonl/.json/.ndjson/.csv/.tsv files (each read in the format its extension says), all in sorted order;
    other files are skipped with a :class:`SkippedFilesWarning`."""
    texts, data, other = _folder_files(path, fields.follow_symlinks)
    _warn_skipped(path, other, f"a folder's files are read only when they are {', '.join(('.txt',) + _DATA_SUFFIXES)} "
                  "(optionally .gz/.bz2/.xz compressed); convert them, or pass them as separate --corpus sources with --format")
    yield from _text_documents(path, texts, encoding, fields.max_chars)
    for p in data:
        yield from _READERS[detect_format(p, encoding)](p, fields, encoding)


def is_dataset(obj: Any) -> bool:
    # Only look when `datasets` is already imported: an object cannot be a Dataset otherwise,
    # and importing it costs ~1 s.
    ds = sys.modules.get("datasets")
    return ds is not None and isinstance(obj, (ds.Dataset, ds.DatasetDict, ds.IterableDataset))


def _read_saved_dataset(path: Path, fields: _Fields, encoding: str) -> Iterator[Document]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError, OSError) as e:
        raise CorpusError(f"{path}: cannot load a save_to_disk dataset from this folder ({e}); check the path") from None
    return _read_dataset(ds, str(path), fields)


def _read_dataset(ds: Any, name: str, fields: _Fields) -> Iterator[Document]:
    import datasets

    if isinstance(ds, datasets.DatasetDict):
        splits = list(ds.keys())
        if len(splits) != 1:
            raise CorpusError(
                f"{name} holds several splits ({', '.join(splits)}); pass one split (e.g. ds['{splits[0]}'] "
                f"or the folder {name}/{splits[0]})"
            )
        name = f"{name}/{splits[0]}"
        ds = ds[splits[0]]
    columns = getattr(ds, "column_names", None)
    if columns is not None:
        if fields.text not in columns:
            raise _missing_field(f"{name} (columns)", "text", fields.text, columns)
        if fields.title is not None and fields.title not in columns:
            raise _missing_field(f"{name} (columns)", "title", fields.title, columns)
    rows = ds.iter(batch_size=1024) if isinstance(ds, datasets.Dataset) else None
    if rows is None:
        for i, row in enumerate(ds):
            yield _make_document(row, fields, f"{name}[{i}]")
        return
    i = 0
    for batch in rows:
        keys = list(batch.keys())
        for values in zip(*batch.values()):
            yield _make_document(dict(zip(keys, values)), fields, f"{name}[{i}]")
            i += 1


_READERS: dict[str, Callable[[Path, _Fields, str], Iterator[Document]]] = {
    "jsonl": _read_jsonl,
    "csv": _read_csv,
    "tsv": _read_tsv,
    "psgs_w100": _read_psgs_w100,
    "text": _read_text,
    "dataset": _read_saved_dataset,
}
