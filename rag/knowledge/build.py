"""Writing a knowledge-base directory in bounded memory: staged, resumable encoding, the memory estimate, the writer.

A build encodes its passages in chunks of ``chunk_rows`` straight into ``embeddings.npy`` inside a staging directory
``.<out>.partial`` beside `out` (a sparse file filled chunk by chunk, with ordinary writes), recording each finished
chunk's SHA-256 in ``progress.json`` there. The index is then trained on a sample and filled block by block from that
file (:class:`~rag.knowledge.vectors.NpyVectors`), and the directory is written in a temporary sibling and renamed into
place (:func:`write_knowledge_base`). A killed build leaves only the staging directory (no manifest: nothing
:meth:`KnowledgeBase.open` accepts); the next build of the same `out` with the same corpus, encoder, index spec and
chunking re-checks the recorded chunks and encodes only the others; any other build there starts afresh.

:func:`check_memory` refuses, before anything is encoded, a spec whose estimated peak exceeds ``max_memory``
(default: :func:`default_max_memory`, 80% of physical RAM).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from rag.knowledge.bm25 import BM25Index
from rag.knowledge.index import IndexSpec, build_index, bytes_per_vector, check_fits, write_index
from rag.knowledge.ivf_train import train_bytes
from rag.knowledge.manifest import (
    BM25_DIR,
    EMBEDDINGS,
    INDEX,
    MANIFEST,
    PASSAGES,
    Manifest,
    check_passages,
    is_knowledge_base,
    new_manifest,
    passages_digest,
)
from rag.knowledge.passages import Passage
from rag.knowledge.vectors import ArrayVectors, NpyVectors, Vectors, create_npy, write_rows
from rag.utils.checksums import sha256_file
from rag.utils.devices import check_device
from rag.utils.errors import ConfigError, RagError
from rag.utils.files import read_json
from rag.utils.io import atomic_directory, atomic_write_json, check_output_dir
from rag.utils.validate import check_positive_int

__all__ = ["CHUNK_ROWS", "MemoryEstimate", "parse_memory", "default_max_memory", "estimate_memory", "check_memory",
           "staging_dir", "encode_staged", "write_knowledge_base", "format_bytes"]

logger = logging.getLogger(__name__)

CHUNK_ROWS = 16_384
"""Passages encoded per chunk (one resumable unit; ~25 MB of 384-d vectors, 50 MB of 768-d)."""
_ADD_ROWS = 16_384  # rows per faiss add() block (index.py's)
RUNTIME_BYTES = 512 << 20
"""The build process itself (Python, torch, faiss, datasets imported), counted in every estimate (docs/scale-gpu.md)."""
_PROGRESS = "progress.json"
_LOCK = "lock"
_FORMAT = 1

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}
_MEMORY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def format_bytes(n: float) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def parse_memory(text: Any, option: str = "--max-memory") -> int:
    """``"16G"``, ``"512MiB"``, ``"2.5GB"`` or a number of bytes -> bytes (binary units); ConfigError naming `option`."""
    if isinstance(text, (int, np.integer)) and not isinstance(text, bool) and text > 0:
        return int(text)
    m = _MEMORY.match(str(text))
    if not m or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise ConfigError(f"{option} {text!r}: expected a size such as 16G, 512M or 2.5GiB (binary units)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def default_max_memory() -> int:
    """80% of this machine's physical RAM (the default ``max_memory`` of a build)."""
    try:
        return int(0.8 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return 1 << 40


@dataclass(frozen=True)
class MemoryEstimate:
    """Estimated bytes of a build: the finished index (held in RAM to be searched) and the build's peak (index +
    training sample + one chunk and one add block + passages + encoder + the process's own runtime)."""

    index: int
    peak: int
    parts: dict

    def describe(self) -> str:
        return ", ".join(f"{k} {format_bytes(v)}" for k, v in self.parts.items() if v)


def index_bytes(spec: IndexSpec, n: int, d: int) -> int:
    """Bytes of a built index of `n` vectors of dimension `d` (faiss's storage plus its HNSW graph or IVF lists)."""
    graph = n * (spec.m * 2 * 4 * 17 // 16 + 24)  # level 0 holds 2m links; upper levels add ~1/m of that; level, offset
    if spec.kind == "flat":
        return n * d * 4
    if spec.kind == "hnsw":
        return n * d * 4 + graph
    if spec.kind == "hnsw_sq8":
        return n * d + graph + 8 * d
    nlist, pq_m = check_fits(spec, n, d)
    return n * ((pq_m * spec.pq_nbits + 7) // 8 + 8) + nlist * d * 4 + d * 4 * (1 << spec.pq_nbits)


def estimate_memory(spec: IndexSpec, n: int, d: int, *, chunk_rows: int = CHUNK_ROWS, passages_bytes: int = 0,
                    encoder_bytes: int = 0) -> MemoryEstimate:
    """The :class:`MemoryEstimate` of building `spec` over `n` vectors of dimension `d`, encoding `chunk_rows` at a time
    (0: vectors given, nothing encoded) with an encoder of `encoder_bytes` weights and passages taking `passages_bytes`."""
    idx = index_bytes(spec, n, d)
    if spec.kind == "ivf_pq":
        nlist, _ = check_fits(spec, n, d)
        train = train_bytes(n, d, nlist, spec.pq_nbits)  # the sample, k-means' state, the PQ subsample's residuals
    elif spec.kind == "hnsw_sq8":
        train = min(n, 100_000 + 2 * d) * d * 4
    else:
        train = 0
    parts = {"index": idx, "training sample": train, "encoding chunk": 2 * min(chunk_rows, n) * d * 4,
             "add block": min(_ADD_ROWS, n) * d * 4, "passages": passages_bytes, "encoder": encoder_bytes,
             "runtime": RUNTIME_BYTES}
    return MemoryEstimate(index=idx, peak=sum(parts.values()), parts=parts)


def passages_memory(passages: Sequence[Passage]) -> int:
    """Rough bytes the passages take in memory while a build holds them (text as Python strings and as Arrow)."""
    return sum(len(p.id) + len(p.title) + len(p.text) for p in passages) * 3 + 200 * len(passages)


def check_memory(spec: IndexSpec, n: int, d: int, max_memory: Optional[int | str], *, option: str = "--max-memory",
                 **kw: Any) -> MemoryEstimate:
    """The build's :class:`MemoryEstimate`; ConfigError (one line, with the numbers) when its peak exceeds `max_memory`
    (None: :func:`default_max_memory`). Keyword arguments as for :func:`estimate_memory`."""
    limit = default_max_memory() if max_memory is None else parse_memory(max_memory, option)
    est = estimate_memory(spec, n, d, **kw)
    if est.peak <= limit:
        return est
    given = f"{option} {format_bytes(limit)}" + (" (the default, 80% of RAM)" if max_memory is None else "")
    if spec.kind in ("flat", "hnsw", "hnsw_sq8"):
        smaller = estimate_memory(IndexSpec(kind="ivf_pq", metric=spec.metric), n, d, **kw) if n >= 256 else None
        hint = (f"; a {spec.kind} index must fit in RAM to be searched, so raise {option} to at least "
                f"{format_bytes(est.peak)} on a machine with that memory"
                + (f", or use --index ivf_pq (peak {format_bytes(smaller.peak)}, index {format_bytes(smaller.index)})"
                   if smaller is not None and smaller.peak < est.peak else ""))
    else:
        hint = f"; raise {option} to at least {format_bytes(est.peak)}, or lower nlist / pq_m"
    raise ConfigError(f"{given}: a {spec.kind} build of {n:,} vectors of dim {d} needs about {format_bytes(est.peak)} "
                      f"({est.describe()}){hint}")


# --------------------------------------------------------------------------- staged, resumable encoding


def staging_dir(out: str | os.PathLike) -> Path:
    """Where a build of `out` keeps its encoded chunks until it is written: ``.<name>.partial`` beside it."""
    out = Path(out)
    return out.parent / f".{out.name}.partial"


@contextlib.contextmanager
def _locked(staging: Path) -> Iterator[None]:
    import fcntl

    fd = os.open(staging / _LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise ConfigError(f"{staging}: another build of the same --out is using it; wait for that build to end or "
                              "stop it") from None
        yield
    finally:
        os.close(fd)  # drops the lock


def _chunk_digest(block: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(block, dtype=np.float32).tobytes()).hexdigest()


def _resumable(staging: Path, key: dict, n: int, d: int) -> dict[int, str]:
    """The chunks already encoded in `staging` under `key` whose bytes still match their record ({} if none)."""
    record = staging / _PROGRESS
    emb = staging / EMBEDDINGS
    if not record.is_file() or not emb.is_file():
        return {}
    try:
        progress = read_json(record, fix="")
    except RagError:
        return {}
    if not isinstance(progress, dict) or progress.get("format") != _FORMAT or progress.get("key") != key:
        logger.warning("%s holds chunks of another build (corpus, encoder, index spec or chunking differ): starting afresh",
                       staging)
        return {}
    try:
        vectors = NpyVectors(emb)
    except RagError:
        return {}
    if vectors.shape != (n, d):
        return {}
    done: dict[int, str] = {}
    chunk_rows = key["chunk_rows"]
    for name, digest in (progress.get("done") or {}).items():
        if not str(name).isdigit() or not 0 <= int(name) * chunk_rows < n or not isinstance(digest, str):
            continue
        start = int(name) * chunk_rows
        if _chunk_digest(vectors.rows(start, min(n, start + chunk_rows))) == digest:
            done[int(name)] = digest
    return done


def encode_staged(encoder, passages: Sequence[Passage], staging: Path, *, key: dict, chunk_rows: int = CHUNK_ROWS,
                  batch_size: int = 64, device=None, dtype=None, show_progress: bool = True) -> tuple[Path, int]:
    """Encode `passages` into ``staging/embeddings.npy`` ``(N, D)`` float32, `chunk_rows` passages per
    ``encoder.encode_passages`` call, resuming from the chunks a previous call under the same `key` finished.

    Returns (the file, chunks encoded by this call). Each chunk is checked finite, written, fsynced and then recorded
    with its SHA-256 in ``progress.json``. The caller removes `staging` once the knowledge base is written.
    """
    n, d = len(passages), int(encoder.dim)
    key = {**key, "chunk_rows": int(chunk_rows), "count": n, "dim": d}
    staging.mkdir(parents=True, exist_ok=True)
    emb = staging / EMBEDDINGS
    with _locked(staging):
        done = _resumable(staging, key, n, d)
        if not done:
            offset = create_npy(emb, (n, d))
        else:
            offset = NpyVectors(emb).offset
            logger.info("resuming the build in %s: %d of %d chunks already encoded", staging, len(done), -(-n // chunk_rows))
        atomic_write_json(staging / _PROGRESS, {"format": _FORMAT, "key": key, "done": {str(k): v for k, v in done.items()}})
        encoded = 0
        fd = os.open(emb, os.O_WRONLY)
        try:
            with tqdm(total=n, desc="encode", unit="passage", disable=not show_progress) as bar:
                for c, start in enumerate(range(0, n, chunk_rows)):
                    stop = min(n, start + chunk_rows)
                    if c in done:
                        bar.update(stop - start)
                        continue
                    block = encoder.encode_passages(passages[start:stop], batch_size=batch_size, show_progress=False,
                                                    device=device, dtype=dtype)
                    if not np.isfinite(block).all():
                        bad = start + int(np.flatnonzero(~np.isfinite(block).all(axis=1))[0])
                        raise RagError(f"embedding of passage {passages[bad].id!r} (row {bad}) contains NaN or inf; check "
                                       "the encoder (fp16 overflow?)")
                    write_rows(fd, offset, start, block)
                    os.fsync(fd)
                    done[c] = _chunk_digest(block)
                    del block
                    atomic_write_json(staging / _PROGRESS, {"format": _FORMAT, "key": key,
                                                            "done": {str(k): v for k, v in done.items()}})
                    encoded += 1
                    bar.update(stop - start)
        finally:
            os.close(fd)
    return emb, encoded


def build_key(passages: Sequence[Passage], encoder_identity: dict, spec: IndexSpec, dtype, device) -> dict:
    """What must match for a build to resume another's chunks: the corpus, the encoder, the spec, dtype and device."""
    return {"passages_digest": passages_digest(passages), "encoder": json.loads(json.dumps(encoder_identity, default=str)),
            "index": spec.to_dict(), "dtype": str(dtype), "device": str(device)}


# --------------------------------------------------------------------------- the directory writer


def _checksums(root: Path, show: bool) -> dict[str, dict]:
    files = sorted(f for f in root.rglob("*") if f.is_file())
    out: dict[str, dict] = {}
    with tqdm(total=sum(f.stat().st_size for f in files), desc="checksums", unit="B", unit_scale=True,
              disable=not show, leave=False) as bar:
        for f in files:
            size = f.stat().st_size
            out[f.relative_to(root).as_posix()] = {"sha256": sha256_file(f), "bytes": size}
            bar.update(size)
    return out


def _place(src: Path, dst: Path, link: bool) -> None:
    """Hard-link `src` to `dst` when `link` (a file the build owns) and the filesystem allows it; else copy it."""
    if link:
        with contextlib.suppress(OSError):
            os.link(src, dst)
            return
    shutil.copyfile(src, dst)


def write_knowledge_base(out: Path, passages: Sequence[Passage], vectors: Vectors, encoder: dict, spec: IndexSpec, *,
                         embeddings_file: Optional[Path] = None, link: bool = False, query_encoder: Optional[dict] = None,
                         parent: Optional[str] = None, bm25: bool = False, show_progress: bool = True,
                         overwrite: bool = False, build_info: Optional[dict] = None, gpu: Optional[bool] = None,
                         index_writer=write_index) -> Manifest:
    """Index `vectors` (row i = passage i) and write the knowledge base `out` atomically; return its manifest.

    `embeddings_file`: the ``.npy`` that `vectors` reads, copied into the directory as its ``embeddings.npy`` (with
    `link`, a file this build owns, e.g. its staging file: hard-linked where the filesystem allows); without it `vectors` must be
    an :class:`~rag.knowledge.vectors.ArrayVectors`, saved with ``np.save``. Either way the file's bytes, hence the version id,
    are those of ``np.save`` of the whole array. `index_writer(index, path)` writes ``index.faiss``
    (:func:`~rag.knowledge.index.write_index`).
    """
    import datasets

    if embeddings_file is None and not isinstance(vectors, ArrayVectors):
        raise RagError("write_knowledge_base: vectors read from a file need embeddings_file=")
    t0 = time.perf_counter()
    faiss_index = build_index(vectors, spec, show_progress=show_progress, gpu=gpu)
    index_seconds = time.perf_counter() - t0
    with atomic_directory(out, overwrite=overwrite, replaces=is_knowledge_base, kind="knowledge base") as tmp:
        with tqdm(total=1, desc="write passages", disable=not show_progress, leave=False) as bar:
            datasets.Dataset.from_dict(
                {"id": [p.id for p in passages], "title": [p.title for p in passages], "text": [p.text for p in passages]}
            ).save_to_disk(str(tmp / PASSAGES), num_shards=max(1, len(passages) // 2_000_000))
            bar.update(1)
        if embeddings_file is None:
            np.save(tmp / EMBEDDINGS, vectors.x)
        else:
            _place(embeddings_file, tmp / EMBEDDINGS, link)
        index_writer(faiss_index, tmp / INDEX)
        if bm25:
            BM25Index.build(passages, show_progress=show_progress).save(tmp / BM25_DIR)
        files = _checksums(tmp, show_progress)
        build = {"index_seconds": round(index_seconds, 3), "bytes_per_vector": round(bytes_per_vector(faiss_index), 2),
                 **(build_info or {})}
        manifest = new_manifest(passages, int(vectors.shape[1]), spec, encoder, files, parent=parent,
                                query_encoder=query_encoder, build=build)
        atomic_write_json(tmp / MANIFEST, manifest.to_dict())
    del faiss_index
    return manifest


def build_from_encoder(passages: Sequence[Passage], encoder, out: Path, index: IndexSpec | str, *, batch_size: int = 64,
                       device=None, dtype=None, query_encoder: Optional[str] = None, bm25: bool = False,
                       show_progress: bool = True, overwrite: bool = False, build_info: Optional[dict] = None,
                       max_memory: Optional[int | str] = None, chunk_rows: int = CHUNK_ROWS,
                       index_writer=write_index) -> Manifest:
    """:meth:`KnowledgeBase.build <rag.knowledge.knowledge_base.KnowledgeBase.build>`'s work: check everything, encode
    (staged, resumable), index from the staging file and write `out`; returns its manifest and removes the staging."""
    passages = list(passages)
    check_passages(passages, str(out))
    # Everything that can be checked is checked before encoding, which takes hours on a large corpus.
    spec = IndexSpec.parse(index) if isinstance(index, str) else index
    check_fits(spec, len(passages), encoder.dim)
    check_positive_int(batch_size, "batch_size (--batch-size)", error=ConfigError)
    check_positive_int(chunk_rows, "chunk_rows", error=ConfigError)
    check_device(device)
    check_output_dir(out, overwrite, replaces=is_knowledge_base, kind="knowledge base")
    check_memory(spec, len(passages), encoder.dim, max_memory, chunk_rows=chunk_rows, passages_bytes=passages_memory(passages),
                 encoder_bytes=sum(p.numel() * p.element_size() for p in encoder.parameters()))
    ident = encoder.identity()
    staging = staging_dir(out)
    t0 = time.perf_counter()
    emb, _ = encode_staged(encoder, passages, staging, key=build_key(passages, ident, spec, dtype, device),
                           chunk_rows=chunk_rows, batch_size=batch_size, device=device, dtype=dtype, show_progress=show_progress)
    info = {"encode_seconds": round(time.perf_counter() - t0, 3), **(build_info or {})}
    qenc = {"name": query_encoder} if query_encoder else None
    on_cpu = device is not None and torch.device(device).type == "cpu"
    manifest = write_knowledge_base(out, passages, NpyVectors(emb, checked_finite=True), ident, spec, embeddings_file=emb,
                                    link=True,
                                    query_encoder=qenc, bm25=bm25, show_progress=show_progress, overwrite=overwrite,
                                    build_info=info, gpu=False if on_cpu else None, index_writer=index_writer)
    shutil.rmtree(staging, ignore_errors=True)
    return manifest


def write_from_embeddings(out: Path, passages: Sequence[Passage], embeddings: np.ndarray | str | os.PathLike, encoder: dict,
                          index: IndexSpec | str, *, max_memory: Optional[int | str] = None, **kw: Any) -> Manifest:
    """:meth:`KnowledgeBase.from_embeddings <rag.knowledge.knowledge_base.KnowledgeBase.from_embeddings>`'s work: check
    the passages and the `(N, D)` embeddings (an array, or a ``.npy`` path read in blocks), then
    :func:`write_knowledge_base` (keyword arguments as for it)."""
    passages = list(passages)
    check_passages(passages, str(out))
    spec = IndexSpec.parse(index) if isinstance(index, str) else index
    check_output_dir(out, kw.get("overwrite", False), replaces=is_knowledge_base, kind="knowledge base")
    file = None
    if isinstance(embeddings, (str, os.PathLike)):
        file = Path(embeddings)
        vectors: Vectors = NpyVectors(file)
    else:
        embeddings = np.ascontiguousarray(embeddings, dtype=np.float32)
        if embeddings.ndim != 2:
            raise RagError(f"embeddings have shape {tuple(embeddings.shape)}; expected ({len(passages)}, dim) — one "
                           f"row per passage")
        vectors = ArrayVectors(embeddings)
    if vectors.shape[0] != len(passages):
        raise RagError(f"embeddings have shape {tuple(vectors.shape)}; expected ({len(passages)}, dim) — one row per passage")
    if "dim" in encoder and int(encoder["dim"]) != vectors.shape[1]:
        raise RagError(f"encoder identity says dim={encoder['dim']} but embeddings have dim {vectors.shape[1]}")
    check_fits(spec, len(passages), vectors.shape[1])
    check_memory(spec, len(passages), vectors.shape[1], max_memory, chunk_rows=0, passages_bytes=passages_memory(passages))
    for start, block in vectors.blocks(16_384):
        if not np.isfinite(block).all():
            bad = start + int(np.flatnonzero(~np.isfinite(block).all(axis=1))[0])
            raise RagError(f"embedding of passage {passages[bad].id!r} (row {bad}) contains NaN or inf; check the encoder "
                           "(fp16 overflow?)")
    vectors.checked_finite = True
    return write_knowledge_base(out, passages, vectors, encoder, spec, embeddings_file=file, **kw)
