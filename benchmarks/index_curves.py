"""Scale curves on real vectors: build time, peak RSS, index bytes, queries/s and recall@10 per index spec and size.

The corpus is read and split as ``rag index build`` does (``--corpus``: any of its sources, e.g. the Debian text
sources GCIDE, WordNet, the Jargon File, FOLDOC and python3-doc converted to text) and encoded once with ``--encoder``
(staged and resumable, :func:`rag.knowledge.build.encode_staged`) into ``--cache`` (outside git; rebuilt when missing,
keyed by the passages' digest and the encoder). A seeded permutation holds out ``--queries`` passages as queries; the
first N of the rest are the base at each size in ``--sizes`` (``all`` = every one). Exact top-10 comes from a flat
inner-product scan in blocks. Each (spec, N) is built from a ``.npy`` in blocks in a fresh child process on
``--threads`` faiss threads, which reports build seconds, peak RSS (``VmHWM``), index bytes, queries/s (one batched
search, best of 3) and recall@10.

``--synthetic N …`` adds sizes beyond the real set for the memory and build-time curves: vectors with the real set's
cluster structure (k-means centroids of the real vectors plus the residual of a random real member of that cluster,
its coordinates randomly sign-flipped, L2-normalised), not i.i.d. noise; recall is not reported for them. Build time
and peak RSS are fitted per spec as power laws ``c·N^e`` over every size measured::

    python benchmarks/index_curves.py --corpus /data/debian-text --sizes 10000 30000 100000 all \\
        --synthetic 300000 1000000 --specs flat hnsw hnsw_sq8 ivf_pq --json benchmarks/results/index_curves.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rag.knowledge.build import _chunk_digest, encode_staged  # noqa: E402
from rag.knowledge.encoders import TextEncoder
from rag.knowledge.manifest import passages_digest  # noqa: E402
from rag.knowledge.passages import load_corpus
from rag.knowledge.vectors import NpyVectors, create_npy, write_rows  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BLOCK = 16_384

CHILD = r"""
import dataclasses, json, os, sys, time
import numpy as np
from rag.knowledge.index import IndexSpec, build_index, faiss_threads, search_index, write_index
from rag.knowledge.vectors import NpyVectors

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
SWEEP = {"hnsw": ("ef_search", [16, 32, 64, 128, 256, 512]), "hnsw_sq8": ("ef_search", [16, 32, 64, 128, 256, 512]),
         "ivf_pq": ("nprobe", [4, 8, 16, 32, 64, 128, 256])}
RESCORE = 100  # candidates re-scored against the stored float vectors (embeddings.npy) for the quantised kinds
base_file, spec, threads, queries_file, truth_file, out = sys.argv[1:7]
spec = IndexSpec.parse(spec)
with faiss_threads(int(threads)):
    base_rss = status("VmRSS")
    t0 = time.perf_counter()
    index = build_index(NpyVectors(base_file), spec, show_progress=False)
    build_s = time.perf_counter() - t0
    write_index(index, out)
    r = {"build_s": build_s, "peak_rss": status("VmHWM"), "base_rss": base_rss, "index_bytes": os.path.getsize(out)}
    r["beyond_index"] = r["peak_rss"] - r["base_rss"] - r["index_bytes"]
    if queries_file != "-":
        q, truth = np.load(queries_file), np.load(truth_file)
        base = np.load(base_file, mmap_mode="r")
        def run(sp, rescore):
            best = float("inf")
            for _ in range(2):
                t = time.perf_counter()
                _, rows = search_index(index, q, RESCORE if rescore else 10, sp)
                if rescore:
                    s = np.einsum("bd,bkd->bk", q, base[rows])
                    rows = np.take_along_axis(rows, np.argsort(-s, axis=1, kind="stable")[:, :10], 1)
                best = min(best, time.perf_counter() - t)
            recall = float(np.mean([len(np.intersect1d(a, b)) / 10 for a, b in zip(rows, truth)]))
            return {"qps": len(q) / best, "recall_at_10": recall}
        r.update(run(spec, False))
        if spec.kind in SWEEP:
            name, values = SWEEP[spec.kind]
            r["sweep"] = []
            for rescore in ([False, True] if spec.kind != "hnsw" else [False]):
                for v in values:
                    sp = dataclasses.replace(spec, **{name: v})
                    r["sweep"].append({name: v, "rescore": RESCORE if rescore else 0, **run(sp, rescore)})
            ok = [x for x in r["sweep"] if x["recall_at_10"] >= 0.95]
            r["best_at_0.95"] = max(ok, key=lambda x: x["qps"]) if ok else None
