"""Benchmark REPLUG perplexity evaluation against the straightforward implementation, and REPLUG LSR steps with and without
the LM score cache.

Perplexity (same model, data, BM25 retriever, window rule and weights λ = softmax(scores / T) on both sides; the run
aborts unless the token log-likelihoods agree, ``allclose`` rtol = atol = 1e-4, float32 LM):

* reference: the authors' loop shape — per stride one retrieval call, then for each of the k documents one batch-1
  forward pass over ``document ∘ prefix`` with logits over the whole window, then the mixture of the k probabilities;
* ours: :class:`rag.models.ralm.model.InContextRALM` with ``RalmConfig(ensemble=k)`` — all queries of a group in one retrieval
  call, every (chunk, document) window of the group batched (chunks sharing a document and prefix cut share a window),
  logits only at scored positions, one batched mixture (:func:`rag.generation.marginalize.token_marginal_target_logprobs`);
  a document retrieved for several texts (or prefix cuts) runs through the LM once per block, its KV cache shared by its
  windows (:func:`rag.models.ralm.prefix_scoring.score_after_documents`).

LSR: :class:`rag.training.replug_lsr.ReplugLSRModule` steps (MiniLM query encoder over the Elements passages, a random
GPT-2 as the frozen LM, k documents per question) over a few epochs of the same questions: with the score cache the LM
is asked once per (document, question, answer); without it, every step.

    .venv/bin/python benchmarks/replug_bench.py                 # k = 10, CPU, 1 thread, a random GPT-2
    .venv/bin/python benchmarks/replug_bench.py --model smollm2 --texts 4 --max-length 512 --lsr-questions 8 --lsr-epochs 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._proc import machine_info  # noqa: E402
from benchmarks.ralm_bench import build_lm, measure  # noqa: E402
from rag.models.ralm.model import (  # noqa: E402
    EvalText,
    InContextRALM,
    RalmConfig,
    doc_text,
    own_document_filter,
    retrieve_excluding,
)


@torch.no_grad()
def reference_replug(model, tok, retriever, text: EvalText, k: int, temperature: float, stride: int, query_length: int,
                     max_length: int, doc_max_length: int, device) -> np.ndarray:
    """One window per (stride, document), batch 1; mixture Σ_d λ_d p(y_t | d ∘ x) per token."""
    ctx = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    stream = [ctx] + tok(text.text, add_special_tokens=False)["input_ids"]
    guard = own_document_filter(text)
    out = []
    for a in range(1, len(stream), stride):
        b = min(a + stride, len(stream))
        if a == 1:
            inp = torch.tensor([stream[:b]], device=device)
            lp = torch.log_softmax(model(inp).logits[0, -(b - a) - 1:-1].float(), -1)
            out.append(lp.gather(-1, inp[0, -(b - a):, None]).squeeze(-1).double().cpu().numpy())
            continue
        query = tok.decode(stream[max(1, a - query_length):a])
        cands = retrieve_excluding(retriever, [query], k, [guard])[0]
        per_doc = []
        for p, _ in cands:
            doc = tok(doc_text(p), add_special_tokens=False, truncation=True, max_length=doc_max_length)["input_ids"]
            room = max_length - len(doc) - (b - a)
            inp = torch.tensor([doc + stream[max(0, a - room):b]], device=device)
            lp = torch.log_softmax(model(inp).logits[0, -(b - a) - 1:-1].double(), -1)
            per_doc.append(lp.gather(-1, inp[0, -(b - a):, None]).squeeze(-1).cpu())
        lam = torch.log_softmax(torch.tensor([s for _, s in cands], dtype=torch.float64) / temperature, 0)
        out.append(torch.logsumexp(torch.stack(per_doc) + lam[:, None], 0).numpy())
    return np.concatenate(out)


def lsr_steps_per_s(kb_dir: str, lm_dir: str, minilm: str, questions, answers, k: int, epochs: int, cache: bool) -> float:
    from rag.training.replug_lsr import ReplugLSRModule

    m = ReplugLSRModule(lm=lm_dir, question_encoder=minilm, knowledge_base=kb_dir, k=k, cache_lm_scores=cache)
    m.configure_model()
    opt = torch.optim.AdamW(m.model.question_encoder.parameters(), lr=2e-5)
    batches = [{"questions": questions[i:i + 8], "targets": answers[i:i + 8]} for i in range(0, len(questions), 8)]
    for b in batches[:1]:  # warm-up
        m._loss(b)
    t0, steps = time.perf_counter(), 0
    for _ in range(epochs):
        for b in batches:
            opt.zero_grad()
            m._loss(b)[0].backward()
            opt.step()
            steps += 1
    return steps / (time.perf_counter() - t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--texts", type=int, default=12)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--retrieval-temperature", dest="temperature", type=float, default=1.0)
    ap.add_argument("--stride", type=int, default=16)
    ap.add_argument("--query-length", type=int, default=32)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--doc-max-length", type=int, default=64)
    ap.add_argument("--model", default=None, help="a causal LM directory or name (e.g. smollm2, the demo LM); default: a random "
                                                  "GPT-2 of --d-model / --layers with a BPE tokenizer trained on the corpus")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lsr-questions", type=int, default=32)
    ap.add_argument("--lsr-epochs", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from rag.demo import load_demo_corpus
    from rag.knowledge.bm25 import BM25Retriever

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    passages = load_demo_corpus()
    retriever = BM25Retriever.from_passages(passages, show_progress=False)
    tmp = tempfile.TemporaryDirectory()
    if args.model:
        from rag.generators.load import load_generator

        model, tok, _ = load_generator(args.model, kind="causal")
        lm_dir, lm_name = args.model, args.model
    else:
        lm_dir = str(Path(tmp.name) / "lm")
        model, tok = build_lm(passages, args.d_model, args.layers, args.max_length, Path(lm_dir))
        lm_name = f"random GPT-2 d_model={args.d_model} layers={args.layers}"
    texts = [EvalText(p.text, p.id, p.title) for p in passages
             if len(tok(p.text, add_special_tokens=False)["input_ids"]) >= args.stride][:args.texts]
    model = model.to(device)
    print(f"LM: {lm_name}; {len(texts)} texts, k={args.k}, stride {args.stride}, "
          f"window {args.max_length}, documents <= {args.doc_max_length} tokens; device {device}, {args.threads} thread(s)")
    cfg = RalmConfig(stride=args.stride, query_length=args.query_length, max_length=args.max_length,
                     doc_max_length=args.doc_max_length,
                     batch_size=args.batch_size, ensemble=args.k, retrieval_temperature=args.temperature)
    ralm = InContextRALM(model, tok, retriever, cfg)
    ours_fn = lambda: [x.token_logprobs for x in ralm.score_texts(texts)]  # noqa: E731
    ref_fn = lambda: [reference_replug(model, tok, retriever, t, args.k, args.temperature, args.stride,  # noqa: E731
                                       args.query_length,
                                       args.max_length, args.doc_max_length, device) for t in texts]
    ours_fn()
    times, peaks, results = {"ours": [], "reference": []}, {"ours": [], "reference": []}, {}
    for r in range(args.rounds):
        for side in (("ours", "reference") if r % 2 == 0 else ("reference", "ours")):
            dt, peak, res = measure(ours_fn if side == "ours" else ref_fn, device)
            times[side].append(dt)
            peaks[side].append(peak)
            results[side] = res
    for a, b in zip(results["ours"], results["reference"]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    n_tok = sum(len(a) for a in results["ours"])
    med = {k: statistics.median(v) for k, v in times.items()}
    diff = float(max(np.abs(a - b).max() for a, b in zip(results["ours"], results["reference"])))
    row = {"k": args.k, "lm": lm_name, "tokens": n_tok, **{f"{s}_tokens_per_s": n_tok / med[s] for s in med},
           **{f"{s}_peak_mib": max(peaks[s]) for s in peaks},
           "speedup": med["reference"] / med["ours"], "max_abs_diff": diff}
    print(f"perplexity k={args.k}: tokens {n_tok}  reference {row['reference_tokens_per_s']:.0f} tok/s (peak "
          f"+{row['reference_peak_mib']:.0f} MiB)  "
          f"ours {row['ours_tokens_per_s']:.0f} tok/s (peak +{row['ours_peak_mib']:.0f} MiB)  speedup {row['speedup']:.2f}x  "
          f"max |Δ log p| {diff:.1e}")

    from rag.demo import load_demo_qa
    from rag.knowledge.encoders import TextEncoder, resolve_name_or_path
    from rag.knowledge.knowledge_base import KnowledgeBase

    minilm = resolve_name_or_path("minilm")
    kb_dir = str(Path(tmp.name) / "kb")
    KnowledgeBase.build(passages, TextEncoder(minilm), kb_dir, index="flat", show_progress=False)
    qa = load_demo_qa("train")[:args.lsr_questions]
    qs, ans = [q["question"] for q in qa], [q["answers"][0] for q in qa]
    lsr = {c: lsr_steps_per_s(kb_dir, lm_dir, minilm, qs, ans, args.k, args.lsr_epochs, c) for c in (False, True)}
    row.update(lsr_steps_per_s_uncached=lsr[False], lsr_steps_per_s_cached=lsr[True])
    print(f"LSR k={args.k}, batch 8, {args.lsr_epochs} epochs of {len(qs)} questions: uncached {lsr[False]:.2f} steps/s, "
          f"cached {lsr[True]:.2f} steps/s ({lsr[True] / lsr[False]:.2f}x)")
    if args.out:
        from rag.utils.io import atomic_write_json

        atomic_write_json(args.out, {"settings": vars(args), "machine": machine_info(args.threads), "rows": [row]})
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
