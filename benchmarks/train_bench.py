"""Training steps/s of rag's RagModel against transformers' RAG classes, side by side in one run.

What is compared: one full training step — forward *with retrieval* (question tokenization, query
encoder, index search, context strings + tokenization, generator, RAG loss), backward and AdamW —
of ``rag.models.rag.model.RagModel`` (RAG-Sequence, Eq. 1, and RAG-Token, Eq. 2) against
``transformers``' ``RagSequenceForGeneration`` / ``RagTokenForGeneration`` (``model(input_ids=...,
labels=...)`` with its own ``RagRetriever``). Both sides start from the same saved DPR question
encoder and BART generator weights, search the same passages and vectors with an exact
inner-product index (ours: a ``KnowledgeBase``, flat index; transformers: a ``datasets`` FAISS index
over the same vectors; the benchmark checks that both retrieve the same passages) and train on the
same batches in the same order.

Data: real text. Passages are the Jargon File and FOLDOC dictionaries (Debian ``dict-jargon``,
``dict-foldoc``, read from ``/usr/share/dictd``), entries written as "headword: definition" and
concatenated into one stream that is cut into disjoint 100-word passages (DPR's Wikipedia
chunking), titled by the entry in progress at the passage start; ``--passages`` of them are
sampled (seeded) and embedded by the DPR context encoder. If those dictionaries are not
installed, the bundled Elements demo entries are streamed and cut the same way (``--corpus``).
Questions are "what is <headword>?" for entries in the sampled passages; targets are the first
10 words of that entry's definition. Tokenizers (byte-level BPE for BART, WordPiece for DPR,
vocabulary 16,000 — closer to BART's 50k than the 4,000 of the decoding benchmark) are trained on
the whole dictionary text; this technical text still takes ~1.6 BPE tokens per word, so a context
"title / passage // question" is ~170 tokens on average over the corpus (p90 ~205, a few over 300;
the retrieved ones average and pad to what each run prints and stores). transformers pads every
context to ``max_combined_length`` = 300, ours to the longest of the batch's B·K = 20 contexts.
The stored passage vectors are adjusted so that the random question encoder does not retrieve the
same few passages for every question (see `build_kb`).

How it is measured: two persistent worker processes (``spawn``), one per system, each on
``--threads`` torch threads (default 1: on 2 shared cores a second OpenMP thread bought
nothing in a quick test, and one thread keeps CPU time a clean measure of work); one round =
``--steps`` consecutive training steps on one side. Rounds alternate ours/theirs, theirs/ours (ABAB...), so machine-load drift
hits both alike; one untimed warm-up step per side first (it also allocates AdamW's state). Reported per side: the
median over rounds of the round's mean step time, the min-max spread, and the spread of the
per-round-pair ratios; also the median CPU time per step (``time.process_time``), which the
other processes on a shared machine disturb less than wall time. Where the time goes: every
timed step is split by forward hooks on the BART generator into retrieval + tokenization (everything before the generator call:
query encoder, index search, context building and tokenization, target tokenization), generator
forward, loss (marginalization, after the generator returns), backward, optimizer step.
Memory, in each worker for each round: ``malloc_trim(0)``, reset the kernel's RSS high-water
mark (``/proc/self/clear_refs`` = 5), run the steps, then read ``VmHWM`` and ``VmRSS`` from
``/proc/self/status``: ``VmHWM - VmRSS(before)`` is the extra resident memory the training steps
needed (activations, gradients, temporaries; torch's CPU allocations included), ``VmHWM`` the
process's peak (models, optimizer state, index and passages included). The largest over rounds
is reported.

    python benchmarks/train_bench.py                 # the README run (RAG-Sequence and RAG-Token)
    python benchmarks/train_bench.py --quick         # small models, 2 rounds of 1 step: a sanity run
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from _proc import Worker, machine_info, reset_peak_rss, status_kib  # noqa: E402  (benchmarks/_proc.py)

SYSTEMS = ("ours", "transformers")
PHASES = ("retrieval_and_tokenization", "generator_forward", "loss", "backward", "optimizer")
MAX_CONTEXT = 300  # transformers' RagConfig.max_combined_length default; ours' max_context_length
TARGET_WORDS = 10
SPEEDUP_TARGET = 1.2


# --------------------------------------------------------------------------- data


def dictionary_entries() -> list[tuple[str, str]] | None:
    """(headword, definition) of the Jargon File + FOLDOC (None when the Debian dictionaries are missing)."""
    sys.path.insert(0, str(HERE))
    from index_bench import DICT_DIR, DICTS, read_dict

    if not all((DICT_DIR / f"{d}.dict.dz").exists() for d in DICTS):
        return None
    return [e for d in ("jargon", "foldoc") for e in read_dict(d)]


def elements_entries() -> list[tuple[str, str]]:
    from rag.demo import load_demo_corpus

    return [(p.title, p.text) for p in load_demo_corpus()]


def make_data(corpus: str, n_passages: int, n_questions: int, seed: int = 0):
    """100-word passages cut from the concatenated entries (`n_passages` sampled) and QA pairs.

    Returns (passages, qa, all_questions, texts, corpus_name): `passages` a list of `Passage`,
    `qa` `n_questions` (question, target) pairs for entries that start inside a sampled passage,
    `all_questions` every such question, `texts` every entry (for training the tokenizers).
    """
    from rag.knowledge.passages import Passage

    entries = dictionary_entries() if corpus in ("auto", "dict") else None
    name = "Jargon File + FOLDOC (Debian dict-jargon, dict-foldoc)"
    if entries is None:
        if corpus == "dict":
            sys.exit("--corpus dict needs /usr/share/dictd/{jargon,foldoc}.*: apt-get install -y dict-jargon dict-foldoc")
        entries, name = elements_entries(), "Elements demo corpus (rag/demo), entries concatenated"
    words: list[str] = []
    owner: list[int] = []  # entry index of every word
    starts: list[int] = []  # first word of every entry
    for i, (head, text) in enumerate(entries):
        ws = f"{head}: {text}".split()
        starts.append(len(words))
        words.extend(ws)
        owner.extend([i] * len(ws))
    n_blocks = len(words) // 100
    rng = np.random.default_rng(seed)
    chosen = np.sort(rng.choice(n_blocks, size=min(n_passages, n_blocks), replace=False))
    passages = [Passage(id=f"p{b}", title=entries[owner[b * 100]][0], text=" ".join(words[b * 100:(b + 1) * 100]))
                for b in chosen]
    chosen_set = set(chosen.tolist())
    qa = []
    for i, (head, text) in enumerate(entries):
        if starts[i] // 100 in chosen_set and len(text.split()) >= 3 and len(head) < 60:
            qa.append((f"what is {head}?", " ".join(text.split()[:TARGET_WORDS])))
    rng.shuffle(qa)
    if len(qa) < n_questions:
        raise RuntimeError(f"only {len(qa)} questions from {len(passages)} passages; ask for more --passages")
    texts = [f"{head}: {text}" for head, text in entries]
    return passages, qa[:n_questions], [q for q, _ in qa], texts, name


def build_models(root: Path, texts, args) -> dict:
    """Tokenizers trained on the corpus `texts` + DPR question/context encoders + BART generator, saved under `root`."""
    from rag.generators.tiny import save, tiny_bart, tiny_dpr, train_bpe_tokenizer, train_wordpiece_tokenizer

    wp = train_wordpiece_tokenizer(texts, vocab_size=args.vocab)
    bpe = train_bpe_tokenizer(texts, vocab_size=args.vocab)
    q = args.enc_dim
    enc = dict(d_model=q, layers=args.enc_layers, heads=4, ffn=4 * q)
    return {
        "question": save(tiny_dpr(wp, "question", seed=1, **enc), wp, root / "q"),
        "context": save(tiny_dpr(wp, "context", seed=2, **enc), wp, root / "c"),
        "generator": save(tiny_bart(bpe, d_model=args.d_model, layers=args.layers, heads=max(4, args.d_model // 64),
                                    ffn=4 * args.d_model, seed=3), bpe, root / "g"),
    }


def build_kb(root: Path, dirs: dict, passages, questions):
    """A flat (exact inner-product) knowledge base of the passages, embedded by the DPR context encoder.

    A random question encoder maps every question to nearly the same vector, so plain random
    embeddings retrieve the same few "hub" passages for every question (in a 1,000-passage test: 5
    distinct passages in 200 retrievals), and their lengths would decide every batch's context
    length. A trained retriever returns question-dependent passages. To get closer to that, the
    stored vectors lose their component along the mean question vector (of `questions`) and are
    L2-normalised (otherwise the longest passages, whose random embeddings have the largest norms,
    win most searches). This spreads retrieval (in a 500-passage test: 170 distinct passages in 300
    retrievals, retrieved contexts 176 tokens on average vs 167 over the corpus), but some hubs
    remain, among them two of the longest passages (~300 tokens), so many batches' longest context is
    near 300 tokens. Whitening the question space did not remove them either. Both systems search
    these same stored vectors; retrieval itself (query encoder + exact search) is unchanged.
    """
    from rag.knowledge.encoders import TextEncoder
    from rag.knowledge.knowledge_base import KnowledgeBase

    cenc = TextEncoder(dirs["context"], max_length=MAX_CONTEXT)
    vectors = cenc.encode_passages(passages, show_progress=True).astype(np.float32)
    mean = TextEncoder(dirs["question"], role="question").encode(questions, show_progress=False).mean(0)
    mean /= np.linalg.norm(mean)
    vectors -= np.outer(vectors @ mean, mean)  # the ranking follows each question's own direction
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)  # no preference for long (large-norm) passages
    return KnowledgeBase.from_embeddings(passages, vectors, cenc.identity(), root / "kb", index="flat", show_progress=False)


# --------------------------------------------------------------------------- the two systems


def make_ours(dirs: dict, kb_path: str, marginalization: str, n_docs: int):
    from rag.models.rag.model import RagModel

    model = RagModel.from_components(dirs["question"], dirs["generator"], kb_path, n_docs=n_docs,
                                     marginalization=marginalization, max_context_length=MAX_CONTEXT).train()

    def forward(questions, targets):
        out = model(questions, targets)
        return out.loss, out.retrieved.rows.tolist()

    return model, model.generator, forward


def make_transformers(dirs: dict, kb_path: str, marginalization: str, n_docs: int):
    """transformers' RagSequence/RagTokenForGeneration with its own RagRetriever over the same vectors."""
    import datasets
    import faiss
    from transformers import (
        AutoTokenizer,
        BartForConditionalGeneration,
        DPRQuestionEncoder,
        RagConfig,
        RagRetriever,
        RagSequenceForGeneration,
        RagTokenForGeneration,
    )
    from transformers.models.rag.retrieval_rag import CustomHFIndex

    from rag.knowledge.knowledge_base import KnowledgeBase

    kb = KnowledgeBase.open(kb_path, verify="size")
    qenc = DPRQuestionEncoder.from_pretrained(dirs["question"])
    gen = BartForConditionalGeneration.from_pretrained(dirs["generator"])
    config = RagConfig.from_question_encoder_generator_configs(
        qenc.config, gen.config, n_docs=n_docs, max_combined_length=MAX_CONTEXT, index_name="custom")
    passages = kb.all_passages()
    ds = datasets.Dataset.from_dict({
        "id": [p.id for p in passages], "title": [p.title for p in passages], "text": [p.text for p in passages],
        "embeddings": [row.tolist() for row in np.asarray(kb.embeddings())],
    })
    ds.add_faiss_index("embeddings", custom_index=faiss.IndexFlatIP(kb.dim), metric_type=faiss.METRIC_INNER_PRODUCT)
    qtok = AutoTokenizer.from_pretrained(dirs["question"])
    gtok = AutoTokenizer.from_pretrained(dirs["generator"])
    retriever = RagRetriever(config, question_encoder_tokenizer=qtok, generator_tokenizer=gtok,
                             index=CustomHFIndex(kb.dim, ds))
    cls = RagSequenceForGeneration if marginalization == "sequence" else RagTokenForGeneration
    model = cls(config, question_encoder=qenc, generator=gen, retriever=retriever).train()

    def forward(questions, targets):
        enc = qtok(questions, return_tensors="pt", padding=True, truncation=True)
        labels = gtok(targets, return_tensors="pt", padding=True, truncation=True).input_ids
        out = model(input_ids=enc.input_ids, attention_mask=enc.attention_mask, labels=labels, reduce_loss=True,
                    output_retrieved=True)
        return out.loss, out.retrieved_doc_ids.tolist()

    return model, model.generator, forward


