"""Planning to Wikipedia scale: memory, disk and build time per index spec, measured at small N and extrapolated.

For each index spec and each size N: random 768-d float32 vectors (standard normal, L2-normalised; the build
cost of flat / HNSW / IVF-PQ does not depend on the data's structure to first order), the index built with
:func:`rag.knowledge.index.build_index` on `--threads` faiss threads in a fresh child process, which reports

* ``build_s``: wall-clock build time,
* ``index_bytes``: the size of the written ``index.faiss`` (what search keeps resident),
* ``kb_bytes``: ``index_bytes`` + ``embeddings.npy`` (N·D·4 + header), the knowledge base's disk without passages,
* ``peak_rss``: the child's peak resident memory (vectors + index + build scratch).

Bytes grow linearly in N (fitted per spec as ``a + b·N``); build time is fitted per spec as a power law
``t = c·N^e`` on the measured sizes. Both are extrapolated to `--target` (21M passages, the DPR Wikipedia
split). The plot draws the measured points and the fitted curves; the published anchors (transformers'
``wiki_dpr``: exact HNSW128_SQ8 ≈ 38 GB, compressed IVF4096_HNSW128_PQ128 ≈ 2.9 GB) are printed beside it.

Example (about 12 CPU-minutes on this 2-core machine)::

    python benchmarks/index_scale.py --spec flat:50000,100000,200000 --spec ivf_pq:25000,50000,100000 \\
        --spec hnsw:5000,10000,20000 --spec hnsw_sq8:5000,10000,20000
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import resource
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rag.utils.io import atomic_write_bytes, atomic_write_json  # noqa: E402

HERE = Path(__file__).resolve().parent
TARGET = 21_015_324  # passages of the DPR Wikipedia split (psgs_w100.tsv)
ANCHORS = {"wiki_dpr exact HNSW128_SQ8 (transformers)": 38e9, "wiki_dpr compressed IVF4096_HNSW128_PQ128 (transformers)": 2.9e9}


def _measure(spec: str, n: int, dim: int, threads: int, seed: int, out) -> None:
    """Child process: build `spec` over `n` random vectors and send the measurements through `out`."""
    import faiss

    from rag.knowledge.index import IndexSpec, build_index, write_index

    faiss.omp_set_num_threads(threads)
    x = np.random.default_rng(seed).standard_normal((n, dim), dtype=np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    t0 = time.perf_counter()
    index = build_index(x, IndexSpec.parse(spec), threads=threads, show_progress=False)
    build_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        write_index(index, Path(tmp) / "index.faiss")
        index_bytes = (Path(tmp) / "index.faiss").stat().st_size
        np.save(Path(tmp) / "embeddings.npy", x)
        emb_bytes = (Path(tmp) / "embeddings.npy").stat().st_size
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    out.send({"spec": spec, "n": n, "dim": dim, "threads": threads, "build_s": round(build_s, 3), "index_bytes": index_bytes,
              "kb_bytes": index_bytes + emb_bytes, "peak_rss": peak})


def measure(spec: str, n: int, dim: int, threads: int, seed: int) -> dict:
    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_measure, args=(spec, n, dim, threads, seed, send))
    p.start()
    row = recv.recv()
    p.join()
    return row


def fit(rows: list[dict], target: int) -> dict:
    """Per-spec linear bytes fits and a power-law build-time fit, evaluated at `target`."""
    n = np.array([r["n"] for r in rows], float)
    out = {"n": target}
    for key in ("index_bytes", "kb_bytes", "peak_rss"):
        y = np.array([r[key] for r in rows], float)
        b, a = np.polyfit(n, y, 1) if len(rows) > 1 else (y[0] / n[0], 0.0)
        out[key] = float(a + b * target)
        out[f"{key}_per_vector"] = float(b)
    t = np.array([r["build_s"] for r in rows], float)
    e, logc = np.polyfit(np.log(n), np.log(t), 1) if len(rows) > 1 else (1.0, np.log(t[0] / n[0]))
    out["build_exponent"] = float(e)
    # A power law is only believable where build time grows with N (HNSW: ~N^1.4-1.6); a build dominated by fixed
    # costs (IVF-PQ's k-means and PQ training on a sample) or by noise gets no extrapolation.
    out["build_s"] = float(np.exp(logc) * target ** e) if 0.8 <= e <= 3 else None
    return out


def plot(rows: list[dict], fits: dict, path: Path, target: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    grid = np.logspace(np.log10(min(r["n"] for r in rows)), np.log10(target), 50)
    for i, (spec, f) in enumerate(fits.items()):
        pts = [r for r in rows if r["spec"] == spec]
        c = f"C{i}"
        n = np.array([r["n"] for r in pts], float)
        axes[0].loglog(n, [r["kb_bytes"] / 1e9 for r in pts], "o", color=c)
        axes[0].loglog(grid, (f["kb_bytes"] - f["kb_bytes_per_vector"] * (target - grid)) / 1e9, "-", color=c,
                       label=f"{spec} (KB)")
        axes[0].loglog(grid, (f["index_bytes"] - f["index_bytes_per_vector"] * (target - grid)) / 1e9, ":", color=c)
        axes[1].loglog(n, [r["build_s"] / 3600 for r in pts], "o", color=c)
        if f["build_s"] is not None:
            axes[1].loglog(grid, f["build_s"] * (grid / target) ** f["build_exponent"] / 3600, "-", color=c,
                           label=f"{spec} (∝ N^{f['build_exponent']:.2f})")
    for label, b in ANCHORS.items():
        axes[0].plot([target], [b / 1e9], "k*", markersize=10)
        axes[0].annotate(label.split(" (")[0], (target, b / 1e9), fontsize=7, ha="right", va="bottom")
    axes[0].set(xlabel="vectors (768-d)", ylabel="GB", title="disk: index + embeddings (—), index alone (⋯)")
    axes[1].set(xlabel="vectors (768-d)", ylabel="hours", title=f"build time, {rows[0]['threads']} faiss thread(s)")
    for ax in axes:
        ax.axvline(target, color="grey", lw=0.5)
        ax.legend(fontsize=7)
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    atomic_write_bytes(path, buf.getvalue())


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replot", default=None, metavar="JSON", help="redo the fits, table and plot from a previous run's JSON")
    p.add_argument("--spec", action="append", default=[], metavar="SPEC:N1,N2,...",
                   help="an index spec and the sizes to measure it at, e.g. hnsw:5000,10000,20000 (spec options after the "
                        "sizes are not supported; the spec's defaults are used)")
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--target", type=int, default=TARGET)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument("--name", default="index_scale")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    rows, fits = [], {}
    if args.replot:
        import json

        old = json.loads(Path(args.replot).read_text())
        rows = old["rows"]
        for spec in dict.fromkeys(r["spec"] for r in rows):
            fits[spec] = fit([r for r in rows if r["spec"] == spec], args.target)
    elif not args.spec:
        p.error("give --spec SPEC:N1,N2,... (or --replot JSON)")
    for item in args.spec:
        spec, _, sizes = item.rpartition(":")
        if not spec or not sizes:
            p.error(f"--spec {item!r}: expected SPEC:N1,N2,...")
        mine = []
        for n in (int(s) for s in sizes.split(",")):
            row = measure(spec, n, args.dim, args.threads, args.seed)
            print(f"{spec:10s} n={n:>9,d}  build {row['build_s']:8.1f} s  index {row['index_bytes'] / 1e6:9.1f} MB  "
                  f"KB {row['kb_bytes'] / 1e6:9.1f} MB  peak RSS {row['peak_rss'] / 1e6:8.1f} MB", flush=True)
            mine.append(row)
        rows += mine
        fits[spec] = fit(mine, args.target)
    lines = [f"| spec | measured N | index bytes/vec | KB bytes/vec | build ∝ N^e | index at {args.target / 1e6:.0f}M | "
             f"KB disk at {args.target / 1e6:.0f}M | build at {args.target / 1e6:.0f}M ({args.threads} thread) |",
             "|---|---|---|---|---|---|---|---|"]
    for spec, f in fits.items():
        ns = ", ".join(f"{r['n'] // 1000}k" for r in rows if r["spec"] == spec)
        lines.append(f"| {spec} | {ns} | {f['index_bytes_per_vector']:.0f} | {f['kb_bytes_per_vector']:.0f} | "
                     f"{f['build_exponent']:.2f} | "
                     f"{f['index_bytes'] / 1e9:.1f} GB | {f['kb_bytes'] / 1e9:.1f} GB | "
                     + (f"{f['build_s'] / 3600:.1f} h |" if f["build_s"] is not None else "not extrapolated |"))
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    result = {
        "command": old["command"] if args.replot else "python benchmarks/index_scale.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "rows": rows, "fits": fits, "anchors_bytes": ANCHORS, "table": table,
        "total_s": old["total_s"] if args.replot else round(time.perf_counter() - t0, 1),
    }
    atomic_write_json(out / f"{args.name}.json", result)
    plot(rows, fits, out / f"{args.name}.png", args.target)
    return result


if __name__ == "__main__":
    main()