print(json.dumps(r))
"""


CHUNK = 4096  # passages per resumable encoding chunk (small: a slow machine's partial encoding is usable, --partial)


def real_vectors(corpus: list[str], encoder_name: str, cache: Path, partial: bool = False) -> Path:
    """The cached embeddings of the corpus's passages (encoded, staged and resumable, when missing).

    `partial`: do not encode; use the longest prefix of chunks an earlier (possibly still running) encoding of this
    corpus has finished, each re-checked against its recorded SHA-256, copied to ``<cache>/…_prefixN.npy``."""
    passages = load_corpus(corpus if len(corpus) > 1 else corpus[0], show_progress=True)
    tag = re.sub(r"[^A-Za-z0-9_.-]", "_", encoder_name)
    path = cache / f"vectors_{passages_digest(passages)[:16]}_{tag}.npy"
    if not path.exists() and partial:
        return finished_prefix(cache / f".{path.name}.partial", path)
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        encoder = TextEncoder(encoder_name, role="context")
        staging = cache / f".{path.name}.partial"
        emb, _ = encode_staged(encoder, passages, staging, key={"encoder": encoder.identity()}, chunk_rows=CHUNK)
        os.replace(emb, path)
        shutil.rmtree(staging, ignore_errors=True)
    return path


def finished_prefix(staging: Path, path: Path) -> Path:
    """The rows of the chunks 0..k-1 that the staged encoding in `staging` has finished (checked), as a .npy."""
    progress = json.loads((staging / "progress.json").read_text())
    rows, n = progress["key"]["chunk_rows"], progress["key"]["count"]
    done = {int(c) for c in progress["done"]}
    k = next(c for c in range(len(done) + 1) if c not in done)
    if k == 0:
        raise SystemExit(f"--partial: no chunk of {staging} is finished yet")
    src = NpyVectors(staging / "embeddings.npy")
    stop = min(n, k * rows)
    out = path.with_name(f"{path.stem}_prefix{stop}.npy")
    if not out.exists():
        for c in range(k):
            if _chunk_digest(src.take(np.arange(c * rows, min(n, (c + 1) * rows)))) != progress["done"][str(c)]:
                raise SystemExit(f"--partial: chunk {c} of {staging} does not match its recorded SHA-256")
        write_subset(src, np.arange(stop), out)
    return out


def write_subset(src: NpyVectors, rows: np.ndarray, path: Path) -> None:
    """Rows `rows` of `src` (in that order) as a new .npy, block by block."""
    offset = create_npy(path, (len(rows), src.shape[1]))
    fd = os.open(path, os.O_WRONLY)
    try:
        for s in range(0, len(rows), BLOCK):
            part = rows[s:s + BLOCK]
            order = np.argsort(part)
            block = np.empty((len(part), src.shape[1]), np.float32)
            block[order] = src.take(part[order])
            write_rows(fd, offset, s, block)
    finally:
        os.close(fd)


def synthetic(src: NpyVectors, n: int, path: Path, seed: int, clusters: int = 256) -> None:
    """`n` vectors with the real set's cluster structure (see the module docstring), written block by block."""
    import faiss

    rng = np.random.default_rng(seed)
    sample = src.take(np.sort(rng.choice(src.shape[0], size=min(src.shape[0], 50 * clusters), replace=False)))
    k = max(1, min(clusters, len(sample) // 39))
    km = faiss.Kmeans(sample.shape[1], k, niter=20, seed=seed, verbose=False)
    km.train(sample)
    _, assign = km.index.search(sample, 1)
    residual = sample - km.centroids[assign[:, 0]]
    offset = create_npy(path, (n, sample.shape[1]))
    fd = os.open(path, os.O_WRONLY)
    try:
        for s in range(0, n, BLOCK):
            m = min(BLOCK, n - s)
            j = rng.integers(0, len(sample), m)
            signs = rng.choice(np.array([-1.0, 1.0], np.float32), size=(m, sample.shape[1]))
            x = km.centroids[assign[j, 0]] + residual[j] * signs
            x /= np.linalg.norm(x, axis=1, keepdims=True) + 1e-12
            write_rows(fd, offset, s, x.astype(np.float32))
    finally:
        os.close(fd)


def exact_top10(base: NpyVectors, q: np.ndarray) -> np.ndarray:
    best_s = np.full((len(q), 10), -np.inf, np.float32)
    best_r = np.zeros((len(q), 10), np.int64)
    for start, block in base.blocks(BLOCK):
        s = q @ block.T
        rows = np.broadcast_to(np.arange(start, start + block.shape[0]), s.shape)
        all_s, all_r = np.concatenate([best_s, s], axis=1), np.concatenate([best_r, rows], axis=1)
        top = np.argsort(-all_s, axis=1, kind="stable")[:, :10]
        best_s, best_r = np.take_along_axis(all_s, top, 1), np.take_along_axis(all_r, top, 1)
    return best_r


def measure(base: Path, spec: str, threads: int, qfile: str, tfile: str, tmp: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(base), spec, str(threads), qfile, tfile, str(tmp / "index.faiss")],
                          env=env, capture_output=True, text=True, check=False)
    if proc.returncode:  # e.g. a spec that refuses this N (ivf_pq below its training minimum): recorded, not fatal
        return {"error": (proc.stderr.strip().splitlines() or ["exit status %d" % proc.returncode])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def power_law(ns: list[int], ys: list[float]) -> dict:
    if len(ns) < 2:
        return {}
    e, logc = np.polyfit(np.log(ns), np.log(ys), 1)
    return {"c": float(np.exp(logc)), "e": float(e)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", nargs="+", required=True, help="corpus sources, as rag index build --corpus reads them")
    ap.add_argument("--encoder", default="minilm")
    ap.add_argument("--cache", default=str(Path(os.environ.get("RAG_CACHE", Path.home() / ".cache" / "rag")) / "bench"))
    ap.add_argument("--sizes", nargs="*", default=["10000", "30000", "100000", "all"])
    ap.add_argument("--synthetic", type=int, nargs="*", default=[])
    ap.add_argument("--specs", nargs="+", default=["flat", "hnsw", "hnsw_sq8", "ivf_pq"])
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--partial", action="store_true",
                    help="use the chunks an earlier or running encoding of the corpus has finished (no encoding here)")
    args = ap.parse_args(argv)
    src = NpyVectors(real_vectors(args.corpus, args.encoder, Path(args.cache), partial=args.partial))
    n_real = src.shape[0] - args.queries
    if n_real < 1:
        raise SystemExit(f"--queries {args.queries}: the corpus has only {src.shape[0]} passages")
    perm = np.random.default_rng(args.seed).permutation(src.shape[0])
    qrows, rest = perm[:args.queries], perm[args.queries:]
    sizes = sorted({n_real if s == "all" else min(int(s), n_real) for s in args.sizes})
    rows = []
    with tempfile.TemporaryDirectory(prefix="index_curves_") as tmpdir:
        tmp = Path(tmpdir)
        q = src.take(np.sort(qrows))
        np.save(tmp / "q.npy", q)
        jobs = [(n, "real") for n in sizes] + [(n, "synthetic") for n in args.synthetic]
        for n, kind in jobs:
            base = tmp / f"base{n}.npy"
            if kind == "real":
                write_subset(src, rest[:n], base)
                np.save(tmp / "truth.npy", exact_top10(NpyVectors(base), q))
                qfile, tfile = str(tmp / "q.npy"), str(tmp / "truth.npy")
            else:
                synthetic(src, n, base, args.seed)
                qfile = tfile = "-"
            for spec in args.specs:
                r = {"n": n, "data": kind, "spec": spec, "dim": src.shape[1], "threads": args.threads,
                     **measure(base, spec, args.threads, qfile, tfile, tmp)}
                rows.append(r)
                print(json.dumps(r), flush=True)
            base.unlink()
    fits = {spec: {key: power_law([r["n"] for r in rows if r["spec"] == spec and key in r],
                                  [r[key] for r in rows if r["spec"] == spec and key in r])
                   for key in ("build_s", "peak_rss", "index_bytes")} for spec in args.specs}
    print(json.dumps({"fits": fits}, indent=1))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"rows": rows, "fits": fits}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
