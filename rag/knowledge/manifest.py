"""A knowledge base's manifest and the checks on its files: what `manifest.json` holds, how a version id is derived
from content, and the finite-embeddings / Arrow-file checks run when a directory is opened.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

import rag
from rag.knowledge.index import IndexSpec
from rag.knowledge.passages import Passage
from rag.utils.checksums import Verify, confined_path, verify_files
from rag.utils.errors import CorpusError, IntegrityError, KnowledgeBaseError, RagError
from rag.utils.files import check_json_files, read_json
from rag.utils.validate import is_integer

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PASSAGES = "passages"
EMBEDDINGS = "embeddings.npy"
INDEX = "index.faiss"
BM25_DIR = "bm25"


@dataclass
class Manifest:
    """What `manifest.json` records about a knowledge base (see module docstring)."""

    format_version: int
    version: str
    created: str
    count: int
    dim: int
    metric: str
    encoder: dict
    index: dict
    files: dict
    parent: Optional[str] = None
    query_encoder: Optional[dict] = None
    build: dict = field(default_factory=dict)
    passages_digest: Optional[str] = None
    """SHA-256 over every passage's id, title and text, in order: two builds over the same passages share it even where
    their embeddings (and so their versions) differ by float rounding (another machine, thread count or torch)."""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any, path: Path) -> "Manifest":
        """Check the parsed `manifest.json` at `path` field by field (IntegrityError naming the field) and wrap it."""

        def bad(what: str) -> IntegrityError:
            return IntegrityError(f"{path}: {what}; the manifest is damaged or not a knowledge-base manifest — rebuild the "
                                  f"knowledge base with `rag index build`")

        if not isinstance(d, dict):
            raise bad(f"holds a JSON {type(d).__name__}, not an object")
        missing = [k for k in _REQUIRED_FIELDS if k not in d]  # (`created` too: the dataclass has no default for it)
        if missing:
            raise IntegrityError(f"{path}: manifest is missing field(s) {missing}; the directory is not a complete knowledge "
                                 f"base — rebuild it with `rag index build`")
        for name, types in _FIELD_TYPES.items():
            value = d.get(name)
            if name not in _REQUIRED_FIELDS and value is None:
                continue
            if not any(is_integer(value) if t is int else isinstance(value, t) for t in types):
                want = " or ".join(_JSON_NAMES[t] for t in types)
                raise bad(f"field {name!r} is {json.dumps(value)[:60]} ({json_type_name(value)}), expected {want}")
        if d["format_version"] > FORMAT_VERSION:
            raise KnowledgeBaseError(
                f"{path}: format_version {d['format_version']} is newer than this rag ({FORMAT_VERSION}); upgrade rag to open it"
            )
        if d["count"] < 0 or d["dim"] < 1:
            raise bad(f"count={d['count']} / dim={d['dim']} are impossible (count >= 0, dim >= 1)")
        for rel, meta in d["files"].items():
            if not (isinstance(meta, dict) and isinstance(meta.get("sha256"), str) and isinstance(meta.get("bytes"), int)
                    and not isinstance(meta.get("bytes"), bool)):
                raise bad(f"files[{rel!r}] is {json.dumps(meta)[:80]}, expected {{\"sha256\": hex string, \"bytes\": integer}}")
        try:
            IndexSpec.from_dict(d["index"])
        except (RagError, TypeError, ValueError) as e:
            raise bad(f"field 'index' is not a valid index spec ({e})") from None
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})


_REQUIRED_FIELDS = ("format_version", "version", "created", "count", "dim", "metric", "encoder", "index", "files")
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "format_version": (int,), "version": (str,), "created": (str,), "count": (int,), "dim": (int,), "metric": (str,),
    "encoder": (dict,), "index": (dict,), "files": (dict,), "parent": (str,), "query_encoder": (dict,), "build": (dict,),
    "passages_digest": (str,),
}
_JSON_NAMES = {int: "an integer", str: "a string", dict: "an object", list: "an array", float: "a number", bool: "a boolean"}


def json_type_name(value: Any) -> str:
    return "null" if value is None else _JSON_NAMES.get(type(value), type(value).__name__)


def new_manifest(passages: Sequence[Passage], dim: int, spec: IndexSpec, encoder: dict, files: dict, *,
                 parent: Optional[str] = None, query_encoder: Optional[dict] = None, build: Optional[dict] = None) -> Manifest:
    """The manifest of a knowledge base being written: its content-addressed version (passages, embeddings' checksum,
    index spec, encoder), the time, the versions of rag and faiss that wrote it, and `build`'s entries."""
    import faiss

    digest = passages_digest(passages)
    return Manifest(
        format_version=FORMAT_VERSION, version=content_version(digest, files[EMBEDDINGS]["sha256"], spec.to_dict(), encoder),
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), count=len(passages), dim=dim,
        metric=spec.metric, encoder=dict(encoder), index=spec.to_dict(), files=files, parent=parent,
        query_encoder=query_encoder, passages_digest=digest,
        build={"rag_version": rag.__version__, "faiss_version": faiss.__version__, **(build or {})},
    )


