"""Benchmark the knowledge-base index kinds against exact search.

For every index spec: recall@1 and recall@10 against exact (flat) search, queries/s
on 1 and 2 threads (batched and one query at a time), bytes per vector and build
time. HNSW specs are also swept over ef_search and IVF-PQ over nprobe, which gives
the recall-vs-speed curves drawn in ``recall_qps.png``.

Data:

* default (a): synthetic text-embedding-like vectors: a mixture of Gaussians on a
  random low-dimensional subspace (``--intrinsic-dim``) of R^D plus small isotropic
  noise, L2-normalised; queries are held-out draws from the same distribution.
* ``--real`` (b): all-MiniLM-L6-v2 embeddings of the FOLDOC and Jargon File
  dictionaries (Debian ``dict-foldoc dict-jargon``), cut into ≤100-word passages;
  queries are "what is <headword>?" for held-out headwords. Embeddings are cached
  under ``benchmarks/.cache/``.

``--mips-ablation`` additionally compares faiss's native inner-product HNSW with
the DPR/Bachrach reduction to L2 search, on normalised and unnormalised data.

Examples::

    .venv/bin/python benchmarks/index_bench.py --n 20000                 # quick
    .venv/bin/python benchmarks/index_bench.py --n 500000 --queries 1000 # the README run
    .venv/bin/python benchmarks/index_bench.py --real
"""

from __future__ import annotations

import argparse
import gc
import gzip
import io
import os
import platform
import re
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import faiss
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rag.knowledge.index import (  # noqa: E402
    IndexSpec,
    build_index,
    bytes_per_vector,
    faiss_threads,
    search_index,
)
from rag.utils.io import atomic_write_bytes, atomic_write_json  # noqa: E402

HERE = Path(__file__).resolve().parent
DEFAULT_SPECS = ["flat", "hnsw", "hnsw_sq8", "ivf_pq"]
DICT_DIR = Path("/usr/share/dictd")
DICTS = ("foldoc", "jargon")


# --------------------------------------------------------------------------- data (a)


def clustered_embeddings(
    n: int,
    dim: int = 768,
    *,
    intrinsic_dim: int = 48,
    n_clusters: int = 2000,
    spread: float = 0.6,
    noise: float = 0.1,
    seed: int = 0,
    stream: int = 0,
    normalise: bool = True,
    norm_sigma: float = 0.0,
) -> np.ndarray:
    """``(n, dim)`` float32 vectors shaped like text embeddings.

    Cluster centres ~ N(0, I) in an `intrinsic_dim`-dimensional latent space with
    Dirichlet(1) cluster weights; a point is its centre plus N(0, spread²·I), mapped
    into R^dim by a random orthonormal basis, plus N(0, noise²·I) in all `dim`
    coordinates, then L2-normalised. The mixture depends only on `seed`; `stream`
    selects independent draws from it (0 = corpus, 1 = queries). `norm_sigma` > 0
    rescales each vector by a log-normal factor (unnormalised, DPR-like norms).
    """
    base = np.random.default_rng(seed)
    basis = np.linalg.qr(base.standard_normal((dim, intrinsic_dim)))[0].T.astype(np.float32)
    centres = base.standard_normal((n_clusters, intrinsic_dim)).astype(np.float32)
    weights = base.dirichlet(np.ones(n_clusters))
    rng = np.random.default_rng([seed, stream])
    out = np.empty((n, dim), np.float32)
    chunk = 20_000
    for s in range(0, n, chunk):
        m = min(chunk, n - s)
        c = rng.choice(n_clusters, size=m, p=weights)
        z = centres[c] + spread * rng.standard_normal((m, intrinsic_dim), dtype=np.float32)
        v = z @ basis + noise * rng.standard_normal((m, dim), dtype=np.float32)
        if normalise:
            v /= np.linalg.norm(v, axis=1, keepdims=True)
        if norm_sigma:
            v *= np.exp(norm_sigma * rng.standard_normal((m, 1), dtype=np.float32))
        out[s : s + m] = v
    return out


# --------------------------------------------------------------------------- data (b)


