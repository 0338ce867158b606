"""GPU vs CPU on one machine, side by side in one run: faiss search and IVF-PQ builds, passage encoding, RAG training steps.

Every number comes from rag's own code paths, the ones a user calls, run once on the machine's CPU cores and once on its
GPU, and printed with their ratio:

* **faiss** (``--sizes``, default 1M, 2M and 5M vectors of ``--dim`` 768): clustered, text-embedding-like unit vectors
  (a mixture of Gaussians on a random 48-dimensional subspace plus isotropic noise, as ``index_bench.py``'s synthetic
  data; drawn with torch on the GPU for speed), ``--queries`` held-out queries, k = 10.
  ``flat``: :func:`rag.knowledge.index.search_index` on ``--threads`` CPU threads vs :func:`rag.knowledge.gpu.to_gpu`
  (float32, and float16 storage) — queries/s, GPU-vs-CPU top-10 agreement. ``ivf_pq`` (the package's default spec:
  nlist = sqrt(N), 96 sub-quantisers of 8 dimensions at D = 768, nprobe 64): :func:`~rag.knowledge.index.build_index`
  with ``gpu=False`` vs ``gpu=True`` (training and adding on the GPU, stored as a CPU index) — build seconds and
  recall@10 against the exact top-10; then search queries/s of the CPU index vs its GPU clone (float16 look-up tables).
  CPU IVF-PQ builds are skipped (and said so) where the projection from the smaller size exceeds the time left.
* **encoding** passages/s of a DPR context encoder the size of DPR's (BERT-base: 12 layers, 768 wide, random weights,
  WordPiece vocabulary trained on the Elements texts) over 100-word passages, through
  :meth:`TextEncoder.encode_passages`: CPU float32 vs GPU float32 vs GPU float16 (autocast).
* **training**: RAG-Sequence training steps/s of :class:`rag.models.rag.model.RagModel` (question encoder BERT-base,
  BART generator 768 wide with 6 + 6 layers, flat knowledge base of the Elements passages, ``--batch`` questions,
  ``--n-docs`` passages each, AdamW): forward with retrieval, backward and step, on the CPU (float32) vs the GPU
  (float32, and bfloat16 autocast). The same model, data and steps (``train_bench.py``'s builders).

Without a GPU (or faiss without GPU support) the GPU columns are skipped; the CPU side still runs. A measurement that
raises is recorded (its traceback under ``errors``), the others still run, and the script then exits 1.

    python benchmarks/gpu_bench.py --out benchmarks/results/gpu_bench.json            # the device run
    python benchmarks/gpu_bench.py --sizes 20000 --encode 64 --train-steps 2 --quick   # a sanity run (CPU)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _proc import machine_info  # noqa: E402

from rag.knowledge.gpu import faiss_gpu_problem, gpu_count, to_gpu  # noqa: E402
from rag.knowledge.index import IndexSpec, build_index, faiss_threads, search_index  # noqa: E402


class Clock:
    """The run's deadline: sections ask how much time is left before starting work that may not fit."""

    def __init__(self, budget_s: float):
        self.t0, self.budget = time.perf_counter(), budget_s

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.t0)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def clustered(n: int, dim: int, seed: int, stream: int, device: str, chunk: int = 262_144) -> np.ndarray:
    """``(n, dim)`` float32 unit vectors: centre (of 2000, 48-d) + N(0, 0.6²) mapped by a fixed orthonormal basis, plus
    N(0, 0.1²) noise; the mixture depends on `seed`, `stream` picks independent draws (0: corpus, 1: queries)."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(dim, 48, generator=g))[0].T.contiguous().to(device)  # (48, dim)
    centres = torch.randn(2000, 48, generator=g).to(device)
    gen = torch.Generator(device=device).manual_seed(seed * 1000 + stream + 1)
    out = np.empty((n, dim), np.float32)
    for s in range(0, n, chunk):
        m = min(chunk, n - s)
        idx = torch.randint(0, 2000, (m,), generator=gen, device=device)
        z = centres[idx] + 0.6 * torch.randn(m, 48, generator=gen, device=device)
        x = z @ basis + 0.1 * torch.randn(m, dim, generator=gen, device=device)
        out[s:s + m] = torch.nn.functional.normalize(x, dim=1).cpu().numpy()
    return out


def _timed_search(search, q: np.ndarray, k: int, min_s: float = 1.0):
    """(queries/s, last result): repeat the batched search until `min_s` seconds have passed (one warm-up first)."""
    search(q[: min(64, len(q))], k)
    n, t0 = 0, time.perf_counter()
    while True:
        res = search(q, k)
        n += 1
        if time.perf_counter() - t0 >= min_s:
            break
    return n * len(q) / (time.perf_counter() - t0), res


def _overlap(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean([len(set(x) & set(y)) / len(x) for x, y in zip(a, b)]))


def bench_faiss(n: int, args, clock: Clock, cuda: bool, faiss_gpu: bool, prev_cpu_ivf: dict | None) -> dict:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    t = time.perf_counter()
    x = clustered(n, args.dim, 0, 0, dev)
    q = clustered(args.queries, args.dim, 0, 1, dev)
    row: dict = {"n": n, "dim": args.dim, "queries": args.queries, "data_s": round(time.perf_counter() - t, 1)}
    flat_spec = IndexSpec.parse("flat")
    flat = build_index(x, flat_spec, show_progress=False)
    with faiss_threads(args.threads):
        qps, (_, exact) = _timed_search(lambda qq, k: search_index(flat, qq, k, flat_spec), q, args.k)
    row["flat_cpu_qps"] = round(qps, 1)
    if cuda:  # flat search on the GPU runs in torch (rag.knowledge.gpu.TorchFlatIndex)
        for fp16 in (False, True):
            t = time.perf_counter()
            g = to_gpu(flat, flat_spec, 0, fp16=fp16)
            clone_s = time.perf_counter() - t
            qps, (_, rows) = _timed_search(g.search, q, args.k)
            tag = "flat_gpu_fp16" if fp16 else "flat_gpu"
            row.update({f"{tag}_qps": round(qps, 1), f"{tag}_clone_s": round(clone_s, 2),
                        f"{tag}_top10_agreement_with_cpu": round(_overlap(rows, exact), 4)})
            g = None  # frees the GPU copy
        row["flat_gpu_speedup"] = round(row["flat_gpu_qps"] / row["flat_cpu_qps"], 1)
    flat = None  # frees N x D floats before the IVF builds
    spec = IndexSpec.parse(args.ivf)
    row["ivf_spec"] = args.ivf
    built = {}
    if faiss_gpu:
        t = time.perf_counter()
        built["gpu"] = build_index(x, spec, gpu=True, show_progress=False)
        row["ivf_build_gpu_s"] = round(time.perf_counter() - t, 2)
    projected = None
    if prev_cpu_ivf is not None:  # k-means ~ N^1.5 (nlist = sqrt(N) lists), adding ~ N^1.5 as well
        projected = prev_cpu_ivf["s"] * (n / prev_cpu_ivf["n"]) ** 1.5
    if n > args.cpu_ivf_max:
        row["ivf_build_cpu_s"] = None
        row["ivf_build_cpu_skipped"] = f"N > --cpu-ivf-max {args.cpu_ivf_max}"
    elif projected is not None and projected > clock.left() - 60:
        row["ivf_build_cpu_s"] = None
        row["ivf_build_cpu_skipped"] = f"projected {projected:.0f} s from N={prev_cpu_ivf['n']}, {clock.left():.0f} s left"
    else:
        t = time.perf_counter()
        with faiss_threads(args.threads):
            built["cpu"] = build_index(x, spec, gpu=False, show_progress=False)
        row["ivf_build_cpu_s"] = round(time.perf_counter() - t, 2)
        if "ivf_build_gpu_s" in row:
            row["ivf_build_gpu_speedup"] = round(row["ivf_build_cpu_s"] / row["ivf_build_gpu_s"], 1)
    for where, index in built.items():
        with faiss_threads(args.threads):
            qps, (_, rows) = _timed_search(lambda qq, k, index=index: search_index(index, qq, k, spec), q, args.k)
        row[f"ivf_{where}_built_recall10"] = round(_overlap(rows, exact), 4)
        row.setdefault("ivf_cpu_qps", round(qps, 1))
    if faiss_gpu and built:
        g = to_gpu(next(iter(built.values())), spec, 0, fp16=True)
        qps, (_, rows) = _timed_search(g.search, q, args.k)
        row.update(ivf_gpu_qps=round(qps, 1), ivf_gpu_recall10=round(_overlap(rows, exact), 4),
                   ivf_gpu_search_speedup=round(qps / row["ivf_cpu_qps"], 1))
        g = None
    if row.get("ivf_build_cpu_s"):
        row["_cpu_ivf"] = {"n": n, "s": row["ivf_build_cpu_s"]}
    return row


def _texts(n: int) -> tuple[list, list[str]]:
    """`n` 100-word passages cycled from the Elements corpus, and every entry's text (for the tokenizers)."""
    from train_bench import make_data

    passages, _, _, texts, _ = make_data("elements", 10_000, 1)
    return [passages[i % len(passages)] for i in range(n)], texts