def is_knowledge_base(path: str | os.PathLike) -> bool:
    """True when `path` is a directory whose `manifest.json` is a knowledge-base manifest (the files need not verify).

    What ``overwrite=True`` may replace: a knowledge base, possibly damaged, but never a directory of anything else."""
    try:
        d = read_json(Path(path) / MANIFEST, fix="")
    except RagError:
        return False
    return isinstance(d, dict) and all(k in d for k in _REQUIRED_FIELDS) and str(d.get("version", "")).startswith("kb-")


def content_version(passage_digest: str, emb_digest: str, spec: dict, encoder: dict) -> str:
    """Content-addressed version id: the same passages, embeddings, index spec and encoder give the same id."""
    h = hashlib.sha256()
    for part in (passage_digest, emb_digest, json.dumps(spec, sort_keys=True), encoder.get("fingerprint", "")):
        h.update(part.encode())
        h.update(b"\0")
    return "kb-" + h.hexdigest()[:12]


def passages_digest(passages: Sequence[Passage]) -> str:
    h = hashlib.sha256()
    for p in passages:
        h.update(f"{p.id}\x1f{p.title}\x1f{p.text}\x1e".encode("utf-8"))
    return h.hexdigest()


_DIGEST_ROWS = 65536  # passages joined and hashed per step when a stored table is digested


def stored_passages_digest(table: Any, where: Path) -> str:
    """:func:`passages_digest` of a stored passages table (a pyarrow Table with string columns id, title, text),
    computed block by block in Arrow: each row is joined to the same ``id␟title␟text␞`` bytes, and the joined
    column's value buffer (the rows' bytes back to back) is hashed, so no Python object is made per passage.

    Raises IntegrityError naming `where` if a column is missing, not text, or holds a null (no build writes one)."""
    names = ("id", "title", "text")
    for name in names:
        if name not in table.column_names:
            raise IntegrityError(f"{where}: the passages have no {name!r} column; rebuild the knowledge base")
        kind = table.schema.field(name).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise IntegrityError(f"{where}: the passages' {name!r} column holds {kind}, not text; rebuild the knowledge base")
        if table.column(name).null_count:
            raise IntegrityError(f"{where}: the passages' {name!r} column holds nulls (no build writes them); rebuild the "
                                 f"knowledge base")
    h = hashlib.sha256()
    for batch in table.select(list(names)).to_batches(max_chunksize=_DIGEST_ROWS):
        if not batch.num_rows:
            continue
        joined = pc.binary_join_element_wise(batch.column(0), "\x1f", batch.column(1), "\x1f", batch.column(2), "\x1e", "")
        chunks = joined.chunks if isinstance(joined, pa.ChunkedArray) else [joined]
        for arr in chunks:
            offsets = np.frombuffer(arr.buffers()[1], dtype=np.int64 if pa.types.is_large_string(arr.type) else np.int32)
            start, end = int(offsets[arr.offset]), int(offsets[arr.offset + len(arr)])
            h.update(memoryview(arr.buffers()[2])[start:end])
    return h.hexdigest()


def check_version(path: Path, manifest: Manifest, passages: Any) -> None:
    """Refuse a manifest whose version id is not the one its content gives: the id recomputed as the build computes
    it (:func:`content_version`) from the opened `passages` (a ``datasets.Dataset``; :func:`stored_passages_digest`),
    the embeddings' verified SHA-256, the index spec and the encoder fingerprint the manifest records.

    Raises IntegrityError naming both ids (or the recorded passages digest that the passages do not give)."""
    where = path / MANIFEST
    if getattr(passages, "_indices", None) is not None:
        raise IntegrityError(f"{path / PASSAGES}: holds an indices mapping (no build writes one); rebuild the knowledge base")
    digest = stored_passages_digest(passages.data.table, path / PASSAGES)
    recomputed = content_version(digest, manifest.files[EMBEDDINGS]["sha256"], manifest.index, manifest.encoder)
    if recomputed != manifest.version:
        raise IntegrityError(f"{where}: records version {manifest.version} but its content gives {recomputed} (passages, "
                             f"embeddings, index spec or encoder changed after the build); rebuild the knowledge base")
    if manifest.passages_digest is not None and manifest.passages_digest != digest:
        raise IntegrityError(f"{where}: records passages digest {manifest.passages_digest[:12]}… but the passages give "
                             f"{digest[:12]}…; rebuild the knowledge base")