def _b64(s: str) -> int:
    """dictd's base-64 numbers (index offsets and lengths)."""
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    v = 0
    for ch in s:
        v = v * 64 + alphabet.index(ch)
    return v


def read_dict(name: str) -> list[tuple[str, str]]:
    """(headword, definition) pairs of a dictd database, one per distinct definition."""
    data = gzip.open(DICT_DIR / f"{name}.dict.dz").read()
    seen, entries = set(), []
    for line in (DICT_DIR / f"{name}.index").read_text(encoding="utf-8", errors="replace").splitlines():
        parts = line.split("\t")
        if len(parts) < 3 or parts[0].startswith("00-database") or parts[0].startswith("00database"):
            continue
        off, length = _b64(parts[1]), _b64(parts[2])
        if (off, length) in seen:
            continue
        seen.add((off, length))
        body = data[off : off + length].decode("utf-8", errors="replace")
        lines = body.strip("\n").split("\n")
        head = lines[0].strip() or parts[0]
        text = re.sub(r"\s+", " ", " ".join(lines[1:])).strip()
        text = re.sub(r"[{}]", "", text)  # cross-reference braces
        if len(text.split()) >= 3:
            entries.append((head, text))
    return entries


def dict_corpus(words: int = 100) -> tuple[list[str], list[str]]:
    """Passages ``"headword: text"`` of ≤ `words` words each, and their headwords."""
    passages, heads = [], []
    for name in DICTS:
        for head, text in read_dict(name):
            tokens = text.split()
            for s in range(0, len(tokens), words):
                passages.append(f"{head}: {' '.join(tokens[s : s + words])}")
                heads.append(head)
    return passages, heads


def real_embeddings(n_queries: int, encoder: str, cache: Path, seed: int) -> tuple[np.ndarray, np.ndarray, dict]:
    """MiniLM embeddings of the dictionary corpus and of held-out headword questions (cached)."""
    missing = [d for d in DICTS if not (DICT_DIR / f"{d}.dict.dz").exists()]
    if missing:
        sys.exit(f"--real needs {', '.join(missing)} in {DICT_DIR}: apt-get install -y dict-foldoc dict-jargon")
    passages, heads = dict_corpus()
    rng = np.random.default_rng(seed)
    uniq = sorted(set(heads))
    qheads = [uniq[i] for i in rng.choice(len(uniq), size=min(n_queries, len(uniq)), replace=False)]
    questions = [f"what is {h}?" for h in qheads]
    tag = re.sub(r"[^A-Za-z0-9_.-]", "_", encoder)
    cache.mkdir(parents=True, exist_ok=True)
    corpus_file = cache / f"dict_{tag}_{len(passages)}.npy"
    query_file = cache / f"dict_{tag}_q{len(questions)}_s{seed}.npy"
    enc = None
    if not corpus_file.exists() or not query_file.exists():
        from rag.knowledge.encoders import TextEncoder

        enc = TextEncoder(encoder)
    for path, texts in ((corpus_file, passages), (query_file, questions)):
        if not path.exists():
            print(f"encoding {len(texts)} texts with {encoder} -> {path}", flush=True)
            emb = enc.encode(texts, batch_size=64, show_progress=True).astype(np.float32)
            buf = io.BytesIO()
            np.save(buf, emb)
            atomic_write_bytes(path, buf.getvalue())
    x, q = np.load(corpus_file), np.load(query_file)
    info = {"corpus": "FOLDOC + Jargon File (Debian dict-foldoc, dict-jargon), ≤100-word passages",
            "encoder": encoder, "queries": "'what is <headword>?' for random headwords"}
    return x, q, info


# --------------------------------------------------------------------------- measuring


def recall(rows: np.ndarray, truth: np.ndarray, k: int) -> float:
    """Mean |top-k ∩ exact top-k| / k."""
    hits = [len(np.intersect1d(a[:k], b[:k], assume_unique=True)) for a, b in zip(rows, truth)]
    return float(np.mean(hits) / k)


