"""Training steps/s of rag's RagModel against transformers' RAG classes, side by side in one run.

Both systems start from the same DPR question encoder and BART generator weights, retrieve from
the same passages and embeddings (ours: a `KnowledgeBase` with a flat index; transformers: its
`RagRetriever` over a `datasets` index holding the same vectors), and take full optimizer steps
(forward with retrieval + backward + AdamW) on the same batches. Steps alternate A/B/A/B so that
load from other processes hits both equally. Peak memory is measured per system in a fresh
subprocess (`ru_maxrss`: CPU resident set, which includes torch's allocations).

    python benchmarks/train_bench.py                      # RAG-Sequence and RAG-Token, default sizes
    python benchmarks/train_bench.py --quick              # tiny sizes, a sanity run

Where the time goes: transformers pads every (question, passage) context to
`max_combined_length` (300) tokens; rag pads to the longest context in the batch and retrieves
once per step (question encoder once; doc scores recomputed from stored embeddings).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def build_models(root: Path, args) -> dict:
    """Tokenizers + DPR question/context encoders + BART generator saved under `root`."""
    from rag.demo import load_demo_corpus
    from rag.models.tiny import save, tiny_bart, tiny_dpr, train_bpe_tokenizer, train_wordpiece_tokenizer

    texts = [f"{p.title} {p.text}" for p in load_demo_corpus()]
    wp = train_wordpiece_tokenizer(texts, vocab_size=2000)
    bpe = train_bpe_tokenizer(texts, vocab_size=2000)
    q = args.enc_dim
    dirs = {
        "question": save(tiny_dpr(wp, "question", d_model=q, layers=args.enc_layers, heads=4, ffn=4 * q, seed=1), wp, root / "q"),
        "context": save(tiny_dpr(wp, "context", d_model=q, layers=args.enc_layers, heads=4, ffn=4 * q, seed=2), wp, root / "c"),
        "generator": save(tiny_bart(bpe, d_model=args.d_model, layers=args.layers, heads=max(4, args.d_model // 64),
                                    ffn=4 * args.d_model, seed=3), bpe, root / "g"),
    }
    return dirs


def build_kb(root: Path, dirs: dict):
    """The demo corpus split into 100-word passages (the paper's DPR setting), flat index."""
    from rag.demo import CORPUS_PATH
    from rag.knowledge.encoders import TextEncoder
    from rag.knowledge.knowledge_base import KnowledgeBase
    from rag.knowledge.passages import load_corpus

    path = root / "kb"
    if (path / "manifest.json").is_file():
        return KnowledgeBase.open(path)
    passages = load_corpus(CORPUS_PATH, words_per_passage=100, show_progress=False)
    return KnowledgeBase.build(passages, TextEncoder(dirs["context"]), path, index="flat", show_progress=False)


def make_ours(dirs: dict, kb, marginalization: str, n_docs: int):
    from rag.models.rag_model import RagModel

    torch.manual_seed(0)
    return RagModel.from_components(dirs["question"], dirs["generator"], kb, n_docs=n_docs,
                                    marginalization=marginalization, max_context_length=300).train()


def make_hf(dirs: dict, kb, marginalization: str, n_docs: int):
    """transformers' RagSequence/RagTokenForGeneration with its own RagRetriever over the same vectors."""
    import datasets
    import faiss
    from transformers import (AutoTokenizer, BartForConditionalGeneration, DPRQuestionEncoder, RagConfig,
                              RagRetriever, RagSequenceForGeneration, RagTokenForGeneration)
    from transformers.models.rag.retrieval_rag import CustomHFIndex

    qenc = DPRQuestionEncoder.from_pretrained(dirs["question"])
    gen = BartForConditionalGeneration.from_pretrained(dirs["generator"])
    config = RagConfig.from_question_encoder_generator_configs(
        qenc.config, gen.config, n_docs=n_docs, max_combined_length=300, index_name="custom",
    )
    passages = kb.all_passages()
    ds = datasets.Dataset.from_dict({
        "title": [p.title for p in passages], "text": [p.text for p in passages],
        "embeddings": [row.tolist() for row in np.asarray(kb.embeddings())],
    })
    ds.add_faiss_index("embeddings", custom_index=faiss.IndexFlatIP(kb.dim), metric_type=faiss.METRIC_INNER_PRODUCT)
    qtok = AutoTokenizer.from_pretrained(dirs["question"])
    gtok = AutoTokenizer.from_pretrained(dirs["generator"])
    retriever = RagRetriever(config, question_encoder_tokenizer=qtok, generator_tokenizer=gtok,
                             index=CustomHFIndex(kb.dim, ds))
    cls = RagSequenceForGeneration if marginalization == "sequence" else RagTokenForGeneration
    model = cls(config, question_encoder=qenc, generator=gen, retriever=retriever)
    return model.train(), qtok, gtok


def batches(n_steps: int, batch_size: int):
    from rag.demo import load_demo_qa

    qa = load_demo_qa("train")
    rng = np.random.default_rng(0)
    for _ in range(n_steps):
        idx = rng.choice(len(qa), batch_size, replace=False)
        yield [qa[i]["question"] for i in idx], [qa[i]["answers"][0] for i in idx]


def step_ours(model, opt, questions, targets) -> float:
    loss = model(questions, targets).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def step_hf(model, qtok, gtok, opt, questions, targets) -> float:
    enc = qtok(questions, return_tensors="pt", padding=True, truncation=True)
    labels = gtok(targets, return_tensors="pt", padding=True, truncation=True).input_ids
    out = model(input_ids=enc.input_ids, attention_mask=enc.attention_mask, labels=labels, reduce_loss=True)
    out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return out.loss.item()


def profile_ours(model, questions, targets) -> dict:
    """Seconds spent in retrieval+context building, generator forward+loss, and backward (one step)."""
    t0 = time.perf_counter()
    inputs = model.prepare_inputs(questions)
    t1 = time.perf_counter()
    labels, mask = model.tokenize_targets(targets)
    logits = model.generator_logits(inputs, labels)
    loss = model.loss_from_logits(logits, labels, mask, inputs.doc_scores)
    t2 = time.perf_counter()
    loss.backward()
    t3 = time.perf_counter()
    model.zero_grad(set_to_none=True)
    return {"retrieve_and_contexts": t1 - t0, "generator_forward_and_loss": t2 - t1, "backward": t3 - t2,
            "context_len": int(inputs.context_input_ids.shape[1])}


def run_memory_child(args, system: str, marginalization: str, workdir: str) -> dict:
    """Peak RSS (MiB) of one system in a fresh process: after building the model, and at the end of
    `steps` training steps (the difference is what training adds: activations, gradients, Adam state)."""
    cmd = [sys.executable, __file__, "--child", system, "--marginalization", marginalization, "--workdir", workdir,
           "--steps", str(max(2, args.steps // 2))] + _size_flags(args)
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def _size_flags(args) -> list[str]:
    return ["--d-model", str(args.d_model), "--layers", str(args.layers), "--enc-dim", str(args.enc_dim),
            "--enc-layers", str(args.enc_layers), "--batch-size", str(args.batch_size), "--n-docs", str(args.n_docs),
            "--threads", str(args.threads)]


def child(args) -> None:
    root = Path(args.workdir)
    dirs = {k: str(root / v) for k, v in (("question", "q"), ("context", "c"), ("generator", "g"))}
    kb = build_kb(root, dirs)
    if args.child == "ours":
        model = make_ours(dirs, kb, args.marginalization, args.n_docs)
        step = lambda opt, q, t: step_ours(model, opt, q, t)  # noqa: E731
    else:
        model, qtok, gtok = make_hf(dirs, kb, args.marginalization, args.n_docs)
        step = lambda opt, q, t: step_hf(model, qtok, gtok, opt, q, t)  # noqa: E731
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    for q, t in batches(args.steps, args.batch_size):
        step(opt, q, t)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"after_build": built, "peak": peak, "training_delta": peak - built}))


def compare(args, dirs: dict, kb, marginalization: str, workdir: str) -> dict:
    ours = make_ours(dirs, kb, marginalization, args.n_docs)
    hf, qtok, gtok = make_hf(dirs, kb, marginalization, args.n_docs)
    opt_ours = torch.optim.AdamW([p for p in ours.parameters() if p.requires_grad], lr=1e-5)
    opt_hf = torch.optim.AdamW([p for p in hf.parameters() if p.requires_grad], lr=1e-5)
    times = {"ours": [], "transformers": []}
    losses = {"ours": [], "transformers": []}
    for i, (q, t) in enumerate(batches(args.steps + 1, args.batch_size)):
        order = [("ours", lambda: step_ours(ours, opt_ours, q, t)), ("transformers", lambda: step_hf(hf, qtok, gtok, opt_hf, q, t))]
        if i % 2:
            order.reverse()
        for name, fn in order:
            t0 = time.perf_counter()
            losses[name].append(fn())
            if i > 0:  # step 0 is warm-up
                times[name].append(time.perf_counter() - t0)
    q, t = next(batches(1, args.batch_size))
    breakdown = profile_ours(ours, q, t)
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "marginalization": marginalization,
        "steps_per_s": {k: 1.0 / v for k, v in med.items()},
        "median_step_s": med,
        "step_s_spread": {k: [min(v), max(v)] for k, v in times.items()},
        "speedup": med["transformers"] / med["ours"],
        "ours_breakdown_s": breakdown,
        "transformers_context_len": 300,
        "first_losses": {k: v[:3] for k, v in losses.items()},
    }
    if not args.no_memory:
        result["peak_rss_mib"] = {
            "ours": run_memory_child(args, "ours", marginalization, workdir),
            "transformers": run_memory_child(args, "hf", marginalization, workdir),
        }
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=512, help="BART width (default 512)")
    ap.add_argument("--layers", type=int, default=6, help="BART encoder and decoder layers each (default 6)")
    ap.add_argument("--enc-dim", type=int, default=256, help="DPR encoder width")
    ap.add_argument("--enc-layers", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--n-docs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per system")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--marginalization", choices=["sequence", "token", "both"], default="both")
    ap.add_argument("--quick", action="store_true", help="small models and 3 steps: a sanity run")
    ap.add_argument("--no-memory", action="store_true", help="skip the per-system peak-memory subprocesses")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "train_bench.json")
    ap.add_argument("--child", choices=["ours", "hf"], help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.child:
        child(args)
        return
    if args.quick:
        args.d_model, args.layers, args.enc_dim, args.enc_layers, args.steps = 128, 2, 64, 2, 3
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        dirs = build_models(root, args)
        kb = build_kb(root, dirs)
        margs = ["sequence", "token"] if args.marginalization == "both" else [args.marginalization]
        results = [compare(args, dirs, kb, m, tmp) for m in margs]
    meta = {"machine": f"{os.cpu_count()} CPU cores, torch {torch.__version__}, {args.threads} threads",
            "sizes": {"bart_d_model": args.d_model, "bart_layers": args.layers, "dpr_dim": args.enc_dim,
                      "dpr_layers": args.enc_layers, "batch": args.batch_size, "n_docs": args.n_docs},
            "date": time.strftime("%Y-%m-%d"), "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(meta, indent=2))
    print(f"\nRAG training step (forward with retrieval + backward + AdamW), {meta['machine']}; sizes {meta['sizes']}")
    print(f"{'model':<14}{'ours steps/s':>14}{'hf steps/s':>12}{'speedup':>9}{'ours ctx len':>14}{'peak MiB ours/hf':>20}")
    for r in results:
        mem = r.get("peak_rss_mib")
        mem_s = f"{mem['ours']['peak']:.0f}/{mem['transformers']['peak']:.0f}" if mem else "-"
        print(f"{'RAG-' + r['marginalization'].capitalize():<14}{r['steps_per_s']['ours']:>14.3f}"
              f"{r['steps_per_s']['transformers']:>12.3f}{r['speedup']:>8.2f}x{r['ours_breakdown_s']['context_len']:>14}{mem_s:>20}")
        b = r["ours_breakdown_s"]
        print(f"    ours, one step: retrieval+contexts {b['retrieve_and_contexts']:.3f}s, generator fwd+loss "
              f"{b['generator_forward_and_loss']:.3f}s, backward {b['backward']:.3f}s")
        if mem:
            print(f"    memory added by training steps (MiB): ours {mem['ours']['training_delta']:.0f}, "
                  f"transformers {mem['transformers']['training_delta']:.0f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
