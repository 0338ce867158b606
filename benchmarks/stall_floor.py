"""How often does this machine delay a retrieval request by 50 ms or more with no swap at all, and does a
low-priority child process, such as the swap path's checksum child, make that more frequent?

Run it before ``swap_bench.py`` to learn whether the machine can show that benchmark's < 50 ms target.
The same request load as there (``--workers`` threads calling ``DenseRetriever.search`` on swap_bench's pre-warmed
knowledge base A) runs for ``--rounds`` rounds. Each round runs one phase of each child kind, in shuffled order,
each after ``--idle`` seconds with no child:

* ``hash``: the checksum child a swap starts (``sha256_files(nice=--nice)`` over the cached knowledge base B);
* ``spin``: a child at the same niceness spinning in a pure Python loop (CPU only, no I/O);
* ``memcopy``: a child at the same niceness copying a 256 MB array (memory bandwidth).

The spin and memcopy children run as long as a cached checksum pass took before the rounds. Reported per kind
of phase (idle, hash, spin, memcopy): requests' extra latency over the median latency (per minute: how many
reached 20 / 30 / 50 ms; max; p99), the share of phases whose worst request reached ``--target``, the
stalls of an independent probe process (swap_bench's machine probe) per minute, and the share of the VM's CPU
time that the hypervisor took (steal time).

Measured (2026-11-23, the project's 2-vCPU VM, nothing else running; results/stall_floor_500000.json: 20
rounds, 27 min, children 14-20 s each): requests delayed >= 50 ms per minute with nothing beside them (idle)
4.3, beside the checksum child 0.2, the spinner 0.2, the memory copier 1.8; phases whose worst request reached
50 ms: idle 11 of 60 (10 s each; up to 234 ms), hash 1 of 20 (50.1 ms), spin 1 of 20, memcopy 3 of 20; the
hypervisor took 2-5 % of the VM's CPU time (steal) throughout. An earlier 36-minute run of the same phases (a
draft of this script) gave 2.7 / 2.0 / 2.8 / 2.5 per minute. So the checksum child does not make such stalls
more frequent, and with nothing else running this machine delayed a request by >= 50 ms every 14-22 s. The
floor changes with the host's load: the day before, a similar diagnostic found 0.2 per minute idle and 0.7
beside the checksum child (see swap_bench's docstring). A reading consistent with this, not proven: a child keeps both vCPUs busy
so that they seldom halt, and it is the host's late wake-up of a halted vCPU that stalls the requests.

Examples::

    .venv/bin/python benchmarks/stall_floor.py --n 20000 --rounds 2     # quick
    .venv/bin/python benchmarks/stall_floor.py --rounds 30              # against swap_bench's 500k knowledge bases
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import types
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from index_bench import clustered_embeddings  # noqa: E402
from swap_bench import build, pct, start_probe, stop_probe  # noqa: E402

from rag.knowledge.knowledge_base import KnowledgeBase  # noqa: E402
from rag.knowledge.retriever import DenseRetriever  # noqa: E402
from rag.utils.checksums import check_niceness, sha256_files  # noqa: E402
from rag.utils.io import atomic_write_json  # noqa: E402

KINDS = ("hash", "spin", "memcopy")
# argv: niceness, seconds
_SPIN = """
import os, sys, time
os.nice(int(sys.argv[1]))
end, x = time.perf_counter() + float(sys.argv[2]), 0
while time.perf_counter() < end:
    for i in range(10000):
        x += i
"""
_MEMCOPY = """
import os, sys, time
os.nice(int(sys.argv[1]))
import numpy as np
a = np.ones(32 << 20)
b = np.empty_like(a)
end = time.perf_counter() + float(sys.argv[2])
while time.perf_counter() < end:
    np.copyto(b, a)