MAKERS = {"ours": make_ours, "transformers": make_transformers}


# --------------------------------------------------------------------------- memory


# --------------------------------------------------------------------------- worker


class _PhaseClock:
    """Splits a training step at the generator's forward call (pre/post hooks) and at backward/optimizer."""

    def __init__(self, generator):
        self.marks: dict[str, float] = {}
        generator.register_forward_pre_hook(self._start)
        generator.register_forward_hook(self._end)

    def _start(self, module, args) -> None:  # must return None: a value would replace the inputs
        self.marks.setdefault("gen_start", time.perf_counter())

    def _end(self, module, args, output) -> None:
        self.marks["gen_end"] = time.perf_counter()


def _step(forward, opt, clock: _PhaseClock, questions, targets) -> dict:
    clock.marks = {}
    c0 = time.process_time()
    t0 = time.perf_counter()
    loss, rows = forward(questions, targets)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=True)
    t3 = time.perf_counter()
    cpu = time.process_time() - c0
    g0, g1 = clock.marks["gen_start"], clock.marks["gen_end"]
    return {"total": t3 - t0, "retrieval_and_tokenization": g0 - t0, "generator_forward": g1 - g0, "loss": t1 - g1,
            "backward": t2 - t1, "optimizer": t3 - t2, "cpu": cpu, "loss_value": float(loss.item()), "rows": rows}


