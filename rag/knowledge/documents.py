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
import json
import lzma
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Callable, Iterable, Iterator, Literal, Sequence

from rag.utils.errors import CorpusError

if TYPE_CHECKING:  # pragma: no cover
    import datasets
__all__ = ["Document", "Format", "SkippedFilesWarning", "read_documents", "detect_format"]

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
    21M-row TSV is never held in memory. Raises CorpusError for bad input.
    """
    if format not in _FORMATS:
        raise CorpusError(f"unknown corpus format {format!r}; choose one of {', '.join(_FORMATS)} (--format)")
    if not text_field:
        raise CorpusError("text_field must name the column that holds the text (--text-field)")
    try:
        codecs.lookup(encoding)
    except LookupError:
        raise CorpusError(f"unknown encoding {encoding!r}; pass a Python codec name such as utf-8 or latin-1 (--encoding)") from None
    fields = _Fields(title_field or None, text_field, id_field or None)
    if is_dataset(source):
        yield from _read_dataset(source, "dataset", fields)
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
            yield from _read_dataset(one, "dataset", fields)
            continue
        if not isinstance(one, (str, os.PathLike)):
            raise CorpusError(f"cannot read a corpus from a {type(one).__name__}; pass a path or a datasets.Dataset")
        path = Path(one)
        if not path.exists():
            raise CorpusError(f"corpus source {path} does not exist; check the path")
        fmt = detect_format(path, encoding) if format == "auto" else format
        reader = _read_folder if format == "auto" and fmt == "text" and path.is_dir() else _READERS[fmt]
        count = 0
        for doc in reader(path, fields, encoding):
            count += 1
            yield doc
        if count == 0:
            what = "folder" if path.is_dir() else "file"
            raise CorpusError(
                f"{what} {path} contains no documents (read as {fmt}); check the path, "
                f"or that the {what} is not empty or header-only"
            )


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
                header = next(csv.reader(f, delimiter="\t"), [])
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
    title: str | None
    text: str
    id: str | None


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
    offset = 0
    with _open_binary(path) as f:
        for lineno, line in enumerate(f, start=1):
            try:
                decoder.decode(line)
            except UnicodeDecodeError as e:
                bad = e.object[e.start : e.end]
                return CorpusError(
                    f"{path}:{lineno}: cannot decode byte(s) {bad!r} at byte offset {offset + e.start} "
                    f"as {encoding} ({e.reason}); pass the file's real encoding with --encoding "
                    f"(encoding=, e.g. latin-1) or fix those bytes (they are never replaced silently)"
                )
            offset += len(line)
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
    if isinstance(value, bool) or not isinstance(value, (str, int)):
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
            # A .json file holding one array: it cannot be streamed, so it is parsed whole.
            f.seek(0)
            try:
                rows = json.load(f)
            except json.JSONDecodeError as e:
                raise CorpusError(f"{path}:{e.lineno}: invalid JSON ({e.msg}, column {e.colno}); fix the file") from None
            for i, row in enumerate(rows):
                where = f"{path}[{i}]"
                if not isinstance(row, dict):
                    raise CorpusError(f"{where}: expected a JSON object with {fields.text!r}, got a {type(row).__name__}; fix the file")
                yield _make_document(row, fields, where)
            return
        f.seek(0)
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise CorpusError(
                    f"{where}: invalid JSON ({e.msg}, column {e.colno}); each line must be one JSON object "
                    f"such as {{\"title\": ..., \"text\": ...}}; fix or remove the line"
                ) from None
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
    _enable_long_csv_fields()
    with _open_text(path, encoding) as f:
        reader = csv.reader(f, delimiter=delimiter)
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
            try:
                values = next(reader)
            except StopIteration:
                return
            except csv.Error as e:
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


def _folder_files(path: Path) -> tuple[list[Path], list[Path], list[Path]]:
    """A folder's non-hidden files, recursively, sorted by relative path: (text files, data files, others)."""
    texts, data, other = [], [], []
    for p in sorted((p for p in path.rglob("*") if p.is_file()), key=lambda p: p.relative_to(path).as_posix()):
        if any(part.startswith(".") for part in p.relative_to(path).parts):
            continue
        suffix = _data_suffix(p)
        (texts if suffix == ".txt" else data if suffix in _DATA_SUFFIXES else other).append(p)
    return texts, data, other


def _warn_skipped(path: Path, skipped: list[Path], why: str) -> None:
    if skipped:
        names = ", ".join(p.relative_to(path).as_posix() for p in skipped[:5]) + (", ..." if len(skipped) > 5 else "")
        warnings.warn(f"corpus folder {path}: skipped {len(skipped)} file(s) ({names}): {why}", SkippedFilesWarning, stacklevel=2)


def _text_documents(path: Path, files: list[Path], encoding: str) -> Iterator[Document]:
    for p in files:
        try:
            with _open_text(p, encoding, newline=None) as f:
                text = f.read()
        except UnicodeDecodeError:
            raise _decode_error(p, encoding) from None
        name = p.name[: -len(p.suffix)] if p.suffix.lower() in _COMPRESSED else p.name
        rel = p.relative_to(path).as_posix() if p != path else p.name
        yield Document(id=rel, title=Path(name).stem, text=text, source=f"{p}:1")


def _read_text(path: Path, fields: _Fields, encoding: str) -> Iterator[Document]:
    if not path.is_dir():
        return _text_documents(path, [path], encoding)
    texts, data, other = _folder_files(path)
    _warn_skipped(path, data + other, "format='text' (--format text) reads only .txt files; --format auto also reads "
                  ".jsonl/.json/.csv/.tsv files")
    return _text_documents(path, texts, encoding)


def _read_folder(path: Path, fields: _Fields, encoding: str) -> Iterator[Document]:
    """A folder read with format='auto': its .txt files (one document each, id = relative path), then its
    .jsonl/.json/.ndjson/.csv/.tsv files (each read in the format its extension says), all in sorted order;
    other files are skipped with a :class:`SkippedFilesWarning`."""
    texts, data, other = _folder_files(path)
    _warn_skipped(path, other, f"a folder's files are read only when they are {', '.join(('.txt',) + _DATA_SUFFIXES)} "
                  "(optionally .gz/.bz2/.xz compressed); convert them, or pass them as separate --corpus sources with --format")
    yield from _text_documents(path, texts, encoding)
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
