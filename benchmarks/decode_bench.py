"""Benchmark RAG decoding against transformers' RAG `generate` on identical models, passages and inputs.

Configurations (BART generator, d_model 512, 6+6 layers, vocabulary ~4k BPE trained on the demo corpus;
batch 4; every context exactly 300 tokens, unpadded; up to 20 new tokens):

* RAG-Sequence thorough decoding, n_docs 5 and 10, 4 beams: `rag_sequence_generate` vs
  `RagSequenceForGeneration.generate`;
* RAG-Token beam search, 4 beams, n_docs 5, and RAG-Token greedy, n_docs 5: `rag_token_generate` vs
  `RagTokenForGeneration.generate`.

Both sides start from the same token ids (`context_input_ids`, `context_attention_mask`, `doc_scores`), so
the timed work is generator encoding + decoding on both (ours includes `encode_contexts`). Every run's
outputs are compared: the benchmark aborts unless they are token-identical.

How it is measured: two persistent worker processes (ours, transformers) build the same seeded models
(checked by a parameter checksum), warm up on a small input, and take turns on `--threads` torch threads:
ours/theirs, then theirs/ours (ABAB), so machine-load drift hits both alike. Before the timed rounds of each
configuration, each side makes one call at that configuration's shapes that is discarded (reported as
``*_warmup_s``): a first call at new shapes runs cold (allocator, kernels), and one cold round would decide a ratio.
Reported: median of the timed rounds per side (`DEFAULT_ROUNDS`, or `--repeats`; `--quick`: one round after the
warm-up), min-max spread, and the spread of the per-round ratios.
Peak memory of every run, in its worker: `malloc_trim(0)`, reset the kernel's RSS high-water mark
(`/proc/self/clear_refs` = 5), run, then `VmHWM - VmRSS(before)` from `/proc/self/status`: the extra
resident memory the call needed (torch's CPU allocations included, which tracemalloc does not see); the
table shows the largest.

Random models repeat one token forever; `build_models` makes the next token a passage-dependent function of
the current one and biases EOS, so hypotheses end at varied lengths (about 5-16 tokens) and passages
sometimes agree. "contexts encoded" counts the encoder rows each side ran: transformers' thorough decoding
re-encodes every passage once per candidate, so it also tells the number of candidates.

Examples::

    .venv/bin/python benchmarks/decode_bench.py --quick          # sanity run: batch 1, short contexts
    .venv/bin/python benchmarks/decode_bench.py                  # the README run
    .venv/bin/python benchmarks/decode_bench.py --profile        # where the time goes (cProfile + torch.profiler)
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _proc import Worker, machine_info, reset_peak_rss, status_kib  # noqa: E402  (benchmarks/_proc.py)

HERE = Path(__file__).resolve().parent
BATCH = 4
CONTEXT_LEN = 300
MAX_LENGTH = 21  # decoder start token + up to 20 new tokens
MIN_LENGTH = 6  # EOS banned before 5 generated tokens


@dataclass(frozen=True)
class BenchConfig:
    name: str
    marginalization: str  # "sequence" (thorough) or "token"
    n_docs: int
    num_beams: int

    @property
    def label(self) -> str:
        kind = "RAG-Sequence thorough" if self.marginalization == "sequence" else "RAG-Token"
        search = f"{self.num_beams} beams" if self.num_beams > 1 else "greedy"
        return f"{kind}, {search}, n_docs {self.n_docs}"


CONFIGS = [
    BenchConfig("token-greedy-k5", "token", 5, 1),
    BenchConfig("token-beam-k5", "token", 5, 4),
    BenchConfig("seq-thorough-k5", "sequence", 5, 4),
    BenchConfig("seq-thorough-k10", "sequence", 10, 4),
]
TARGETS = {"seq-thorough-k5": 5.0, "seq-thorough-k10": 5.0, "token-beam-k5": 1.3, "token-greedy-k5": 1.0}
# Timed rounds per configuration: transformers' thorough decoding takes minutes per call on 2 shared cores
# (6 min at n_docs 5 and 24 min at n_docs 10 under load average 10: the README run took 36 min).
DEFAULT_ROUNDS = {"token-greedy-k5": 2, "token-beam-k5": 1, "seq-thorough-k5": 1, "seq-thorough-k10": 1}


@dataclass
class Models:
    tokenizer: object
    generator: object
    rag_token: dict  # n_docs -> RagTokenForGeneration
    rag_sequence: dict  # n_docs -> RagSequenceForGeneration (its rescoring uses config.n_docs)


def build_models(d_model=512, layers=6, heads=8, ffn=2048, vocab_size=4000, embed_std=1.0, lm_head_std=0.13,
                 eos_bias=9.0, cross_attention_scale=0.5, seed=0, n_docs_values=(2, 5, 10)) -> Models:
    """Random BART generator (+ tiny DPR, for the RagConfig) wrapped in transformers' two RAG classes.

    A plainly initialised random BART ignores its decoder input and repeats one token forever. Here the
    shared embeddings are N(0, embed_std) and the LM head is untied, N(0, lm_head_std): the next token is
    then a context-dependent function of the current one (a random 'bigram chain' that different passages
    bend differently), and an EOS logit bias makes EOS win at varied steps, so beams end at realistic, varied
    lengths (about 6-16 tokens). The cross-attention output projections are scaled by
    `cross_attention_scale` so that, as with a trained model, different passages often lead to the same
    answer: about 40% of the n_docs * 4 beam hypotheses of a question are distinct at scale 0.5 (75% at 1.0).
    That makes transformers' thorough decoding cheaper (it re-encodes every passage once per distinct
    candidate), so it is the conservative choice for the speed ratio.
    """
    from transformers import RagConfig, RagSequenceForGeneration, RagTokenForGeneration

    from rag.demo import load_demo_corpus
    from rag.generators.tiny import tiny_bart, tiny_dpr, train_bpe_tokenizer

    corpus = load_demo_corpus()
    tok = train_bpe_tokenizer([f"{p.title} {p.text}" for p in corpus], vocab_size=vocab_size)
    gen = tiny_bart(tok, d_model=d_model, layers=layers, heads=heads, ffn=ffn, seed=seed).eval()
    qenc = tiny_dpr(tok, seed=seed).eval()
    rag_token, rag_sequence = {}, {}
    for n_docs in n_docs_values:
        cfg = RagConfig.from_question_encoder_generator_configs(
            qenc.config, gen.config, n_docs=n_docs, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id, decoder_start_token_id=tok.eos_token_id)
        rag_token[n_docs] = RagTokenForGeneration(cfg, question_encoder=qenc, generator=gen).eval()
        rag_sequence[n_docs] = RagSequenceForGeneration(cfg, question_encoder=qenc, generator=gen).eval()
    # After wrapping: building the RAG classes re-ties the LM head to the shared embeddings.
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        gen.model.shared.weight.copy_(torch.randn(gen.model.shared.weight.shape, generator=g) * embed_std)
        gen.lm_head.weight = torch.nn.Parameter(torch.randn(gen.lm_head.weight.shape, generator=g) * lm_head_std)
        gen.final_logits_bias[0, tok.eos_token_id] += eos_bias
        for layer in gen.model.decoder.layers:
            layer.encoder_attn.out_proj.weight.mul_(cross_attention_scale)
    for rag in (*rag_token.values(), *rag_sequence.values()):
        if rag.generator is not gen or rag.generator.lm_head.weight.data_ptr() == gen.model.shared.weight.data_ptr():
            raise RuntimeError("the RAG wrappers must share the untied generator")
    return Models(tok, gen, rag_token, rag_sequence)


def build_inputs(tok, n_docs: int, batch: int = BATCH, context_len: int = CONTEXT_LEN, seed: int = 0):
    """`batch * n_docs` contexts of exactly `context_len` tokens (unpadded) and `(batch, n_docs)` doc scores.

    Passages are runs of 16 consecutive demo-corpus entries (always longer than 300 tokens), joined with the
    question in transformers' context format and cut to `context_len` keeping the question; doc scores are
    seeded N(0, 2^2) (the retrieval itself is not benchmarked).
    """
    from rag.demo import load_demo_corpus, load_demo_qa
    from rag.generation.contexts import ContextTruncationWarning, build_contexts, tokenize_contexts
    from rag.knowledge.passages import Passage

    corpus = load_demo_corpus()
    qa = load_demo_qa("dev")
    questions = [qa[(seed + i) % len(qa)]["question"] for i in range(batch)]
    g = torch.Generator().manual_seed(seed)
    passages = []
    for b in range(batch):
        docs = []
        for k in range(n_docs):
            start = int(torch.randint(len(corpus), (1,), generator=g))
            parts = [corpus[(start + j) % len(corpus)] for j in range(16)]  # always > 300 tokens: cut below
            docs.append(Passage(id=f"long/{b}/{k}", title=parts[0].title, text=" ".join(p.text for p in parts)))
        passages.append(docs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ContextTruncationWarning)
        enc = tokenize_contexts(tok, build_contexts(questions, passages), max_length=context_len)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    if ids.shape != (batch * n_docs, context_len) or not bool(mask.all()):
        raise RuntimeError(f"contexts are not all exactly {context_len} tokens: {tuple(ids.shape)}, {mask.sum(1).tolist()}")
    scores = torch.randn(batch, n_docs, generator=g) * 2.0
    return ids, mask, scores


def parameter_checksum(module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------------------------------------
# One decoding call per side


def run_ours(models: Models, cfg: BenchConfig, ids, mask, scores) -> torch.Tensor:
    from rag.generation.decoding import GenerationConfig, encode_contexts, rag_sequence_generate, rag_token_generate

    config = GenerationConfig(max_length=MAX_LENGTH, min_length=MIN_LENGTH, num_beams=cfg.num_beams)
    contexts = encode_contexts(models.generator, ids, mask)
    if cfg.marginalization == "token":
        return rag_token_generate(models.generator, contexts, scores, config).sequences
    return rag_sequence_generate(models.generator, contexts, scores, config, decoding="thorough").sequences


def run_transformers(models: Models, cfg: BenchConfig, ids, mask, scores) -> torch.Tensor:
    model = (models.rag_token if cfg.marginalization == "token" else models.rag_sequence)[cfg.n_docs]
    return model.generate(context_input_ids=ids, context_attention_mask=mask, doc_scores=scores, n_docs=cfg.n_docs,
                          max_length=MAX_LENGTH, min_length=MIN_LENGTH, num_beams=cfg.num_beams,
                          num_return_sequences=1)


RUNNERS = {"ours": run_ours, "transformers": run_transformers}


# --------------------------------------------------------------------------------------------------------
# Memory: extra resident memory of one call


# --------------------------------------------------------------------------------------------------------
# Worker process: one side, persistent across configurations


def _worker(conn, impl: str, threads: int, batch: int, context_len: int) -> None:
    try:
        _serve(conn, impl, threads, batch, context_len)
    except Exception:  # report to the parent instead of dying silently
        import traceback

        conn.send(("error", traceback.format_exc()))


def _serve(conn, impl: str, threads: int, batch: int, context_len: int) -> None:
    torch.set_num_threads(threads)
    models = build_models()
    encoded_rows = []
    models.generator.get_encoder().register_forward_hook(
        lambda mod, args, kwargs, out: encoded_rows.append(out.last_hidden_state.shape[0]), with_kwargs=True)
    run = RUNNERS[impl]
    # Warm-up on a small input (thread pools, lazy imports, first-call allocations), both decoders.
    ids, mask, scores = build_inputs(models.tokenizer, 2, batch=1, context_len=32, seed=99)
    with torch.no_grad():
        for cfg in (BenchConfig("warm-seq", "sequence", 2, 2), BenchConfig("warm-token", "token", 2, 2)):
            run(models, cfg, ids, mask, scores)
    conn.send(("ok", parameter_checksum(models.generator)))
    inputs = {}
    while True:
        msg = conn.recv()
        if msg is None:
            break
        cfg = msg
        if cfg.n_docs not in inputs:
            inputs[cfg.n_docs] = build_inputs(models.tokenizer, cfg.n_docs, batch=batch, context_len=context_len)
        ids, mask, scores = inputs[cfg.n_docs]
        ok = reset_peak_rss()
        before = status_kib("VmRSS")
        encoded_rows.clear()
        t0 = time.perf_counter()
        with torch.no_grad():
            seqs = run(models, cfg, ids, mask, scores)
        seconds = time.perf_counter() - t0
        peak = (status_kib("VmHWM") - before) * 1024 if ok else None
        conn.send(("ok", (seconds, peak, seqs, sum(encoded_rows))))


class Side(Worker):
    """A worker process running one implementation."""

    def __init__(self, impl: str, threads: int, batch: int, context_len: int):
        super().__init__(impl, _worker, (impl, threads, batch, context_len))
        self.impl = impl

    def ready(self) -> str:
        return self.answer()

    def run(self, cfg: BenchConfig):
        return self.request(cfg)


# --------------------------------------------------------------------------------------------------------
# Benchmark


def _lengths(seqs: torch.Tensor, eos: int = 2) -> list[int]:
    return [row.index(eos) + 1 if eos in row else len(row) for row in seqs[:, 1:].tolist()]


def benchmark(configs: list[BenchConfig], rounds: dict[str, int], threads: int, batch: int, context_len: int,
              progress=None) -> list[dict]:
    """Time both sides on every configuration, ABAB, asserting identical outputs on every run."""
    sides = {impl: Side(impl, threads, batch, context_len) for impl in ("ours", "transformers")}
    try:
        sums = {impl: side.ready() for impl, side in sides.items()}
        if len(set(sums.values())) != 1:
            raise RuntimeError(f"the two workers built different generators: {sums}")
        results = []
        for cfg in configs:
            runs = {"ours": [], "transformers": []}
            peaks = {"ours": [], "transformers": []}
            encoded = {}
            warmup, warm_out = {}, {}
            for impl in ("ours", "transformers"):  # one discarded call per side at this configuration's shapes
                warmup[impl], _, warm_out[impl], _ = sides[impl].run(cfg)  # (a first call at new shapes runs cold)
                if progress:
                    progress.update(1)
                    progress.set_postfix_str(f"{cfg.name} {impl} warm-up {warmup[impl]:.1f}s")
            if not torch.equal(warm_out["ours"], warm_out["transformers"]):
                raise RuntimeError(f"{cfg.name}: outputs differ from transformers (warm-up call)")
            for rep in range(rounds[cfg.name]):
                outs = {}
                for impl in (("ours", "transformers") if rep % 2 == 0 else ("transformers", "ours")):
                    seconds, peak, seqs, enc_rows = sides[impl].run(cfg)
                    outs[impl] = seqs
                    runs[impl].append(seconds)
                    peaks[impl].append(peak)
                    encoded[impl] = enc_rows
                    if progress:
                        progress.update(1)
                        progress.set_postfix_str(f"{cfg.name} {impl} {seconds:.1f}s")
                if not torch.equal(outs["ours"], outs["transformers"]):
                    raise RuntimeError(f"{cfg.name}: outputs differ from transformers (round {rep}):\n"
                                       f"ours {outs['ours'].tolist()}\ntransformers {outs['transformers'].tolist()}")
            pair_ratios = [t / o for o, t in zip(runs["ours"], runs["transformers"])]
            med = {impl: statistics.median(v) for impl, v in runs.items()}
            peak = {impl: (None if any(p is None for p in v) else max(v)) for impl, v in peaks.items()}
            results.append(dict(
                config=cfg.name, label=cfg.label, n_docs=cfg.n_docs, num_beams=cfg.num_beams, batch=batch,
                context_len=context_len, ours_s=runs["ours"], transformers_s=runs["transformers"],
                ours_warmup_s=warmup["ours"], transformers_warmup_s=warmup["transformers"],
                ours_median_s=med["ours"], transformers_median_s=med["transformers"],
                ratio=med["transformers"] / med["ours"], pair_ratio_min=min(pair_ratios), pair_ratio_max=max(pair_ratios),
                target=TARGETS.get(cfg.name), ours_peak_bytes=peak["ours"], transformers_peak_bytes=peak["transformers"],
                ours_encoded_contexts=encoded["ours"], transformers_encoded_contexts=encoded["transformers"],
                output_lengths=_lengths(outs["ours"]),
            ))
        return results
    finally:
        for side in sides.values():
            side.close()


def _mib(n) -> str:
    return "n/a" if n is None else f"{n / 2**20:,.0f}"


def markdown_table(results: list[dict]) -> str:
    lines = ["| configuration | ours (s) | transformers (s) | ratio (spread) | target | peak MiB ours | peak MiB transformers | "
             "contexts encoded ours / transformers |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        ours = f"{r['ours_median_s']:.2f} ({min(r['ours_s']):.2f}-{max(r['ours_s']):.2f})"
        theirs = f"{r['transformers_median_s']:.2f} ({min(r['transformers_s']):.2f}-{max(r['transformers_s']):.2f})"
        ok = "met" if r["target"] is not None and r["ratio"] >= r["target"] else "NOT met"
        lines.append(f"| {r['label']} | {ours} | {theirs} | **{r['ratio']:.2f}x** "
                     f"({r['pair_ratio_min']:.2f}-{r['pair_ratio_max']:.2f}) | "
                     f">= {r['target']}x: {ok} | {_mib(r['ours_peak_bytes'])} | {_mib(r['transformers_peak_bytes'])} | "
                     f"{r['ours_encoded_contexts']} / {r['transformers_encoded_contexts']} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------
# Profile


# (file fragment, function) -> label: the phases reported by --profile (cumulative time, calls).
PHASES = {
    "ours": [
        ("generation/seq2seq.py", "encode_contexts", "encoder (once per context)"),
        ("generation/bart.py", "bart_cross_kv", "cross-attention K/V projection (once per context)"),
        ("generation/search.py", "beam_search", "beam search (all decoder steps + bookkeeping)"),
        ("generation/bart.py", "step", "decoder steps"),
        ("generation/bart.py", "reorder", "beam reorder (self-attention cache)"),
        ("generation/bart.py", "rescore_packed", "thorough rescoring pass (packed)"),
        ("modeling_bart.py", "forward", "BART module forwards (all)"),
    ],
    "transformers": [
        ("modeling_bart.py", "BartEncoder.forward", "encoder"),
        ("utils.py", "_beam_search", "beam search (generation loop)"),
        ("modeling_rag.py", "_reorder_cache", "beam reorder (self + cross-attention cache)"),
        ("modeling_rag.py", "RagSequenceForGeneration.forward", "thorough rescoring forward (re-encodes)"),
        ("modeling_bart.py", "BartDecoder.forward", "BART decoder forwards"),
    ],
}


def _phase_table(stats, impl: str) -> list[str]:
    lines = []
    for fragment, func, label in PHASES[impl]:
        cls, _, name = func.rpartition(".")
        total, calls = 0.0, 0
        for (path, _line, fn), (_cc, nc, _tt, ct, callers) in stats.stats.items():
            if fragment in path and fn == name and (not cls or cls in _qualname(path, _line)):
                # count only top-level entries of recursive/nested calls of the same function
                total += ct if not any(name == c[2] and fragment in c[0] for c in callers) else 0.0
                calls += nc
        if calls:
            lines.append(f"  {label:<62s} {total:8.2f} s  ({calls} calls)")
    return lines


def _qualname(path: str, line: int) -> str:
    """The class enclosing `path:line` (cheap source scan), for telling e.g. BartEncoder.forward apart."""
    try:
        with open(path, encoding="utf-8") as f:
            src = f.readlines()[:line]
    except OSError:
        return ""
    for text in reversed(src):
        if text.startswith("class "):
            return text.split()[1].split("(")[0].rstrip(":")
    return ""


def profile(threads: int, top: int = 15) -> None:
    """Where the time goes: cProfile phase totals of both sides, torch.profiler op table of ours."""
    import cProfile
    import pstats

    torch.set_num_threads(threads)
    models = build_models()
    for cfg in (CONFIGS[2], CONFIGS[1]):
        ids, mask, scores = build_inputs(models.tokenizer, cfg.n_docs)
        for impl, run in RUNNERS.items():
            with torch.no_grad():
                run(models, cfg, ids, mask, scores)  # warm-up
            prof = cProfile.Profile()
            t0 = time.perf_counter()
            with torch.no_grad():
                prof.runcall(run, models, cfg, ids, mask, scores)
            print(f"\n=== {cfg.label}: {impl}, {time.perf_counter() - t0:.2f}s under cProfile (cumulative)")
            print("\n".join(_phase_table(pstats.Stats(prof), impl)))
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU]) as tp, torch.no_grad():
            run_ours(models, cfg, ids, mask, scores)
        print(f"\n=== {cfg.label}: ours, torch.profiler ops by self CPU time")
        print(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="sanity run: batch 1, 128-token contexts, n_docs <= 5 configurations, one round")
    ap.add_argument("--repeats", type=int, default=None,
                    help="timed rounds (ours + transformers) per configuration; default: "
                         + ", ".join(f"{k} {v}" for k, v in DEFAULT_ROUNDS.items()))
    ap.add_argument("--threads", type=int, default=2, help="torch threads per side (default 2)")
    ap.add_argument("--configs", nargs="*", choices=[c.name for c in CONFIGS], help="subset of configurations")
    ap.add_argument("--out", type=Path, default=None,
                    help="results JSON (default benchmarks/.cache/decode_bench[_quick].json, git-ignored)")
    ap.add_argument("--profile", action="store_true", help="print where the time goes instead of benchmarking")
    args = ap.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.profile:
        profile(args.threads)
        return 0
    from tqdm.auto import tqdm

    from rag.utils.io import atomic_write_json

    configs = [c for c in CONFIGS if not args.configs or c.name in args.configs]
    batch, context_len = BATCH, CONTEXT_LEN
    rounds = dict(DEFAULT_ROUNDS)
    if args.quick:
        configs = [c for c in configs if c.n_docs <= 5]
        batch, context_len = 1, 128
        rounds = {k: 1 for k in rounds}
    if args.repeats is not None:
        rounds = {k: args.repeats for k in rounds}
    info = machine_info(args.threads)
    t0 = time.perf_counter()
    with tqdm(total=sum(2 * (rounds[c.name] + 1) for c in configs), desc="decode bench", unit="run") as bar:
        results = benchmark(configs, rounds, args.threads, batch, context_len, progress=bar)
    info["wall_s"] = round(time.perf_counter() - t0, 1)
    info["load_average_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(f"\n{info}\n")
    print(markdown_table(results))
    out = args.out or HERE / ".cache" / ("decode_bench_quick.json" if args.quick else "decode_bench.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out, dict(machine=info, command=" ".join(sys.argv), results=results))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