def _worker(conn, system: str, dirs: dict, kb_path: str, threads: int, n_docs: int) -> None:
    try:
        torch.set_num_threads(threads)
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        import warnings

        warnings.filterwarnings("ignore")
        state = {}
        while True:
            msg = conn.recv()
            if msg is None:
                break
            kind, payload = msg
            if kind == "setup":  # fresh model + optimizer for one marginalization
                state.clear()
                gc.collect()
                torch.manual_seed(0)
                model, generator, forward = MAKERS[system](dirs, kb_path, payload, n_docs)
                opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
                state.update(model=model, forward=forward, opt=opt, clock=_PhaseClock(generator))
                n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
                conn.send(("ok", {"trainable_params": n_params, "rss_mib": status_kib("VmRSS") / 1024}))
            elif kind == "steps":  # a list of (questions, targets) batches; measured as one round
                ok = reset_peak_rss()
                before = status_kib("VmRSS")
                steps = [_step(state["forward"], state["opt"], state["clock"], q, t) for q, t in payload]
                hwm, after = status_kib("VmHWM"), status_kib("VmRSS")
                conn.send(("ok", {"steps": steps, "rss_before_mib": before / 1024, "rss_after_mib": after / 1024,
                                  "vmhwm_mib": hwm / 1024 if ok else None,
                                  "extra_mib": (hwm - before) / 1024 if ok else None}))
            elif kind == "context_lengths":  # ours only: generator input lengths of a batch, no training
                with torch.no_grad():
                    inputs = state["model"].prepare_inputs(payload)
                conn.send(("ok", inputs.context_attention_mask.sum(1).tolist()))
    except Exception:  # report to the parent instead of dying silently
        import traceback

        conn.send(("error", traceback.format_exc()))


