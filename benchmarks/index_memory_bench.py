"""Peak memory of writing a knowledge base from precomputed vectors: the all-in-RAM path against the streaming one.

For each size N and index spec, two child processes write the same knowledge base from the same ``.npy`` of N
synthetic vectors (unit-norm Gaussian mixtures, written here in chunks):

* ``before``: the vectors loaded whole (``np.load``) and passed as an array, as every build did before streaming
  (``KnowledgeBase.build`` encoded into one (N, D) array, then indexed it);
* ``after``: the file's path passed to ``KnowledgeBase.from_embeddings``, which trains on a sample and adds in
  16,384-row blocks read from the file.

Each child reports its peak RSS (``VmHWM``), its RSS after imports, and the index file's bytes; the table shows the
peak beyond the index's own bytes, the part a bounded build must keep flat as N grows. No encoder runs (the encoding
side streams in ``chunk_rows`` chunks; see docs/scale-gpu.md)::

    python benchmarks/index_memory_bench.py --sizes 20000 100000 --specs ivf_pq hnsw_sq8 --json results/index_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, sys, time
from pathlib import Path
import datasets, numpy as np  # datasets: imported by the writer in both paths, so counted in the baseline
from rag.knowledge.index import faiss_threads
from rag.knowledge.knowledge_base import KnowledgeBase
from rag.knowledge.passages import Passage

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
mode, path, spec, out, threads = sys.argv[1:6]
n = int(np.load(path, mmap_mode="r").shape[0])
passages = [Passage(f"p{i}", "", f"passage {i}") for i in range(n)]
base = status("VmRSS")
t0 = time.perf_counter()
with faiss_threads(int(threads)):
    if mode == "before":
        KnowledgeBase.from_embeddings(passages, np.load(path), {"name": "synthetic"}, out, index=spec, show_progress=False)
    else:
        KnowledgeBase.from_embeddings(passages, path, {"name": "synthetic"}, out, index=spec, show_progress=False)
seconds = time.perf_counter() - t0
print(json.dumps({"peak": status("VmHWM"), "base": base, "index_bytes": os.path.getsize(Path(out) / "index.faiss"),
                  "seconds": seconds}))
"""


def write_vectors(path: Path, n: int, d: int, seed: int = 0, clusters: int = 64) -> None:
    """N unit vectors around `clusters` random centres, written 16,384 rows at a time (never held whole)."""
    from rag.knowledge.vectors import create_npy, write_rows

    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((clusters, d)).astype(np.float32)
    offset = create_npy(path, (n, d))
    fd = os.open(path, os.O_WRONLY)
    try:
        for start in range(0, n, 16_384):
            m = min(16_384, n - start)
            x = centres[rng.integers(0, clusters, m)] + 0.5 * rng.standard_normal((m, d)).astype(np.float32)
            x /= np.linalg.norm(x, axis=1, keepdims=True)
            write_rows(fd, offset, start, x)
    finally:
        os.close(fd)


def run(mode: str, path: Path, spec: str, out: Path, threads: int) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run([sys.executable, "-c", CHILD, mode, str(path), spec, str(out), str(threads)], env=env,
                          capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"{mode} {spec} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[20_000, 100_000])
    ap.add_argument("--specs", nargs="+", default=["ivf_pq", "hnsw_sq8"])
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    rows = []
    mib = 1 << 20
    print(f"{'N':>9} {'spec':<10} {'path':<7} {'peak MiB':>9} {'after imports':>13} {'index MiB':>9} "
          f"{'beyond index':>12} {'seconds':>8}")
    with tempfile.TemporaryDirectory(prefix="index_memory_") as tmp:
        for n in args.sizes:
            path = Path(tmp) / f"x{n}.npy"
            write_vectors(path, n, args.dim)
            for spec in args.specs:
                for mode in ("before", "after"):
                    out = Path(tmp) / f"kb-{n}-{spec}-{mode}"
                    t = time.perf_counter()
                    r = run(mode, path, spec, out, args.threads)
                    r.update(n=n, dim=args.dim, spec=spec, mode=mode, wall=time.perf_counter() - t,
                             vectors_bytes=n * args.dim * 4)
                    r["beyond_index"] = r["peak"] - r["base"] - r["index_bytes"]
                    rows.append(r)
                    print(f"{n:>9} {spec:<10} {mode:<7} {r['peak'] / mib:>9.1f} {r['base'] / mib:>13.1f} "
                          f"{r['index_bytes'] / mib:>9.1f} {r['beyond_index'] / mib:>12.1f} {r['seconds']:>8.1f}", flush=True)
                    subprocess.run(["rm", "-rf", str(out)], check=False)
            path.unlink()
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
