"""Plots of ``benchmarks/index_curves.py`` results: build time and peak RSS beyond the index against N per spec, one
line per data kind (real, synthetic) and thread count (log-log, dotted: the power law fitted to that line), and
recall@10 against queries/s of each search-parameter sweep at the largest real N.

    python benchmarks/index_curves_plot.py benchmarks/results/index_curves_*.json --out docs/img/index_curves.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def load(paths: list[str]) -> list[dict]:
    rows = []
    for p in paths:
        rows += json.loads(Path(p).read_text())["rows"]
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    rows = load(args.results)
    specs = sorted({r["spec"] for r in rows})
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), dpi=80)
    for i, spec in enumerate(specs):
        series = sorted({(r["data"], r.get("threads", 1)) for r in rows if r["spec"] == spec})
        for data, threads in series:  # one line (and one power-law fit) per data kind and thread count
            rs = sorted((r for r in rows if r["spec"] == spec and r["data"] == data and r.get("threads", 1) == threads),
                        key=lambda r: r["n"])
            n = np.array([r["n"] for r in rs], float)
            for ax, key, scale in ((axes[0], "build_s", 1.0), (axes[1], "beyond_index", 1 / 2**20)):
                y = np.array([np.nan if key == "build_s" and r.get("build_s_valid") is False else r.get(key, np.nan)
                              for r in rs], float) * scale  # build_s_valid False: wall time of a starved process
                ok = np.isfinite(y) & (y > 0)
                if not ok.any():
                    continue
                line, = ax.plot(n[ok], y[ok], "o-" if data == "real" else "s--", color=f"C{i % 10}",
                                label=f"{spec} ({data}, {threads} thr)")
                if ok.sum() >= 2:
                    e, c = np.polyfit(np.log(n[ok]), np.log(y[ok]), 1)
                    xs = np.geomspace(n[ok].min(), n[ok].max(), 20)
                    ax.plot(xs, np.exp(c) * xs**e, ":", color=line.get_color())
        real = [r for r in rows if r["spec"] == spec and r["data"] == "real" and r.get("sweep")]
        if real:
            big = max(real, key=lambda r: r["n"])
            for rescore in sorted({s["rescore"] for s in big["sweep"]}):
                pts = [s for s in big["sweep"] if s["rescore"] == rescore]
                axes[2].plot([s["recall_at_10"] for s in pts], [s["qps"] for s in pts], "o-",
                             label=f"{spec}{' +rescore' + str(rescore) if rescore else ''} (N={big['n']:,})")
    axes[0].set(xscale="log", yscale="log", xlabel="N vectors", ylabel="build s (threads as in the JSON)", title="build time")
    axes[1].set(xscale="log", yscale="log", xlabel="N vectors", ylabel="MiB", title="peak RSS beyond imports + index")
    axes[2].set(yscale="log", xlabel="recall@10 vs exact", ylabel="queries/s (1 thread, batch)", title="search sweep (real)")
    axes[2].axvline(0.95, color="grey", lw=0.8)
    for ax in axes:
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