"""


def steal_ms() -> float:
    """CPU time the hypervisor has taken from this VM since boot (/proc/stat "steal", all CPUs), ms; 0 where unknown."""
    try:
        with open("/proc/stat") as f:
            return int(f.readline().split()[8]) * 1e3 / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def run_child(kind: str, files: list[Path], nice: int, seconds: float) -> None:
    if kind == "hash":
        sha256_files(files, nice=nice)
        return
    script = _SPIN if kind == "spin" else _MEMCOPY
    subprocess.run([sys.executable, "-c", script, str(nice), str(seconds)], check=True, stdin=subprocess.DEVNULL)


def run(args) -> dict:
    paths = build(Path(args.out_dir), args.n, args.dim, args.index, rebuild=False)
    files = sorted(p for p in paths["B"].rglob("*") if p.is_file())
    torch.set_num_threads(1)
    kb = KnowledgeBase.open(paths["A"], verify="none")
    kb.prewarm()
    retriever = DenseRetriever(kb, types.SimpleNamespace(dim=args.dim))
    queries = torch.from_numpy(clustered_embeddings(4096, args.dim, seed=0, stream=1))
    records: list[tuple[float, float]] = []
    stop, lock = threading.Event(), threading.Lock()

    def worker(w: int) -> None:
        rng = np.random.default_rng(w)
        while not stop.is_set():
            q = queries[rng.integers(0, len(queries), args.batch)]
            t0 = time.perf_counter()
            retriever.search(q, args.k)
            with lock:
                records.append((t0, time.perf_counter()))

    gc.collect()
    gc.freeze()  # as `rag serve` does
    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(args.workers)]
    probe_out = Path(tempfile.mkstemp(prefix="stall_floor_probe_", suffix=".json")[1])
    probe = start_probe(probe_out)
    phases: list[tuple[str, float, float, float]] = []  # (kind, start, end, steal ms during it)
    load0 = os.getloadavg()
    try:
        for t in threads:
            t.start()
        run_child("hash", files, args.nice, 0)  # B into the page cache, as for a swap to a cached version
        t0 = time.perf_counter()
        run_child("hash", files, args.nice, 0)
        child_s = args.child_seconds or time.perf_counter() - t0
        print(f"cached checksum pass: {time.perf_counter() - t0:.1f} s; spin / memcopy children run {child_s:.1f} s", flush=True)
        order = random.Random(args.seed)
        for r in range(args.rounds):
            for kind in order.sample(KINDS, len(KINDS)):
                s, st = time.perf_counter(), steal_ms()
                time.sleep(args.idle)
                phases.append(("idle", s, time.perf_counter(), steal_ms() - st))
                s, st = time.perf_counter(), steal_ms()
                run_child(kind, files, args.nice, child_s)
                phases.append((kind, s, time.perf_counter(), steal_ms() - st))
                print(f"round {r + 1}/{args.rounds}: {kind} {phases[-1][2] - s:.1f} s", flush=True)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
        stalls = stop_probe(probe, probe_out)
    return summarise(args, records, phases, stalls, child_s, load0)


def summarise(args, records, phases, stalls, child_s: float, load0) -> dict:
    start, end = np.array(records).reshape(-1, 2).T
    med = pct((end - start).tolist(), 50)
    extra_all = 1e3 * (end - start - med)
    out = {}
    for kind in ("idle", *KINDS):
        ws = [(s, e) for k, s, e, _ in phases if k == kind]
        minutes = sum(e - s for s, e in ws) / 60
        stolen = sum(st for k, _, _, st in phases if k == kind)
        masks = [(start < we) & (end > ws_) for ws_, we in ws]  # requests overlapping each phase, one pass each
        worst = [float(extra_all[m].max()) if m.any() else 0.0 for m in masks]
        extra = extra_all[np.logical_or.reduce(masks)].tolist() if masks else []
        probe = [g for t, g, _ in stalls if any(ws_ <= t < we for ws_, we in ws)]
        out[kind] = {
            "phases": len(ws), "minutes": round(minutes, 2), "requests": len(extra),
            **{f"per_min_ge_{x}ms": round(sum(v >= x for v in extra) / minutes, 2) if minutes else None for x in (20, 30, 50)},
            "max_ms": round(max(extra, default=0.0), 1), "p99_ms": round(pct(extra, 99), 2),
            "phases_reaching_target": sum(w >= args.target for w in worst),
            "probe_per_min_ge_20ms": round(sum(g >= 20 for g in probe) / minutes, 2) if minutes else None,
            "probe_max_ms": round(max(probe, default=0.0), 1),
            # share of the VM's CPU time (all CPUs) that the hypervisor took during these phases
            "steal_pct": round(100 * stolen / (minutes * 60e3 * (os.cpu_count() or 1)), 2) if minutes else None,
            "worst_per_phase_ms": [round(w, 1) for w in worst],
        }
    return {"config": vars(args), "median_latency_ms": round(1e3 * med, 2), "child_seconds": round(child_s, 1),
            "loadavg_before": load0, "loadavg_after": os.getloadavg(), "cpus": os.cpu_count(), "by_phase": out,
            "when": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def print_table(r: dict) -> None:
    t = r["config"]["target"]
    print(f"\nmedian request {r['median_latency_ms']:.1f} ms; extra latency over it, by what ran beside the requests "
          f"(children at nice {r['config']['nice']}, {r['cpus']} CPUs, load average before {r['loadavg_before'][0]:.2f}):")
    print(f"{'phase':8s} {'min':>5s} {'>=20ms/min':>10s} {'>=30':>6s} {'>=50':>6s} {'max ms':>7s} {'p99':>5s} "
          f"{'phases >= ' + format(t, 'g') + ' ms':>16s} {'probe >=20ms/min':>16s} {'steal %':>7s}")
    for kind, o in r["by_phase"].items():
        print(f"{kind:8s} {o['minutes']:5.1f} {o['per_min_ge_20ms']:10.2f} {o['per_min_ge_30ms']:6.2f} "
              f"{o['per_min_ge_50ms']:6.2f} "
              f"{o['max_ms']:7.1f} {o['p99_ms']:5.1f} {str(o['phases_reaching_target']) + ' / ' + str(o['phases']):>16s} "
              f"{o['probe_per_min_ge_20ms']:16.2f} {o['steal_pct']:7.2f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=500_000, help="passages per knowledge base, as swap_bench --n (default 500000)")
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--index", default="hnsw:m=16,ef_construction=40", help="as swap_bench --index")
    p.add_argument("--out-dir", default=str(HERE / ".cache" / "swap_bench"),
                   help="swap_bench's knowledge bases (built if missing)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--idle", type=float, default=10.0, help="seconds with no child before each child phase")
    p.add_argument("--nice", type=int, default=10, help="the children's niceness (swap_bench's --verify-nice; default 10)")
    p.add_argument("--child-seconds", type=float, default=None,
                   help="how long spin / memcopy run (default: as long as one cached checksum pass took)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("-k", type=int, default=10)
    p.add_argument("--target", type=float, default=50.0, help="ms (swap_bench's target)")
    p.add_argument("--seed", type=int, default=0, help="seed of the phase order")
    p.add_argument("--json", default=None, help="write the results here (default: benchmarks/results/stall_floor_N.json)")
    args = p.parse_args(argv)
    check_niceness(args.nice, "--nice")
    if args.rounds < 1 or args.idle <= 0:
        p.error("--rounds must be >= 1 and --idle > 0")
    result = run(args)
    print_table(result)
    out = Path(args.json) if args.json else HERE / "results" / f"stall_floor_{args.n}.json"
    atomic_write_json(out, result)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
