"""Encoding a corpus on N Ray workers: one Ray task per shard, then the ordinary verified merge.

``build_on_ray(passages, encoder, out, workers=N)`` (``rag index build --ray [ADDRESS] --workers N``) splits the
corpus into the N contiguous slices of ``rag index build --shard i/N`` and runs one Ray task per slice. Each task
obtains the encoder (the driver's, shipped through Ray's object store, or ``worker_encoder()``), checks that its
weights fingerprint is the driver's, and writes its slice as an ordinary shard knowledge base (flat index, manifest,
SHA-256 checksums, atomic rename) under ``.<out>.ray-shards/`` beside `out`; :func:`~rag.knowledge.shards.merge_shards`
then verifies every shard's checksums and writes `out` with the requested index. The result has the manifest
guarantees of a one-shot build, and its rows are a one-shot build's.

Faults: a worker process that dies is retried by Ray (``max_retries``), and the retried task resumes from the chunks
its predecessor finished (:func:`rag.knowledge.build.encode_staged`); a shard already written by an earlier, killed
run of the same command is reused. An error raised by the encoding itself is not retried: it is raised here.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from tqdm.auto import tqdm

from rag.knowledge.build import CHUNK_ROWS, check_memory, passages_memory
from rag.knowledge.encoders import TextEncoder
from rag.knowledge.index import IndexSpec, check_fits
from rag.knowledge.knowledge_base import KnowledgeBase
from rag.knowledge.manifest import check_passages, is_knowledge_base
from rag.knowledge.passages import Passage
from rag.knowledge.ray_pool import connect
from rag.knowledge.shards import ShardSpec, merge_shards, shard_info
from rag.utils.errors import ConfigError, RagError
from rag.utils.io import check_output_dir
from rag.utils.validate import check_positive_int

__all__ = ["build_on_ray", "ray_shards_dir"]

logger = logging.getLogger(__name__)


def ray_shards_dir(out: str | os.PathLike) -> Path:
    """Where a Ray build of `out` writes its shard knowledge bases: ``.<name>.ray-shards`` beside it."""
    out = Path(out)
    return out.parent / f".{out.name}.ray-shards"


def _encode_shard(passages: list, encoder: Any, out: str, fingerprint: str, build_info: dict, kw: dict) -> str:
    """One Ray task: encode this slice into the shard knowledge base `out` (flat index); returns its version."""
    enc = encoder() if not isinstance(encoder, TextEncoder) else encoder
    got = enc.identity().get("fingerprint")
    if got != fingerprint:
        raise RagError(f"the encoder a Ray worker loaded has weights fingerprint {str(got)[:12]}, the driver's "
                       f"{fingerprint[:12]}; every worker must read the same encoder (same path on every node)")
    kb = KnowledgeBase.build(passages, enc, out, index="flat", build_info=build_info, show_progress=False, overwrite=True, **kw)
    return kb.version


def _finished_shard(path: Path, info: dict, fingerprint: str) -> bool:
    """True when `path` holds the shard `info` describes, written completely by an earlier run (checksums verified)."""
    if not is_knowledge_base(path):
        return False
    try:
        kb = KnowledgeBase.open(path)
    except RagError:
        return False
    return kb.manifest.build.get("shard") == info and kb.encoder.get("fingerprint") == fingerprint


def build_on_ray(
    passages: Sequence[Passage],
    encoder: TextEncoder,
    out: str | os.PathLike,
    *,
    workers: int,
    address: Optional[str] = None,
    index: IndexSpec | str = "hnsw",
    worker_encoder: Optional[Callable[[], TextEncoder]] = None,
    batch_size: int = 64,
    chunk_rows: int = CHUNK_ROWS,
    device: Optional[str] = None,
    dtype=None,
    query_encoder: Optional[str] = None,
    bm25: bool = False,
    show_progress: bool = True,
    overwrite: bool = False,
    build_info: Optional[dict] = None,
    max_memory: Optional[int | str] = None,
    max_retries: int = 3,
    num_cpus: float = 1.0,
    num_gpus: float = 0.0,
) -> KnowledgeBase:
    """Build the knowledge base `out` of `passages`, encoding on `workers` Ray tasks (one contiguous shard each).

    `encoder` is the document encoder (its identity is recorded; without `worker_encoder` it is also what the workers
    run, shipped through Ray's object store). `worker_encoder`: a picklable zero-argument callable each worker calls to
    load the encoder instead (e.g. ``functools.partial(TextEncoder, path)``); its fingerprint must equal `encoder`'s.
    `address`: a Ray cluster (``host:port``, ``ray://host:port``, ``auto``); None joins or starts a local Ray; one
    that does not answer is a ConfigError naming it, at once. `num_cpus` / `num_gpus`: Ray resources per task.
    `chunk_rows`: passages a worker encodes and records at a time (what a retried task resumes from). Other
    arguments as for :meth:`KnowledgeBase.build`. Returns the merged, opened knowledge base.
    """
    passages = list(passages)
    out = Path(out)
    check_passages(passages, str(out))
    spec = IndexSpec.parse(index) if isinstance(index, str) else index
    check_positive_int(workers, "--workers", error=ConfigError)
    if workers > len(passages):
        raise ConfigError(f"--workers {workers}: the corpus has {len(passages)} passages, fewer than {workers} workers (one "
                          f"shard each); use --workers {len(passages)} or fewer")
    check_positive_int(batch_size, "batch_size (--batch-size)", error=ConfigError)
    check_positive_int(chunk_rows, "chunk_rows", error=ConfigError)
    check_fits(spec, len(passages), encoder.dim)
    check_output_dir(out, overwrite, replaces=is_knowledge_base, kind="knowledge base")
    check_memory(spec, len(passages), encoder.dim, max_memory, chunk_rows=0, passages_bytes=passages_memory(passages))
    ray = connect(address, error=ConfigError, option="--ray")
    fingerprint = encoder.identity()["fingerprint"]
    root = ray_shards_dir(out)
    root.mkdir(parents=True, exist_ok=True)
    task = ray.remote(_encode_shard).options(max_retries=max_retries, retry_exceptions=False, num_cpus=num_cpus,
                                             num_gpus=num_gpus)
    enc_ref = ray.put(worker_encoder if worker_encoder is not None else encoder)
    kw = {"batch_size": batch_size, "chunk_rows": chunk_rows, "device": device, "dtype": dtype, "query_encoder": query_encoder}
    dirs, pending = [], {}
    for i in range(workers):
        shard = ShardSpec(i, workers)
        info = shard_info(passages, shard, spec.to_string())
        path = root / f"shard-{i}"
        dirs.append(path)
        if _finished_shard(path, info, fingerprint):
            logger.info("reusing shard %s written by an earlier run: %s", shard, path)
            continue
        start, stop = shard.bounds(len(passages))
        shard_build = {**(build_info or {}), "shard": info, "ray_workers": workers}
        pending[task.remote(ray.put(passages[start:stop]), enc_ref, str(path), fingerprint, shard_build, kw)] = shard
    with tqdm(total=len(dirs), initial=len(dirs) - len(pending), desc=f"encode on {workers} Ray workers", unit="shard",
              disable=not show_progress) as bar:
        refs = list(pending)
        try:
            while refs:
                ready, refs = ray.wait(refs, num_returns=1)
                try:
                    ray.get(ready[0])
                except ray.exceptions.RayTaskError as e:  # the encoding raised: the worker's own error, not retried
                    cause = getattr(e, "cause", None)
                    raise (cause if isinstance(cause, Exception) else RagError(str(e))) from e
                except ray.exceptions.RayError as e:  # the worker died more often than Ray retries
                    raise RagError(f"shard {pending[ready[0]]} of the Ray build failed after {max_retries} retries "
                                   f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); re-run the same "
                                   f"command: finished shards in {root} are reused") from e
                bar.update(1)
        except BaseException:
            for ref in refs:  # the other shards' work is not waited for
                ray.cancel(ref, force=True)
            raise
    kb = merge_shards(out, dirs, index=spec.to_string(), bm25=bm25, verify="full", show_progress=show_progress,
                      overwrite=overwrite, max_memory=max_memory)
    shutil.rmtree(root, ignore_errors=True)
    return kb