def check_passages(passages: Sequence[Passage], where: str) -> None:
    if len(passages) == 0:
        raise CorpusError(f"{where}: the corpus is empty (0 passages); give a file or dataset with at least one "
                          f"title/text record")
    seen: dict[str, int] = {}
    for i, p in enumerate(passages):
        if not isinstance(p, Passage):
            raise CorpusError(f"{where}: item {i} is {type(p).__name__}, not a Passage; build passages with "
                              f"rag.knowledge.passages.load_corpus")
        if p.id in seen:
            raise CorpusError(f"{where}: duplicate passage id {p.id!r} at positions {seen[p.id]} and {i}; ids must be unique "
                              f"(drop the id field to derive ids from content)")
        seen[p.id] = i


_FINITE_CHUNK = 64 << 20  # bytes of embeddings checked per step at open


def check_finite(embeddings: np.ndarray, where: Path) -> None:
    """IntegrityError if any stored embedding `(N, D)` holds NaN or ±inf.

    Vectorised over row blocks of ~64 MiB. A memory-mapped array is read from its file with ordinary reads
    into one reusable buffer, not through the mapping, so the check neither copies the array whole nor maps
    its pages into this process (that stays :meth:`KnowledgeBase.prewarm`'s choice); with ``verify="size"`` on a
    cold cache it reads the file once from disk. ``verify="none"`` skips it (its cost: docs/benchmarks.md, "Index").
    """
    n, dim = embeddings.shape
    row_bytes = max(1, dim * embeddings.dtype.itemsize)
    rows = max(1, _FINITE_CHUNK // row_bytes)
    filename = getattr(embeddings, "filename", None)
    if filename is None or not embeddings.flags.c_contiguous:
        blocks = (np.asarray(embeddings[s:s + rows]) for s in range(0, n, rows))
    else:
        blocks = file_blocks(Path(filename), int(embeddings.offset), embeddings.dtype, n, dim, rows)
    start = 0
    for block in blocks:
        if not np.isfinite(block).all():
            bad = start + int(np.flatnonzero(~np.isfinite(block).all(axis=1))[0])
            raise IntegrityError(f"{where}: row {bad} holds NaN or inf (a knowledge base never stores them); rebuild the "
                                 f"knowledge base")
        start += block.shape[0]


def file_blocks(path: Path, offset: int, dtype: np.dtype, n: int, dim: int, rows: int) -> Iterator[np.ndarray]:
    """Rows `(≤rows, dim)` of the C-ordered array stored in `path` from byte `offset`, read into one buffer."""
    buf = bytearray(min(rows, max(n, 1)) * dim * dtype.itemsize)
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        for s in range(0, n, rows):
            want = min(rows, n - s) * dim * dtype.itemsize
            view = memoryview(buf)[:want]
            got = 0
            while got < want:
                k = f.readinto(view[got:])
                if not k:
                    raise IntegrityError(f"{path}: ends before its {n} rows; rebuild the knowledge base")
                got += k
            yield np.frombuffer(view, dtype=dtype).reshape(-1, dim)


def check_arrow_files(passages_dir: Path) -> None:
    """The passages' ``state.json`` names its data files; each must stay inside the passages directory."""
    state = passages_dir / "state.json"
    # datasets parses the folder's JSON files itself (without bounds): each is read through the bounded reader first
    check_json_files(passages_dir, fix="rebuild the knowledge base")
    data = read_json(state, fix="rebuild the knowledge base")
    entries = data.get("_data_files") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise IntegrityError(f"{state}: names no data files; rebuild the knowledge base")
    for entry in entries:
        confined_path(passages_dir, entry.get("filename") if isinstance(entry, dict) else entry, state)


def verify_kb_files(path: Path, manifest: Manifest, verify: Verify, *, hash_nice: Optional[int] = None) -> None:
    """Check the files of the knowledge base at `path` against its manifest (`verify`: "full" hashes every file)."""
    # Every file open() reads must have a record: the arrays, the index, the passages' dataset and BM25.
    verify_files(path, manifest.files, verify, record=path / MANIFEST, hash_nice=hash_nice,
                 required=(EMBEDDINGS, INDEX, f"{PASSAGES}/state.json"), dirs=(PASSAGES, BM25_DIR),
                 incomplete="the knowledge base is incomplete — rebuild it", fix="rebuild the knowledge base")
