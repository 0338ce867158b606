"""Training-time index refresh: re-encode a knowledge base's passages with an updated document encoder.

When the document encoder trains (``RagModelConfig.train_doc_encoder``), the vectors in the index
go stale. REPLUG (Shi et al. 2023, §4.4), following REALM, recomputes the document embeddings and
rebuilds the index every T training steps. This module is the *build* half of that loop; the
scheduling and the swap live in :class:`rag.training.callbacks.IndexRefresh`.

The build runs in its own process so that training never waits for it::

    python -m rag.knowledge.refresh --knowledge-base OLD_KB --encoder SNAPSHOT_DIR --out NEW_KB

`SNAPSHOT_DIR` is the document encoder as the trainer saved it (``TextEncoder.save_pretrained``)
at the refresh step. The new knowledge base holds the same passages (same order, so row numbers
keep their meaning), the same index spec and BM25 setting, the new encoder's identity (its
``name`` is the snapshot directory, which reproduces its fingerprint) and ``parent`` = the old
version. It is written with :meth:`KnowledgeBase.from_embeddings`, i.e. in a hidden temporary
sibling renamed into place at the very end: a build that crashes or is killed leaves no
directory that :meth:`KnowledgeBase.open` accepts, so nothing half-built can ever be swapped in.

With ``--ray [ADDRESS] --workers N`` (:class:`~rag.training.callbacks.IndexRefresh`'s ``ray_address``) the
re-encoding runs as N Ray tasks, one contiguous slice of the passages each (:func:`encode_on_ray`); each loads the
snapshot itself (the same path on every node), checks its weights fingerprint, and returns its slice's vectors, which
are concatenated in passage order and written as above. A worker that dies is retried by Ray; an address that does
not answer fails at once, naming it.

Exit status: 0 on success (the last stdout line is a JSON summary), 1 with the error on stderr.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np

from rag.knowledge.encoders import TextEncoder, check_fingerprint
from rag.knowledge.knowledge_base import KnowledgeBase
from rag.knowledge.ray_pool import check_reachable, connect
from rag.utils.errors import ConfigError, KnowledgeBaseError, RagError

logger = logging.getLogger(__name__)

__all__ = ["build_refreshed_kb", "encode_on_ray", "load_document_encoder", "main"]


def load_document_encoder(kb, name_or_path=None):
    """The document encoder for `kb` as a trainable :class:`~rag.knowledge.encoders.TextEncoder`.

    `name_or_path` None loads the encoder the knowledge base's manifest names, with its recorded
    pooling / normalisation / max_length, and checks that its weights still have the recorded
    fingerprint (otherwise the index and the encoder would disagree from step 0). An explicit name,
    path or TextEncoder is used as given (loaded with the manifest's settings).

    Raises:
        KnowledgeBaseError: the manifest's encoder now loads with other weights, or records no name.
    """
    if isinstance(name_or_path, TextEncoder):
        return name_or_path
    ident = kb.encoder
    name = os.fspath(name_or_path) if name_or_path is not None else ident.get("name")
    if not name:
        raise KnowledgeBaseError(f"{kb.path}: its manifest names no document encoder; pass the document encoder explicitly")
    enc = TextEncoder(
        name,
        pooling=ident.get("pooling", "auto"),
        normalize=ident.get("normalize"),
        max_length=ident.get("max_length", 256),
        role="context",
    )
    if name_or_path is None and ident.get("fingerprint"):
        check_fingerprint(enc, ident["fingerprint"], lambda found: (
            f"{kb.path}: its document encoder {name!r} now loads with other weights (fingerprint {found[:12]}) than "
            f"the index was built with ({ident['fingerprint'][:12]}); rebuild the knowledge base, or pass the "
            "document encoder explicitly"), error=KnowledgeBaseError)
    return enc


def _encode_slice(load: Callable[[], Any], passages: list, fingerprint: str, batch_size: int, device: str) -> np.ndarray:
    """One Ray task: load the encoder, check its fingerprint, encode this slice -> (len(passages), dim) float32."""
    encoder = load()
    got = encoder.identity().get("fingerprint")
    if got != fingerprint:
        raise RagError(f"the encoder a Ray worker loaded has weights fingerprint {str(got)[:12]}, the driver's "
                       f"{fingerprint[:12]}; every worker must read the same encoder snapshot (same path on every node)")
    return np.asarray(encoder.encode_passages(passages, batch_size=batch_size, show_progress=False, device=device),
                      dtype=np.float32)


def encode_on_ray(passages: Sequence, load: Callable[[], Any], fingerprint: str, *, address: Optional[str], workers: int,
                  batch_size: int = 64, device: str = "cpu", max_retries: int = 3, num_gpus: float = 0.0,
                  show_progress: bool = False) -> np.ndarray:
    """The vectors of `passages` in their order, encoded by `workers` Ray tasks (one contiguous slice each).

    `load`: a picklable zero-argument callable each task calls to get the encoder; its weights fingerprint must be
    `fingerprint`. `address`: the Ray cluster (``host:port``, ``ray://host:port``, ``auto``; None: join or start a
    local Ray; an already initialised Ray is used as is); one that does not answer is a ConfigError naming it. A task
    whose worker process dies is retried up to `max_retries` times; an error the encoding raises is raised here.
    Returns (len(passages), dim) float32.
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"--workers {workers!r}: expected a positive number of Ray workers")
    if workers > len(passages):
        raise ConfigError(f"--workers {workers}: the knowledge base has {len(passages)} passages, fewer than {workers} "
                          f"workers (one slice each); use --workers {len(passages)} or fewer")
    ray = connect(address, error=ConfigError, option="--ray")
    task = ray.remote(_encode_slice).options(max_retries=max_retries, retry_exceptions=False, num_cpus=1,
                                             num_gpus=num_gpus)
    load_ref = ray.put(load)
    bounds = [(len(passages) * i // workers, len(passages) * (i + 1) // workers) for i in range(workers)]
    refs = [task.remote(load_ref, list(passages[a:b]), fingerprint, batch_size, device) for a, b in bounds]
    parts: dict = {}
    pending = list(refs)
    try:
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            try:
                parts[ready[0]] = ray.get(ready[0])
            except ray.exceptions.RayTaskError as e:  # the encoding raised: its own error
                cause = getattr(e, "cause", None)
                raise (cause if isinstance(cause, Exception) else RagError(str(e))) from e
            except ray.exceptions.RayError as e:  # the worker died more often than Ray retries
                raise RagError(f"a slice of the Ray refresh failed after {max_retries} retries ({type(e).__name__}); "
                               "re-run the refresh") from e
            if show_progress:
                logger.info("Ray refresh: %d/%d slices encoded", len(parts), workers)
    except BaseException:
        for ref in pending:
            ray.cancel(ref, force=True)
        raise
    return np.concatenate([parts[r] for r in refs], axis=0)


def build_refreshed_kb(
    knowledge_base: str | os.PathLike,
    encoder_dir: str | os.PathLike,
    out: str | os.PathLike,
    *,
    index: Optional[str] = None,
    batch_size: int = 64,
    device: str = "auto",
    show_progress: bool = False,
    build_info: Optional[dict] = None,
    ray_address: Optional[str] = None,
    ray_workers: Optional[int] = None,
) -> dict:
    """Re-encode every passage of `knowledge_base` with the encoder saved in `encoder_dir` and write a
    new knowledge base at `out` (atomically; `out` must not exist).

    Args:
        knowledge_base: the knowledge base serving now (its passages, index spec, BM25 setting and query
            encoder are kept).
        encoder_dir: a ``TextEncoder.save_pretrained`` directory (the trainer's snapshot).
        out: the new knowledge-base directory.
        index: FAISS index spec for the new index (default: the old one's).
        batch_size: passages per encoder batch.
        device: ``auto`` (CUDA when available, else CPU), ``cpu``, ``cuda``, ``cuda:1``, ...
        build_info: extra fields for the manifest's ``build`` record (e.g. the training step).
        ray_address / ray_workers: re-encode on `ray_workers` Ray tasks (:func:`encode_on_ray`; `ray_address` None
            with `ray_workers` set: a local Ray, or the one already initialised). Neither: encode here.

    Returns:
        A JSON-serialisable summary: ``path``, ``version``, ``parent``, ``fingerprint``, ``count``,
        ``encode_seconds``, ``seconds``.
    """
    import torch

    t0 = time.perf_counter()
    old = KnowledgeBase.open(knowledge_base, verify="size")
    encoder = TextEncoder.from_pretrained(encoder_dir)
    if encoder.dim != old.dim:
        raise KnowledgeBaseError(
            f"{encoder_dir}: the document encoder outputs dim={encoder.dim} but {old.path} holds dim={old.dim} vectors "
            "searched by a query encoder of that dimension; the refreshed index must keep the dimension"
        )
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    passages = old.all_passages()
    te = time.perf_counter()
    if ray_workers is None and ray_address is None:
        vectors = encoder.encode_passages(passages, batch_size=batch_size, show_progress=show_progress, device=device)
    else:
        vectors = encode_on_ray(passages, functools.partial(TextEncoder.from_pretrained, os.fspath(encoder_dir)),
                                encoder.identity()["fingerprint"], address=ray_address, workers=ray_workers or 2,
                                batch_size=batch_size, device=device, num_gpus=1.0 if device.startswith("cuda") else 0.0,
                                show_progress=show_progress)
        info = {"ray_workers": ray_workers or 2}
        build_info = {**info, **(build_info or {})}
    encode_seconds = time.perf_counter() - te
    new = KnowledgeBase.from_embeddings(
        passages, vectors, encoder.identity(), out,
        index=index or old.index_spec,
        query_encoder=old.manifest.query_encoder,
        parent=old.version,
        bm25=old.bm25 is not None,
        show_progress=show_progress,
        build_info={"encode_seconds": round(encode_seconds, 3), "refresh_device": str(device), **(build_info or {})},
    )
    return {
        "path": str(Path(out).resolve()),
        "version": new.version,
        "parent": old.version,
        "fingerprint": new.encoder.get("fingerprint"),
        "count": len(new),
        "encode_seconds": round(encode_seconds, 3),
        "seconds": round(time.perf_counter() - t0, 3),
    }


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m rag.knowledge.refresh",
        description="Re-encode a knowledge base with an updated document encoder and write a new version (its parent "
                    "= the old one).",
    )
    p.add_argument("--knowledge-base", required=True, help="the knowledge base serving now")
    p.add_argument("--encoder", required=True, help="TextEncoder.save_pretrained directory of the updated document encoder")
    p.add_argument("--out", required=True, help="directory of the new knowledge base (must not exist)")
    p.add_argument("--index", default=None, help="FAISS index spec (default: the old knowledge base's)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--threads", type=int, default=0, help="torch/FAISS CPU threads (0: library default)")
    p.add_argument("--nice", type=int, default=0, help="lower this process's CPU priority by this much (0-19)")
    p.add_argument("--step", type=int, default=None, help="training step recorded in the manifest")
    p.add_argument("--progress", action="store_true", help="show a progress bar")
    p.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="re-encode on Ray workers: join the cluster at ADDRESS (host:port, ray://host:port, auto), or "
                        "without ADDRESS a local Ray")
    p.add_argument("--workers", type=int, default=None, metavar="N", help="with --ray: the number of workers; default 2")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point; returns the exit status."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.nice:
            os.nice(max(0, min(19, args.nice)))
        if args.threads < 0 or args.batch_size < 1:
            raise ConfigError(f"--threads must be >= 0 and --batch-size >= 1 (got {args.threads}, {args.batch_size})")
        if args.threads:
            import faiss
            import torch

            torch.set_num_threads(args.threads)
            faiss.omp_set_num_threads(args.threads)
        if args.workers is not None and args.ray is None:
            raise ConfigError(f"--workers {args.workers}: only means something with --ray; add --ray [ADDRESS] or drop --workers")
        if args.ray:  # an address that does not answer fails now, naming it, before the corpus is read
            check_reachable(args.ray, 5.0, ConfigError, "--ray")
        info = {"refresh_step": args.step} if args.step is not None else {}
        summary = build_refreshed_kb(
            args.knowledge_base, args.encoder, args.out, index=args.index, batch_size=args.batch_size,
            device=args.device, show_progress=args.progress, build_info=info,
            ray_address=args.ray or None, ray_workers=(args.workers or 2) if args.ray is not None else None,
        )
    except (RagError, FileExistsError) as e:
        print(f"rag.knowledge.refresh: {e}", file=sys.stderr)
        return 1
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover - exercised through subprocesses in tests
    sys.exit(main())
