"""Benchmark In-Context RALM perplexity evaluation against the straightforward per-stride loop, side by side.

Both sides score the same texts with the same LM, tokenizer, BM25 retriever and window rule (document ∘ prefix cut
from the left ∘ the stride's tokens), so their token log-likelihoods must agree; the run aborts unless they do
(``allclose``, rtol = atol = 1e-4, float32 LM).

* reference: the shape of the authors' ``eval_lm.py`` loop — for every stride one retrieval call with one query,
  one tokenization of the retrieved document, one batch-1 forward pass computing logits over the whole window;
* ours: :class:`rag.models.ralm.model.InContextRALM` — every query of a text group known up front and retrieved in one
  call, documents tokenized once per group, chunks that read the same document after the same prefix cut scored in one window,
  windows batched (right-padded), logits only at the scored positions.

Data: the bundled Elements passages (rag/demo/elements.jsonl, 137 short encyclopaedia entries) as both the
knowledge base and the evaluated texts, with the leakage guard excluding each text's own passage (so the
retrieved document is always another element's entry). LM: a random GPT-2 (``--d-model``, ``--layers``) with a BPE
tokenizer trained on the passages, saved and loaded back through ``from_pretrained``.

Reported per stride: scored tokens, seconds, tokens/s and the extra peak resident memory of each side (VmHWM
after a reset, minus RSS before; CUDA: max allocated), and the throughput ratio. Sides alternate (ours, ref, ref,
ours, ...) over ``--rounds`` rounds; the median time is reported.

    .venv/bin/python benchmarks/ralm_bench.py                    # s = 4 and 32, 40 texts, CPU, 1 thread
    .venv/bin/python benchmarks/ralm_bench.py --long             # the same texts as one long stream
    .venv/bin/python benchmarks/ralm_bench.py --device cuda --texts 137 --d-model 768 --layers 12
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

from benchmarks._proc import machine_info, reset_peak_rss, status_kib  # noqa: E402
from rag.models.ralm.model import EvalText, InContextRALM, RalmConfig, doc_text, own_document_filter  # noqa: E402


@torch.no_grad()
def reference_loop(model, tok, retriever, text: EvalText, stride: int, query_length: int, max_length: int, doc_max_length: int,
                   device) -> np.ndarray:
    """One window at a time, batch 1, one retrieval call per stride (the authors' loop shape, our window rule)."""
    ctx = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    stream = [ctx] + tok(text.text, add_special_tokens=False)["input_ids"]
    is_own = own_document_filter(text)
    out = []
    for a in range(1, len(stream), stride):
        b = min(a + stride, len(stream))
        doc: list[int] = []
        if a > 1:
            query = tok.decode(stream[max(1, a - query_length):a])
            hits = retriever.retrieve([query], 9)  # top-1 after the leakage guard, as rag.models.ralm.model.retrieve_excluding
            best = next(p for p in hits.passages[0] if is_own is None or not is_own(p))
            doc = tok(doc_text(best), add_special_tokens=False, truncation=True, max_length=doc_max_length)["input_ids"]
        room = max_length - len(doc) - (b - a)
        inp = torch.tensor([doc + stream[max(0, a - room):b]], device=device)
        logits = model(inp).logits[0, -(b - a) - 1:-1].float()
        out.append(torch.log_softmax(logits, -1).gather(-1, inp[0, -(b - a):, None]).squeeze(-1).double().cpu().numpy())
    return np.concatenate(out)


def build_lm(passages, d_model: int, layers: int, max_length: int, out: Path):
    from rag.generators import tiny
    from rag.generators.load import load_generator

    tok = tiny.train_bpe_tokenizer([f"{p.title} {p.text}" for p in passages], vocab_size=4000)
    tiny.save(tiny.tiny_gpt2(tok, d_model=d_model, layers=layers, heads=max(1, d_model // 64), max_positions=max_length), tok,
              out)
    model, tok, _ = load_generator(out, kind="causal")
    return model, tok


def measure(fn, device):
    """(seconds, extra peak MiB, result) of one call."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        reset_peak_rss()
        base = status_kib("VmRSS")
    t0 = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if device.type == "cuda" else (status_kib("VmHWM") - base) / 1024
    return dt, peak, result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--texts", type=int, default=40, help="evaluated texts (Elements passages)")
    ap.add_argument("--strides", type=int, nargs="+", default=[4, 32])
    ap.add_argument("--query-length", type=int, default=32)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--doc-max-length", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--long", action="store_true", help="evaluate the texts concatenated into one stream (no leakage guard)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)

    from rag.demo import load_demo_corpus
    from rag.knowledge.bm25 import BM25Retriever

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    passages = load_demo_corpus()
    retriever = BM25Retriever.from_passages(passages, show_progress=False)
    with tempfile.TemporaryDirectory() as tmp:
        model, tok = build_lm(passages, args.d_model, args.layers, args.max_length, Path(tmp) / "lm")
    longest = max(args.strides)  # a text shorter than one stride is bad input: take the first texts long enough
    texts = [EvalText(p.text, p.id, p.title) for p in passages
             if len(tok(p.text, add_special_tokens=False)["input_ids"]) >= longest]
    texts = texts[:args.texts]
    if args.long:  # one WikiText-style stream: the prefix is cut from the left, so windows seldom share
        texts = [EvalText("\n\n".join(t.text for t in texts))]
    model = model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"LM: random GPT-2 d_model={args.d_model} layers={args.layers} ({n_params / 1e6:.1f}M parameters, vocab {len(tok)}), "
          f"window {args.max_length}, documents <= {args.doc_max_length} tokens, query length {args.query_length}; "
          f"{len(texts)} text(s); device {device}, {args.threads} thread(s)")
    rows = []
    for s in args.strides:
        cfg = RalmConfig(stride=s, query_length=args.query_length, max_length=args.max_length, doc_max_length=args.doc_max_length,
                         k=1, batch_size=args.batch_size)
        ralm = InContextRALM(model, tok, retriever, cfg)
        ours_fn = lambda ralm=ralm: [x.token_logprobs for x in ralm.score_texts(texts)]  # noqa: E731
        ref_fn = lambda s=s: [reference_loop(model, tok, retriever, t, s, args.query_length, args.max_length,  # noqa: E731
                                         args.doc_max_length, device) for t in texts]
        ours_fn(), ref_fn()  # warm-up (and the equality check below uses the timed results)
        times = {"ours": [], "reference": []}
        peaks = {"ours": [], "reference": []}
        results = {}
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
        row = {"stride": s, "tokens": n_tok, **{f"{k}_seconds": med[k] for k in med},
               **{f"{k}_tokens_per_s": n_tok / med[k] for k in med}, **{f"{k}_peak_mib": max(peaks[k]) for k in peaks},
               "speedup": med["reference"] / med["ours"], "max_abs_diff": float(max(np.abs(a - b).max() for a, b in
                                                                                 zip(results["ours"], results["reference"])))}
        rows.append(row)
        print(f"s={s:>3}  tokens {n_tok:>6}  reference {row['reference_tokens_per_s']:>8.0f} tok/s ({med['reference']:.2f} s, "
              f"peak +{row['reference_peak_mib']:.0f} MiB)  ours {row['ours_tokens_per_s']:>8.0f} tok/s ({med['ours']:.2f} s, "
              f"peak +{row['ours_peak_mib']:.0f} MiB)  speedup {row['speedup']:.2f}x  max |Δ log p| {row['max_abs_diff']:.1e}")
    if args.out:
        from rag.utils.io import atomic_write_json

        atomic_write_json(args.out,
                          {"settings": vars(args), "parameters": n_params, "machine": machine_info(args.threads), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