class Side(Worker):
    """A persistent worker process running one system."""

    def __init__(self, system: str, dirs: dict, kb_path: str, threads: int, n_docs: int):
        super().__init__(system, _worker, (system, dirs, kb_path, threads, n_docs))
        self.system = system

    def call(self, kind: str, payload=None):
        return self.request((kind, payload))


# --------------------------------------------------------------------------- benchmark


def _median_phases(steps: list[dict]) -> dict:
    return {p: statistics.median(s[p] for s in steps) for p in ("total", "cpu", *PHASES)}


def compare(sides: dict, marginalization: str, qa, args, progress) -> dict:
    """ABAB rounds of one marginalization on both sides (fresh models + optimizers)."""
    setup = {name: side.call("setup", marginalization) for name, side in sides.items()}
    batch_size = args.batch_size
    batches = [([q for q, _ in qa[i:i + batch_size]], [t for _, t in qa[i:i + batch_size]])
               for i in range(0, len(qa) - batch_size + 1, batch_size)]
    needed = 1 + args.rounds * args.steps
    batches = (batches * (needed // len(batches) + 1))[:needed]
    warm = {name: side.call("steps", batches[:1]) for name, side in sides.items()}  # also allocates AdamW state
    same_passages = warm["ours"]["steps"][0]["rows"] == warm["transformers"]["steps"][0]["rows"]
    rounds = {name: [] for name in SYSTEMS}
    for r in range(args.rounds):
        chunk = batches[1 + r * args.steps: 1 + (r + 1) * args.steps]
        for name in (SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]):
            out = sides[name].call("steps", chunk)
            rounds[name].append(out)
            if progress is not None:
                progress.update(1)
                progress.set_postfix_str(f"{marginalization} {name} "
                                         f"{statistics.mean(s['total'] for s in out['steps']):.1f}s/step")
    lengths = [sides["ours"].call("context_lengths", q) for q, _ in batches[1:1 + min(len(batches) - 1, 8)]]
    round_s = {name: [statistics.mean(s["total"] for s in rd["steps"]) for rd in rounds[name]] for name in SYSTEMS}
    med = {name: statistics.median(v) for name, v in round_s.items()}
    pair = [t / o for o, t in zip(round_s["ours"], round_s["transformers"])]
    all_steps = {name: [s for rd in rounds[name] for s in rd["steps"]] for name in SYSTEMS}

    def peak(name, key):
        vals = [rd[key] for rd in rounds[name]]
        return None if any(v is None for v in vals) else max(vals)

    return {
        "marginalization": marginalization,
        "steps_per_s": {name: 1.0 / med[name] for name in SYSTEMS},
        "median_step_s": med,
        "round_step_s": round_s,
        "step_s_spread": {name: [min(v), max(v)] for name, v in round_s.items()},
        "speedup": med["transformers"] / med["ours"],
        "speedup_round_pairs": [min(pair), max(pair)],
        "cpu_s_per_step_median": {name: statistics.median(s["cpu"] for s in all_steps[name]) for name in SYSTEMS},
        "target": SPEEDUP_TARGET,
        "phases_median_s": {name: _median_phases(all_steps[name]) for name in SYSTEMS},
        "memory_mib": {name: {"extra_over_rss_before": peak(name, "extra_mib"), "vmhwm": peak(name, "vmhwm_mib"),
                              "rss_after_setup": setup[name]["rss_mib"]} for name in SYSTEMS},
        "trainable_params": {name: setup[name]["trainable_params"] for name in SYSTEMS},
        "same_passages_retrieved": same_passages,
        "context_tokens": {
            "ours_mean": float(np.mean([x for ls in lengths for x in ls])),
            "ours_padded_mean": float(np.mean([max(ls) for ls in lengths])),
            "ours_max": int(max(max(ls) for ls in lengths)),
            "ours_padded_per_batch": [int(max(ls)) for ls in lengths],
            "transformers_padded": MAX_CONTEXT,
        },
        "first_losses": {name: [warm[name]["steps"][0]["loss_value"]] + [s["loss_value"] for s in rounds[name][0]["steps"][:2]]
                         for name in SYSTEMS},
    }


def markdown_table(results: list[dict]) -> str:
    lines = ["| model | ours s/step | transformers s/step | speedup (round pairs) | CPU s/step ours / transformers | "
             "ours extra / peak MiB | transformers extra / peak MiB |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        o, t = r["step_s_spread"]["ours"], r["step_s_spread"]["transformers"]
        mo, mt = r["memory_mib"]["ours"], r["memory_mib"]["transformers"]
        co, ct = r["cpu_s_per_step_median"]["ours"], r["cpu_s_per_step_median"]["transformers"]
        lines.append(
            f"| RAG-{r['marginalization'].capitalize()} | {r['median_step_s']['ours']:.2f} ({o[0]:.2f}-{o[1]:.2f}) | "
            f"{r['median_step_s']['transformers']:.2f} ({t[0]:.2f}-{t[1]:.2f}) | **{r['speedup']:.2f}x** "
            f"({r['speedup_round_pairs'][0]:.2f}-{r['speedup_round_pairs'][1]:.2f}) | "
            f"{co:.1f} / {ct:.1f} ({ct / co:.2f}x) | {_mib(mo['extra_over_rss_before'])} / {_mib(mo['vmhwm'])} | "
            f"{_mib(mt['extra_over_rss_before'])} / {_mib(mt['vmhwm'])} |")
    lines += ["", "| where the time goes (median s/step) | " + " | ".join(p.replace("_", " ") for p in PHASES) + " |",
              "|---|" + "---|" * len(PHASES)]
    for r in results:
        for name in SYSTEMS:
            ph = r["phases_median_s"][name]
            lines.append(f"| RAG-{r['marginalization'].capitalize()}, {name} | " + " | ".join(f"{ph[p]:.2f}" for p in PHASES)
                         + " |")
    return "\n".join(lines)


def _mib(x) -> str:
    return "n/a" if x is None else f"{x:,.0f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d-model", type=int, default=512, help="BART width (default 512)")
    ap.add_argument("--layers", type=int, default=6, help="BART encoder and decoder layers each (default 6)")
    ap.add_argument("--enc-dim", type=int, default=256, help="DPR encoder width (default 256)")
    ap.add_argument("--enc-layers", type=int, default=4, help="DPR encoder layers (default 4)")
    ap.add_argument("--vocab", type=int, default=16000, help="tokenizer vocabulary size (default 16000)")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--n-docs", type=int, default=5)
    ap.add_argument("--passages", type=int, default=500, help="100-word passages in the knowledge base (default 500)")
    ap.add_argument("--corpus", choices=["auto", "dict", "elements"], default="auto",
                    help="dict: Jargon File + FOLDOC; elements: the demo corpus; auto: dict if installed")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per side and marginalization (default 3)")
    ap.add_argument("--steps", type=int, default=2, help="training steps per round (default 2)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker (default 1)")
    ap.add_argument("--marginalization", choices=["sequence", "token", "both"], default="both")
    ap.add_argument("--quick", action="store_true", help="small models, 2 rounds of 1 step: a sanity run")
    ap.add_argument("--out", type=Path, default=None,
                    help="results JSON (default benchmarks/results/train_bench.json; --quick: benchmarks/.cache/)")
    args = ap.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.quick:
        args.d_model, args.layers, args.enc_dim, args.enc_layers, args.rounds, args.steps = 128, 2, 64, 2, 2, 1
        args.passages = min(args.passages, 200)
    out_path = args.out or (HERE / ".cache" / "train_bench_quick.json" if args.quick else HERE / "results" / "train_bench.json")
    from tqdm.auto import tqdm

    from rag.utils.io import atomic_write_json

    info = machine_info(args.threads)
    t_start = time.perf_counter()
    margs = ["sequence", "token"] if args.marginalization == "both" else [args.marginalization]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        n_questions = (1 + args.rounds * args.steps) * args.batch_size
        passages, qa, all_questions, texts, corpus_name = make_data(args.corpus, args.passages, n_questions)
        dirs = build_models(root, texts, args)
        kb = build_kb(root, dirs, passages, all_questions)
        kb_path = str(kb.path)
        del kb
        t_setup = time.perf_counter() - t_start
        sides = {name: Side(name, dirs, kb_path, args.threads, args.n_docs) for name in SYSTEMS}
        try:
            with tqdm(total=2 * args.rounds * len(margs), desc="train bench", unit="round") as bar:
                results = [compare(sides, m, qa, args, bar) for m in margs]
        finally:
            for side in sides.values():
                side.close()
    info.update(wall_s=round(time.perf_counter() - t_start, 1), setup_s=round(t_setup, 1),
                load_average_end=os.getloadavg())
    meta = {
        "machine": info,
        "command": " ".join(sys.argv),
        "sizes": {"bart_d_model": args.d_model, "bart_layers": args.layers, "dpr_dim": args.enc_dim,
                  "dpr_layers": args.enc_layers, "vocab": args.vocab, "batch": args.batch_size, "n_docs": args.n_docs,
                  "passages": len(passages), "rounds": args.rounds, "steps_per_round": args.steps},
        "corpus": corpus_name + ", 100-word passages",
        "results": results,
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out_path, meta)
    print(f"\n{info}\nsizes {meta['sizes']}\n")
    print(markdown_table(results))
    for r in results:
        c = r["context_tokens"]
        print(f"RAG-{r['marginalization']}: contexts {c['ours_mean']:.0f} tokens on average, padded to "
              f"{c['ours_padded_mean']:.0f} "
              f"(ours) vs {c['transformers_padded']} (transformers); same passages retrieved: {r['same_passages_retrieved']}; "
              f"first losses {r['first_losses']}")
    print(f"\nwrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