def bench_encode(args, root: Path, gpus_torch: bool) -> dict:
    from rag.generators.tiny import save, tiny_dpr, train_wordpiece_tokenizer
    from rag.knowledge.encoders import TextEncoder

    passages, texts = _texts(args.encode)
    wp = train_wordpiece_tokenizer(texts, vocab_size=8000)
    d = args.enc_dim
    path = save(tiny_dpr(wp, "context", d_model=d, layers=args.enc_layers, heads=max(4, d // 64), ffn=4 * d, seed=2), wp,
                root / "ctx")
    enc = TextEncoder(path, max_length=256)
    out: dict = {"encoder": f"DPR context encoder, {args.enc_layers} layers x {d}", "max_length": 256}
    runs = [("cpu_fp32", "cpu", None, max(16, args.encode // 16), 32)]
    if gpus_torch:
        runs += [("gpu_fp32", "cuda", None, args.encode, 256), ("gpu_fp16", "cuda", torch.float16, args.encode, 256)]
    for tag, device, dtype, n, batch in runs:
        enc.encode_passages(passages[:batch], batch_size=batch, show_progress=False, device=device, dtype=dtype)  # warm-up
        _sync()
        t = time.perf_counter()
        enc.encode_passages(passages[:n], batch_size=batch, show_progress=False, device=device, dtype=dtype)
        _sync()
        out[f"{tag}_passages_per_s"] = round(n / (time.perf_counter() - t), 1)
        out[f"{tag}_passages"] = n
        out[f"{tag}_batch"] = batch
    if gpus_torch:
        out["gpu_fp16_speedup_vs_cpu"] = round(out["gpu_fp16_passages_per_s"] / out["cpu_fp32_passages_per_s"], 1)
    return out


def bench_train(args, root: Path, gpus_torch: bool) -> dict:
    from train_bench import build_kb, build_models, make_data

    from rag.models.rag.model import RagModel

    n_q = args.batch * (args.train_steps + 3)
    passages, qa, all_questions, texts, corpus = make_data("elements", 500, min(n_q, 64))
    margs = SimpleNamespace(vocab=16000, enc_dim=args.enc_dim, enc_layers=args.enc_layers, d_model=args.d_model,
                            layers=args.layers)
    dirs = build_models(root, texts, margs)
    kb = build_kb(root, dirs, passages, all_questions)
    out: dict = {"corpus": corpus, "passages": len(passages), "batch": args.batch, "n_docs": args.n_docs,
                 "question_encoder": f"{args.enc_layers} x {args.enc_dim}",
                 "generator": f"BART {args.layers}+{args.layers} x {args.d_model}"}
    batches = [qa[(i * args.batch) % len(qa):][: args.batch] for i in range(args.train_steps + 3)]
    batches = [b if len(b) == args.batch else qa[: args.batch] for b in batches]
    runs = [("cpu_fp32", "cpu", None, max(2, args.train_steps // 5))]
    if gpus_torch:
        runs += [("gpu_fp32", "cuda", None, args.train_steps), ("gpu_bf16", "cuda", torch.bfloat16, args.train_steps)]
    for tag, device, dtype, steps in runs:
        torch.manual_seed(0)
        model = RagModel.from_components(dirs["question"], dirs["generator"], str(kb.path), n_docs=args.n_docs,
                                         marginalization="sequence", max_context_length=300).train().to(device)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
        times, losses = [], []
        for i, batch in enumerate(batches[: steps + 2]):  # 2 warm-up steps (AdamW state, kernels)
            _sync()
            t = time.perf_counter()
            with torch.autocast(device_type=device, dtype=dtype, enabled=dtype is not None):
                loss = model([qq for qq, _ in batch], [a for _, a in batch]).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            _sync()
            if i >= 2:
                times.append(time.perf_counter() - t)
            losses.append(round(float(loss.detach()), 3))
        out[f"{tag}_steps_per_s"] = round(1 / float(np.median(times)), 3)
        out[f"{tag}_steps"] = len(times)
        out[f"{tag}_losses"] = losses
        if device == "cuda":
            out[f"{tag}_max_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            torch.cuda.reset_peak_memory_stats()
        del model, opt
    if gpus_torch:
        out["gpu_bf16_speedup_vs_cpu"] = round(out["gpu_bf16_steps_per_s"] / out["cpu_fp32_steps_per_s"], 1)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1000000,2000000,5000000", help="faiss corpus sizes, comma-separated")
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("-k", type=int, default=10)
    ap.add_argument("--ivf", default="ivf_pq", help="IVF-PQ spec built on both sides (default: the package default)")
    ap.add_argument("--cpu-ivf-max", type=int, default=10**9, help="largest N whose IVF-PQ index is also built on the CPU")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="CPU threads for faiss and torch (default: all cores)")
    ap.add_argument("--encode", type=int, default=8192, help="passages encoded on the GPU (the CPU gets 1/16)")
    ap.add_argument("--enc-dim", type=int, default=768)
    ap.add_argument("--enc-layers", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--n-docs", type=int, default=5)
    ap.add_argument("--train-steps", type=int, default=20, help="timed GPU steps (the CPU gets 1/5, at least 2)")
    ap.add_argument("--sections", default="faiss,encode,train")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds: sections and CPU builds that would not fit are skipped")
    ap.add_argument("--quick", action="store_true", help="small models (a sanity run)")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "gpu_bench.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.enc_dim, args.enc_layers, args.d_model, args.layers = 64, 2, 64, 2
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    clock = Clock(args.budget)
    gpus_torch = torch.cuda.is_available()
    problem = faiss_gpu_problem(0)
    res: dict = {"machine": machine_info(args.threads), "command": " ".join(sys.argv), "faiss_gpus": gpu_count(),
                 "faiss_gpu_problem": problem, "torch_cuda": torch.cuda.get_device_name(0) if gpus_torch else None,
                 "faiss": [], "skipped": []}
    print("faiss GPU:", problem or "works", flush=True)
    import faiss

    res["machine"]["faiss"] = faiss.__version__

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(res, indent=1))
        os.replace(tmp, args.out)

    sections = args.sections.split(",")

    def attempt(name: str, fn):
        """Run one part; a failure is recorded (and printed) and the run goes on with the next part."""
        try:
            return fn()
        except Exception as err:  # a benchmark run on a lent machine must bring back what did work
            import traceback

            res.setdefault("errors", {})[name] = traceback.format_exc().splitlines()[-12:]
            print(f"{name} FAILED: {type(err).__name__}: {err}", flush=True)
            return None

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name, fn in (("encode", bench_encode), ("train", bench_train)):
            if name in sections:
                res[name] = attempt(name, lambda fn=fn, name=name: fn(args, root / name, gpus_torch))
                print(name, json.dumps(res[name]), flush=True)
                save()
    if "faiss" in sections:
        prev = None
        for n in (int(s) for s in args.sizes.split(",")):
            need = 40 * n / 1e6  # rough: data, flat searches, GPU build and GPU searches
            if clock.left() < need:
                res["skipped"].append(f"faiss N={n}: {clock.left():.0f} s left, ~{need:.0f} s needed")
                continue
            row = attempt(f"faiss N={n}", lambda n=n, prev=prev: bench_faiss(n, args, clock, gpus_torch, problem is None, prev))
            if row is None:
                continue
            prev = row.pop("_cpu_ivf", prev)
            res["faiss"].append(row)
            print("faiss", json.dumps(row), flush=True)
            save()
    res["wall_s"] = round(time.perf_counter() - clock.t0, 1)
    save()
    print(f"wrote {args.out} ({res['wall_s']} s)")
    if res.get("errors"):  # what worked is written; the run still failed
        print(f"gpu_bench: {len(res['errors'])} measurement(s) failed: {', '.join(res['errors'])} (tracebacks under "
              f"\"errors\" in {args.out})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