def time_batched(index, q, k, spec, repeats: int) -> float:
    """Queries/s for the whole batch in one call (best of `repeats`: the machine is shared)."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        search_index(index, q, k, spec)
        best = min(best, time.perf_counter() - t)
    return q.shape[0] / best


def time_single(index, q, k, spec, repeats: int) -> float:
    """Queries/s issuing one query per call (best of `repeats` passes)."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for i in range(q.shape[0]):
            search_index(index, q[i : i + 1], k, spec)
        best = min(best, time.perf_counter() - t)
    return q.shape[0] / best


def measure(index, spec, q, truth, args, exact: bool = False) -> dict:
    """Recall@1/10 (2 threads) and QPS for every thread count, batched and single."""
    k = 10
    with faiss_threads(max(args.threads)):
        _, rows = search_index(index, q, k, spec)
    out = {"recall@1": float(np.mean(rows[:, 0] == truth[:, 0])), "recall@10": recall(rows, truth, k)}
    # Exact search is slow and its per-query cost is constant: time it on a subset.
    qb = q[: args.exact_timing_queries] if exact else q
    qs = q[: min(args.single, args.exact_timing_queries // 10)] if exact else q[: args.single]
    for t in args.threads:
        with faiss_threads(t):
            out[f"qps_batch_t{t}"] = time_batched(index, qb, k, spec, args.repeats)
            out[f"qps_single_t{t}"] = time_single(index, qs, k, spec, args.repeats)
    return out


def sweep_values(spec: IndexSpec, args) -> list[IndexSpec]:
    if spec.kind in ("hnsw", "hnsw_sq8"):
        values = sorted(set(args.ef_sweep) | {spec.ef_search})
        return [IndexSpec.from_dict({**spec.to_dict(), "ef_search": v}) for v in values]
    if spec.kind == "ivf_pq":
        values = sorted(set(args.nprobe_sweep) | {spec.nprobe})
        return [IndexSpec.from_dict({**spec.to_dict(), "nprobe": v}) for v in values]
    return [spec]


def run_mips_ablation(x: np.ndarray, q: np.ndarray, args) -> list[dict]:
    """Native inner-product HNSW vs the L2 reduction (x̃ = [x, sqrt(M²-|x|²)], q̃ = [q, 0])."""
    results = []
    rng = np.random.default_rng(args.seed + 7)
    variants = {"normalised": (x, q)}
    scale_x = np.exp(0.25 * rng.standard_normal((x.shape[0], 1))).astype(np.float32)
    scale_q = np.exp(0.25 * rng.standard_normal((q.shape[0], 1))).astype(np.float32)
    variants["norms x lognormal(0.25)"] = (x * scale_x, q * scale_q)
    base = IndexSpec.parse(args.ablation_spec)
    for name, (xv, qv) in variants.items():
        truth = exact_topk(xv, qv, 10)
        native = build_index(xv, base, threads=max(args.threads), show_progress=False)
        norms2 = np.einsum("ij,ij->i", xv, xv)
        extra = np.sqrt(np.maximum(norms2.max() - norms2, 0))[:, None].astype(np.float32)
        reduced = faiss.IndexHNSWFlat(xv.shape[1] + 1, base.m, faiss.METRIC_L2)
        reduced.hnsw.efConstruction = base.ef_construction
        with faiss_threads(max(args.threads)):
            reduced.add(np.hstack([xv, extra]))
        qa = np.hstack([qv, np.zeros((qv.shape[0], 1), np.float32)])
        for ef in args.ef_sweep:
            spec = IndexSpec.from_dict({**base.to_dict(), "ef_search": ef})
            with faiss_threads(max(args.threads)):
                _, r_native = search_index(native, qv, 10, spec)
                _, r_red = reduced.search(qa, 10, params=faiss.SearchParametersHNSW(efSearch=ef))
            results.append({"data": name, "ef_search": ef, "native_ip_recall@10": recall(r_native, truth, 10),
                            "l2_reduction_recall@10": recall(r_red, truth, 10)})
            print(f"  mips ablation [{name}] ef={ef}: native IP {results[-1]['native_ip_recall@10']:.3f}  "
                  f"L2 reduction {results[-1]['l2_reduction_recall@10']:.3f}", flush=True)
        del native, reduced
        gc.collect()
    return results


def exact_topk(x: np.ndarray, q: np.ndarray, k: int) -> np.ndarray:
    """Exact inner-product top-k rows ``(B, k)`` in blocks of the corpus (memory-light)."""
    best_s = np.full((q.shape[0], k), -np.inf, np.float32)
    best_r = np.zeros((q.shape[0], k), np.int64)
    for s in range(0, x.shape[0], 65_536):
        sc = q @ x[s : s + 65_536].T
        kk = min(k, sc.shape[1])
        part = np.argpartition(-sc, kk - 1, axis=1)[:, :kk]
        cand_s = np.concatenate([best_s, np.take_along_axis(sc, part, 1)], axis=1)
        cand_r = np.concatenate([best_r, part + s], axis=1)
        top = np.argsort(-cand_s, axis=1, kind="stable")[:, :k]
        best_s, best_r = np.take_along_axis(cand_s, top, 1), np.take_along_axis(cand_r, top, 1)
    return best_r


# --------------------------------------------------------------------------- report


def print_table(rows: list[dict], threads: list[int]) -> str:
    cols = ["spec", "recall@1", "recall@10"]
    for t in threads:
        cols += [f"qps_batch_t{t}", f"qps_single_t{t}"]
    cols += ["x_exact_t2" if 2 in threads else "x_exact", "bytes/vec", "build_s"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    ref_t = 2 if 2 in threads else max(threads)
    exact_qps = next((r[f"qps_batch_t{ref_t}"] for r in rows if r["kind"] == "flat"), None)
    for r in rows:
        vals = [r["spec"], f"{r['recall@1']:.3f}", f"{r['recall@10']:.3f}"]
        for t in threads:
            vals += [f"{r[f'qps_batch_t{t}']:.0f}", f"{r[f'qps_single_t{t}']:.0f}"]
        vals.append(f"{r[f'qps_batch_t{ref_t}'] / exact_qps:.1f}" if exact_qps else "-")
        vals += [f"{r['bytes_per_vector']:.0f}", f"{r['build_s']:.1f}"]
        lines.append("| " + " | ".join(vals) + " |")
    table = "\n".join(lines)
    print(table, flush=True)
    return table


def plot(rows: list[dict], path: Path, title: str, t: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["build_spec"], []).append(r)
    for name, rs in groups.items():
        rs = sorted(rs, key=lambda r: r["recall@10"])
        knob = {"hnsw": "ef_search", "hnsw_sq8": "ef_search", "ivf_pq": "nprobe"}.get(rs[0]["kind"])
        label = re.sub(r",?(ef_search|nprobe)=\d+", "", name).replace("metric=ip,", "").replace(":metric=ip", "")
        xs, ys = [r["recall@10"] for r in rs], [r[f"qps_batch_t{t}"] for r in rs]
        ax.plot(xs, ys, marker="*" if knob is None else "o", markersize=12 if knob is None else 5, label=label)
        if knob:
            for r, xv, yv in zip(rs, xs, ys):
                ax.annotate(str(r["params"][knob]), (xv, yv), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.set_yscale("log")
    ax.set_xlabel("recall@10 vs exact search")
    ax.set_ylabel(f"queries/s (batched, {t} threads)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=120)
    os.replace(tmp, path)
    plt.close(fig)


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=20_000, help="corpus size for synthetic data (a)")
    p.add_argument("--dim", type=int, default=768, help="dimension for synthetic data (a)")
    p.add_argument("--intrinsic-dim", type=int, default=48, help="latent subspace dimension of data (a)")
    p.add_argument("--clusters", type=int, default=2000, help="mixture components of data (a)")
    p.add_argument("--spread", type=float, default=0.6, help="within-cluster std (latent units) of data (a)")
    p.add_argument("--noise", type=float, default=0.1, help="isotropic noise std (per coordinate) of data (a)")
    p.add_argument("--queries", type=int, default=1000, help="held-out queries")
    p.add_argument("--single", type=int, default=200, help="queries timed one at a time")
    p.add_argument("--exact-timing-queries", type=int, default=200,
                   help="queries timed for exact search (batched; a tenth of them one at a time)")
    p.add_argument("--spec", action="append", dest="specs", metavar="SPEC",
                   help=f"index spec, repeatable (default: {' '.join(DEFAULT_SPECS)}); e.g. --spec hnsw:m=48")
    p.add_argument("--ef-sweep", type=lambda s: [int(v) for v in s.split(",")], default=[16, 32, 64, 128, 256])
    p.add_argument("--nprobe-sweep", type=lambda s: [int(v) for v in s.split(",")], default=[8, 16, 32, 64, 128])
    p.add_argument("--threads", type=lambda s: [int(v) for v in s.split(",")], default=[1, 2])
    p.add_argument("--repeats", type=int, default=3, help="timing repeats (best is kept)")
    p.add_argument("--real", action="store_true", help="data (b): MiniLM embeddings of FOLDOC + Jargon File")
    p.add_argument("--encoder", default="minilm", help="encoder for --real")
    p.add_argument("--cache", type=Path, default=HERE / ".cache", help="embedding cache for --real")
    p.add_argument("--mips-ablation", action="store_true", help="also compare native IP HNSW with the L2 reduction")
    p.add_argument("--ablation-spec", default="hnsw")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=HERE / "results", help="directory for JSON and PNG results")
    p.add_argument("--name", default=None, help="result file stem (default: derived from the data)")
    args = p.parse_args(argv)
    specs = [IndexSpec.parse(s) for s in (args.specs or DEFAULT_SPECS)]
    if not any(s.kind == "flat" for s in specs):
        specs.insert(0, IndexSpec(kind="flat"))

    t0 = time.time()
    if args.real:
        x, q, data_info = real_embeddings(args.queries, args.encoder, args.cache, args.seed)
        name = args.name or "index_real"
    else:
        kw = dict(intrinsic_dim=args.intrinsic_dim, n_clusters=args.clusters, spread=args.spread, noise=args.noise,
                  seed=args.seed)
        x = clustered_embeddings(args.n, args.dim, stream=0, **kw)
        q = clustered_embeddings(args.queries, args.dim, stream=1, **kw)
        data_info = {"corpus": "synthetic clustered (see clustered_embeddings)", **kw}
        name = args.name or f"index_synth_n{args.n}"
    n, d = x.shape
    print(f"data: N={n} D={d} queries={q.shape[0]} ({time.time() - t0:.0f}s)", flush=True)
    with faiss_threads(max(args.threads)):
        truth = exact_topk(x, q, 10)

    rows, table_rows = [], []
    for spec in specs:
        t = time.perf_counter()
        index = build_index(x, spec, threads=max(args.threads), show_progress=True)
        build_s = time.perf_counter() - t
        bpv = bytes_per_vector(index)
        for s in sweep_values(spec, args):
            m = measure(index, s, q, truth, args, exact=spec.kind == "flat")
            r = {"spec": s.to_string(), "build_spec": spec.to_string(), "kind": s.kind, "params": s.to_dict(),
                 "bytes_per_vector": bpv,
                 "build_s": build_s, "default": s == spec, **m}
            rows.append(r)
            if s == spec:
                table_rows.append(r)
            print(f"  {r['spec']}: R@1 {r['recall@1']:.3f} R@10 {r['recall@10']:.3f} "
                  + " ".join(f"{k}={v:.0f}" for k, v in m.items() if k.startswith("qps")), flush=True)
        del index
        gc.collect()

    print(f"\nN={n} D={d}, {q.shape[0]} queries, k=10; threads {args.threads}\n")
    table = print_table(table_rows, args.threads)
    print("\nall sweep points:")
    print_table(rows, args.threads)
    ablation = run_mips_ablation(x, q, args) if args.mips_ablation else None

    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "faiss": faiss.__version__,
                    "numpy": np.__version__},
        "data": {"n": n, "dim": d, "queries": int(q.shape[0]), **data_info},
        "table": table,
        "rows": rows,
        "mips_ablation": ablation,
        "total_s": time.time() - t0,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out / f"{name}.json", result)
    ref_t = 2 if 2 in args.threads else max(args.threads)
    plot(rows, args.out / f"{name}_recall_qps.png", f"{name}: N={n}, D={d}, k=10", ref_t)
    print(f"\nwrote {args.out / (name + '.json')} and {args.out / (name + '_recall_qps.png')}")
    return result


if __name__ == "__main__":
    main()
