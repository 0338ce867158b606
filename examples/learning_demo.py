"""Learning demonstration: RAG learns to answer from its knowledge base; a closed-book BART cannot.

On the bundled Elements corpus (``rag/demo``: 137 passages from a public-domain database, QA pairs
split by element so that every held-out answer exists only in the corpus) this trains, each within
a CPU time budget (``--minutes-per-run``):

1. **RAG-Sequence** (Lewis et al. 2020, Eq. 1), query encoder trained end to end;
2. **RAG-Token** (Eq. 2), query encoder trained end to end;
3. **closed-book BART**: the same generator (same size, tokenizer and initial weights) trained on
   the same question → answer pairs for the same number of optimizer steps as RAG-Sequence, but
   seeing only the question (the paper's Table 1 comparison);
4. **RAG-Frozen**: RAG-Sequence with the query encoder kept fixed (Table 6), to compare its
   retrieval recall@k with that of the end-to-end-trained query encoder.

Every RAG system uses the bundled all-MiniLM-L6-v2 as query encoder over the demo knowledge base
(``rag.demo.kb.ensure_demo_kb``: the same MiniLM embeds the passages; document encoder and index stay
frozen, §2.4) and a small BART generator trained from scratch (no pretrained BART is reachable here),
built by :func:`rag.training.modules.ensure_tiny_generator`. Model, loss and decoding are the
package's: :class:`rag.models.rag_model.RagModel`, :mod:`rag.generation.decoding`,
:mod:`rag.eval.metrics` (EM/F1 with SQuAD normalisation; recall@k = an answer string occurs in one of
the top-k passages' title or text). This file only holds the training loop and the report.

Usage (about 4 x the budget plus evaluation)::

    python examples/learning_demo.py --minutes-per-run 12 --out runs/learning_demo

writes ``results.json``, ``results.md`` and ``learning_demo.png`` (EM and recall@k per system) to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import platform
import random
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run from a clone without `pip install -e .`
    sys.path.insert(0, str(REPO))

from rag.demo import load_demo_qa  # noqa: E402
from rag.demo.kb import ensure_demo_kb  # noqa: E402
from rag.eval.metrics import ExactMatch, RetrievalRecall, TokenF1  # noqa: E402
from rag.generation.decoding import GenerationConfig, encode_contexts, rag_token_generate  # noqa: E402
from rag.io import atomic_write_json, atomic_write_text  # noqa: E402
from rag.knowledge.encoders import TextEncoder  # noqa: E402
from rag.models.rag_model import RagModel, RagModelConfig  # noqa: E402
from rag.training.data import expand_answers, read_qa  # noqa: E402
from rag.training.modules import TinyGenerator, ensure_tiny_generator, generate_answers, warmup_linear_decay  # noqa: E402

logger = logging.getLogger("learning_demo")

SYSTEMS = ("rag-sequence", "rag-token", "closed-book", "rag-frozen")
RECALL_AT = (1, 5)


# ----------------------------------------------------------------------------------------------- options


@dataclass
class DemoConfig:
    """Everything that decides a run (recorded in results.json)."""

    minutes_per_run: float = 12.0
    max_epochs: int = 60
    batch_size: int = 8
    n_docs: int = 3
    max_context_length: int = 128
    generator_lr: float = 1e-3
    query_encoder_lr: float = 1e-4
    query_encoder_start: float = 0.2
    """Fraction of the run during which the query encoder is held fixed while the random generator
    learns to read; afterwards it trains with its own warm-up. Gradients through p(z|x) are noise
    until the generator can tell a useful passage from a useless one."""
    warmup: float = 0.05
    dropout: float = 0.1
    d_model: int = 128
    layers: int = 2
    heads: int = 4
    ffn: int = 512
    vocab_size: int = 3000
    num_beams: int = 1
    max_new_tokens: int = 16
    seed: int = 0
    threads: int = 1


def parse_args(argv: Optional[Sequence[str]] = None) -> tuple[DemoConfig, argparse.Namespace]:
    d = DemoConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--minutes-per-run", type=float, default=d.minutes_per_run, help="CPU training budget of each system (<= 15)")
    p.add_argument("--max-epochs", type=int, default=d.max_epochs, help="stop earlier if these epochs finish within the budget")
    p.add_argument("--out", type=Path, default=Path("runs/learning_demo"), help="output directory")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--n-docs", type=int, default=d.n_docs, help="passages marginalised over (train and eval)")
    p.add_argument("--max-context-length", type=int, default=d.max_context_length, help="generator input tokens per passage+question")
    p.add_argument("--generator-lr", type=float, default=d.generator_lr)
    p.add_argument("--query-encoder-lr", type=float, default=d.query_encoder_lr)
    p.add_argument("--query-encoder-start", type=float, default=d.query_encoder_start,
                   help="fraction of the run before the query encoder starts training")
    p.add_argument("--warmup", type=float, default=d.warmup, help="linear warm-up, fraction of the run")
    p.add_argument("--dropout", type=float, default=d.dropout, help="generator dropout")
    p.add_argument("--d-model", type=int, default=d.d_model)
    p.add_argument("--layers", type=int, default=d.layers, help="generator encoder and decoder layers (each)")
    p.add_argument("--heads", type=int, default=d.heads)
    p.add_argument("--ffn", type=int, default=d.ffn)
    p.add_argument("--vocab-size", type=int, default=d.vocab_size, help="BPE vocabulary trained on the corpus")
    p.add_argument("--num-beams", type=int, default=d.num_beams, help="evaluation beam width (1 = greedy)")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=int, default=d.threads, help="torch CPU threads")
    p.add_argument("--eval-splits", default="dev,test", help="held-out splits to evaluate")
    p.add_argument("--kb", type=Path, default=None, help="demo knowledge-base directory (default: rag's cache)")
    args, _extra = p.parse_known_args(argv)
    if not 0 < args.minutes_per_run:
        p.error("--minutes-per-run must be positive")
    unknown = sorted(set(args.systems.split(",")) - set(SYSTEMS))
    if unknown:
        p.error(f"unknown system(s) {unknown}; choose from {','.join(SYSTEMS)}")
    cfg = DemoConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(DemoConfig)})
    return cfg, args


# ----------------------------------------------------------------------------------------------- components


def generator_dir(kb, cfg: DemoConfig) -> str:
    """A random small BART whose BPE tokenizer is trained on the corpus (cached; same weights for every system)."""
    spec = TinyGenerator(d_model=cfg.d_model, layers=cfg.layers, heads=cfg.heads, ffn=cfg.ffn,
                         vocab_size=cfg.vocab_size, seed=cfg.seed)
    return ensure_tiny_generator("bart", spec, kb.path)


def load_generator(path: str, cfg: DemoConfig):
    """The generator and its tokenizer.

    The tokenizer adds a prefix space, so an answer is tokenized exactly as it appears inside a
    passage ("18" -> "Ġ18", as in "Atomic number: 18."); without it the target tokens of a number
    differ from the passage's and a model trained from scratch cannot learn to copy unseen values.
    The setting is saved with the tokenizer.
    """
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    gen = AutoModelForSeq2SeqLM.from_pretrained(path, dropout=cfg.dropout, attention_dropout=cfg.dropout)
    tok = AutoTokenizer.from_pretrained(path, add_prefix_space=True)
    return gen, tok


def build_rag(kb, gen_path: str, cfg: DemoConfig, marginalization: str, freeze_query_encoder: bool) -> RagModel:
    gen, tok = load_generator(gen_path, cfg)
    rag_cfg = RagModelConfig(n_docs=cfg.n_docs, marginalization=marginalization, freeze_query_encoder=freeze_query_encoder,
                             max_context_length=cfg.max_context_length, max_target_length=16, max_question_length=32)
    return RagModel(TextEncoder("minilm"), gen, tok, kb, rag_cfg)


# ----------------------------------------------------------------------------------------------- training


@dataclass
class TrainStats:
    steps: int = 0
    epochs: float = 0.0
    seconds: float = 0.0
    first_loss: float = float("nan")
    last_loss: float = float("nan")
    losses: list = field(default_factory=list)


def train(loss_fn: Callable[[list], torch.Tensor], groups: dict[str, tuple[list, float]],
          items: Sequence, cfg: DemoConfig, *, budget_s: float, max_steps: Optional[int] = None,
          delayed: Sequence[str] = ()) -> TrainStats:
    """AdamW over shuffled batches of `items` (``loss_fn(batch)`` -> scalar loss) until the time
    budget or the step cap is spent.

    The learning rate follows warm-up + linear decay over the run's *progress*
    ``max(elapsed / budget_s, step / max_steps)``, so a run always ends with the rate at zero whether
    the clock or the step cap ends it. Groups named in `delayed` stay at rate 0 until progress
    ``cfg.query_encoder_start``, then warm up and decay over the rest of the run.
    """
    steps_per_epoch = math.ceil(len(items) / cfg.batch_size)
    cap = max_steps if max_steps is not None else cfg.max_epochs * steps_per_epoch
    params = [{"params": ps, "lr": lr, "name": name, "base_lr": lr} for name, (ps, lr) in groups.items() if ps]
    opt = torch.optim.AdamW(params, weight_decay=0.0)
    rng = random.Random(cfg.seed)
    stats = TrainStats()
    t0 = time.monotonic()
    order: list[int] = []
    window: list[float] = []
    while True:
        progress = max((time.monotonic() - t0) / budget_s, stats.steps / cap)
        if progress >= 1.0:
            break
        for g in opt.param_groups:
            if g["name"] in delayed:
                start = cfg.query_encoder_start
                p = 0.0 if progress < start else (progress - start) / max(1e-9, 1.0 - start)
            else:
                p = progress
            g["lr"] = g["base_lr"] * warmup_linear_decay(int(p * 10_000), int(cfg.warmup * 10_000), 10_000)
        if not order:
            order = list(range(len(items)))
            rng.shuffle(order)
        idx, order = order[: cfg.batch_size], order[cfg.batch_size:]
        loss = loss_fn([items[i] for i in idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 1.0)
        opt.step()
        stats.steps += 1
        value = float(loss.detach())
        if stats.steps == 1:
            stats.first_loss = value
        window.append(value)
        if stats.steps % steps_per_epoch == 0:
            stats.losses.append(round(sum(window) / len(window), 4))
            logger.info("  epoch %d  step %d  %.0fs  loss %.3f", stats.steps // steps_per_epoch, stats.steps,
                        time.monotonic() - t0, stats.losses[-1])
            window = []
    stats.seconds = time.monotonic() - t0
    stats.epochs = stats.steps / steps_per_epoch
    stats.last_loss = value if stats.steps else float("nan")
    return stats


def train_rag(model: RagModel, pairs, cfg: DemoConfig, budget_s: float) -> TrainStats:
    model.train()
    groups = model.parameter_groups()
    lrs = {"generator": (groups["generator"], cfg.generator_lr),
           "query_encoder": (groups["query_encoder"], cfg.query_encoder_lr)}
    stats = train(lambda batch: model([q for q, _ in batch], [a for _, a in batch]).loss, lrs, pairs, cfg,
                  budget_s=budget_s, delayed=("query_encoder",))
    model.eval()
    return stats


def infilling_loss(gen, tok, cfg: DemoConfig, seed: int = 0):
    """BART's own pre-training objective (text infilling, Lewis et al. 2019 §2.2) on passages.

    About 30 % of each passage's tokens, in spans of Poisson(3) length, are each replaced by one
    ``<mask>``; the target is the whole passage. Reconstructing it teaches a randomly initialised
    generator to find its place in the input and copy from it — the skill a reader needs, learned
    from the knowledge-base text alone (no question or answer is seen).
    """
    rng = random.Random(seed)
    mask_id = tok.mask_token_id

    def noise(ids: list[int]) -> list[int]:
        body, out, i = ids[1:-1], [], 0
        budget = int(round(0.3 * len(body)))
        starts = set(rng.sample(range(len(body)), k=max(1, budget // 3))) if body else set()
        while i < len(body):
            if i in starts and budget > 0:
                starts.discard(i)
                n = min(budget, max(0, _poisson(rng, 3.0)), len(body) - i)
                out.append(mask_id)
                i += n
                budget -= n
            else:
                out.append(body[i])
                i += 1
        return ids[:1] + out + ids[-1:]

    def loss_fn(texts: list[str]) -> torch.Tensor:
        target = tok(texts, truncation=True, max_length=cfg.max_context_length)["input_ids"]
        inputs = tok.pad({"input_ids": [noise(t) for t in target]}, return_tensors="pt")
        labels = tok.pad({"input_ids": target}, return_tensors="pt")["input_ids"]
        labels = labels.masked_fill(labels.eq(tok.pad_token_id), -100)
        out = gen(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], labels=labels)
        return out.loss * labels.ne(-100).sum() / labels.shape[0]

    return loss_fn


def lookup_loss(gen, tok, cfg: DemoConfig, *, max_words: int = 60, seed: int = 0):
    """Self-supervised reading practice on the knowledge-base passages (no question or answer is seen).

    For a passage, a random word position j is drawn; the "question" is the 1-3 words before it
    and the target the 1-2 words from j on (trailing punctuation dropped). The context has exactly
    the layout RagModel gives the generator, ``title / text // cue``. To predict the target the
    generator must find the cue in the passage and copy what follows it: the reading skill that
    extractive QA needs, which a randomly initialised BART does not discover from a few hundred
    QA pairs before it starts memorising them. Items are :class:`Passage` objects; every visit
    draws a new cue.
    """
    from rag.generation.contexts import ContextFormat, build_contexts, tokenize_contexts

    rng = random.Random(seed)
    fmt = ContextFormat(title_sep=" / ", doc_sep=" // ", prefix="")

    def example(p) -> tuple[str, str]:
        words = f"{p.title} / {p.text}".split()
        last = min(len(words), max_words)
        for _ in range(10):
            j = rng.randrange(1, last)
            target = " ".join(words[j:j + rng.choice((1, 1, 2))]).strip(".,;:()")
            if target and target != "/":
                break
        cue = " ".join(words[max(0, j - rng.choice((1, 2, 3))):j])
        return cue, target

    def loss_fn(passages: list) -> torch.Tensor:
        cues, targets = zip(*(example(p) for p in passages))
        enc = tokenize_contexts(tok, build_contexts(list(cues), [[p] for p in passages], fmt), cfg.max_context_length)
        labels = tok(list(targets), padding=True, truncation=True, max_length=16, return_tensors="pt")["input_ids"]
        labels = labels.masked_fill(labels.eq(tok.pad_token_id), -100)
        out = gen(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], labels=labels)
        return out.loss * labels.ne(-100).sum() / labels.shape[0]

    return loss_fn


def _poisson(rng: random.Random, lam: float) -> int:
    """A Poisson(lam) draw (Knuth's method; lam is small)."""
    limit, k, p = math.exp(-lam), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


def closed_book_loss(gen, tok):
    """Plain seq2seq NLL of the answer given only the question (same target tokens as RagModel)."""

    def loss_fn(batch: list[tuple[str, str]]) -> torch.Tensor:
        questions, answers = [q for q, _ in batch], [a for _, a in batch]
        enc = tok(questions, padding=True, truncation=True, max_length=32, return_tensors="pt")
        labels = tok(answers, padding=True, truncation=True, max_length=16, return_tensors="pt")["input_ids"]
        labels = labels.masked_fill(labels.eq(tok.pad_token_id), -100)
        out = gen(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], labels=labels)
        n_tokens = labels.ne(-100).sum()
        return out.loss * n_tokens / labels.shape[0]  # per-sequence sum, batch mean: RagModel's reduction

    return loss_fn


# ----------------------------------------------------------------------------------------------- evaluation


def _per_type(examples, preds) -> dict:
    types = {x["question"]: x["type"] for s in ("train", "dev", "test") for x in load_demo_qa(s)}
    em: dict[str, ExactMatch] = defaultdict(ExactMatch)
    for ex, p in zip(examples, preds):
        em[types.get(ex.question, "?")].update([p], [list(ex.answers)])
    return {t: round(float(m.compute()), 4) for t, m in sorted(em.items())}


@torch.no_grad()
def evaluate_rag(model: RagModel, examples, cfg: DemoConfig, bs: int = 32) -> dict:
    em, f1, recall = ExactMatch(), TokenF1(), RetrievalRecall(RECALL_AT)
    preds, samples = [], []
    for i in range(0, len(examples), bs):
        chunk = examples[i:i + bs]
        qs, golds = [e.question for e in chunk], [list(e.answers) for e in chunk]
        answers, retrieved, _ = generate_answers(model, qs, num_beams=cfg.num_beams, max_new_tokens=cfg.max_new_tokens,
                                                 sequence_decoding="thorough" if cfg.num_beams > 1 else "fast")
        em.update(answers, golds)
        f1.update(answers, golds)
        deep, _ = model.retrieve(qs, n_docs=max(RECALL_AT))
        recall.update(deep.passages, golds)
        preds.extend(answers)
        samples.extend({"question": q, "predicted": a, "gold": g, "top_passage": ps[0].title}
                       for q, a, g, ps in zip(qs, answers, golds, retrieved.passages))
    out = {"em": float(em.compute()), "f1": float(f1.compute()),
           **{k: float(v) for k, v in recall.compute().items()}, "n": len(examples),
           "em_by_type": _per_type(examples, preds), "samples": samples[:8]}
    return out


@torch.no_grad()
def evaluate_closed_book(gen, tok, examples, cfg: DemoConfig, bs: int = 64) -> dict:
    """Same decoder as RAG-Token with a single 'context' (the question alone) and prior 1."""
    gen.eval()
    em, f1 = ExactMatch(), TokenF1()
    preds = []
    gcfg = GenerationConfig(num_beams=cfg.num_beams, max_new_tokens=cfg.max_new_tokens)
    for i in range(0, len(examples), bs):
        chunk = examples[i:i + bs]
        qs, golds = [e.question for e in chunk], [list(e.answers) for e in chunk]
        enc = tok(qs, padding=True, truncation=True, max_length=32, return_tensors="pt")
        ctx = encode_contexts(gen, enc["input_ids"], enc["attention_mask"])
        out = rag_token_generate(gen, ctx, torch.zeros(len(qs), 1), gcfg)
        answers = [t.strip() for t in tok.batch_decode(out.sequences, skip_special_tokens=True)]
        em.update(answers, golds)
        f1.update(answers, golds)
        preds.extend(answers)
    return {"em": float(em.compute()), "f1": float(f1.compute()), "n": len(examples),
            "em_by_type": _per_type(examples, preds),
            "samples": [{"question": e.question, "predicted": p, "gold": list(e.answers)} for e, p in zip(examples[:8], preds[:8])]}


# ----------------------------------------------------------------------------------------------- report


LABELS = {"rag-sequence": "RAG-Sequence", "rag-token": "RAG-Token", "closed-book": "closed-book BART", "rag-frozen": "RAG-Frozen (RAG-Seq.)"}


def markdown_table(results: dict, splits: Sequence[str]) -> str:
    head = "| system | train time | steps (epochs) | " + " | ".join(
        f"{s} EM | {s} F1 | {s} R@1 | {s} R@5" for s in splits) + " |"
    rows = [head, "|" + "---|" * (3 + 4 * len(splits))]
    for name, r in results["systems"].items():
        cells = [LABELS[name], f"{r['train']['seconds'] / 60:.1f} min", f"{r['train']['steps']} ({r['train']['epochs']:.1f})"]
        for s in splits:
            e = r["eval"][s]
            cells += [f"{100 * e['em']:.1f}", f"{100 * e['f1']:.1f}"]
            cells += [f"{100 * e[f'recall@{k}']:.1f}" if f"recall@{k}" in e else "–" for k in RECALL_AT]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def plot(results: dict, path: Path, split: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["systems"])
    metrics = [("em", "EM"), ("f1", "F1"), ("recall@1", "recall@1"), ("recall@5", "recall@5")]
    fig, ax = plt.subplots(figsize=(8.5, 4))
    width = 0.8 / len(names)
    for i, n in enumerate(names):
        e = results["systems"][n]["eval"][split]
        vals = [100 * e.get(m, float("nan")) for m, _ in metrics]
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(metrics))]
        bars = ax.bar(xs, [0 if math.isnan(v) else v for v in vals], width, label=LABELS[n])
        for b, v in zip(bars, vals):
            ax.text(b.get_x() + b.get_width() / 2, (0 if math.isnan(v) else v) + 1, "n/a" if math.isnan(v) else f"{v:.0f}",
                    ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(metrics)), [m for _, m in metrics])
    ax.set_ylim(0, 105)
    ax.set_ylabel("%")
    ax.set_title(f"Elements demo, held-out {split} split ({results['systems'][names[0]]['eval'][split]['n']} questions); "
                 f"≤{results['config']['minutes_per_run']:g} CPU-min per system", fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------- main


def main(argv: Optional[Sequence[str]] = None) -> int:
    cfg, args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    for noisy in ("transformers", "httpx", "rag.generation.contexts"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    import warnings

    warnings.filterwarnings("ignore", message=".*longer than max_length.*")
    torch.set_num_threads(cfg.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    systems = [s for s in SYSTEMS if s in args.systems.split(",")]
    splits = [s for s in args.eval_splits.split(",") if s]
    budget_s = 60.0 * cfg.minutes_per_run
    t_all = time.monotonic()

    kb = ensure_demo_kb(args.kb, show_progress=False)
    gen_path = generator_dir(kb, cfg)
    train_pairs = expand_answers(read_qa("demo:train"))
    evals = {s: read_qa(f"demo:{s}") for s in splits}
    logger.info("knowledge base %s (%d passages, %s); %d training pairs; eval %s", kb.path, len(kb), kb.version,
                len(train_pairs), {s: len(v) for s, v in evals.items()})

    results: dict = {
        "config": dataclasses.asdict(cfg),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "threads": cfg.threads, "load_average_start": list(os.getloadavg())},
        "knowledge_base": {"path": str(kb.path), "version": kb.version, "passages": len(kb)},
        "generator": {"path": gen_path},
        "systems": {},
    }

    rag_seq_steps: Optional[int] = None
    for name in systems:
        torch.manual_seed(cfg.seed)
        logger.info("=== %s: training (budget %.1f min)", name, cfg.minutes_per_run)
        if name == "closed-book":
            gen, tok = load_generator(gen_path, cfg)
            gen.train()
            steps = rag_seq_steps  # same number of optimizer steps as RAG-Sequence (else the budget decides)
            stats = train(closed_book_loss(gen, tok), {"generator": (list(gen.parameters()), cfg.generator_lr)},
                          train_pairs, cfg, budget_s=budget_s, max_steps=steps)
            t = time.monotonic()
            ev = {s: evaluate_closed_book(gen, tok, exs, cfg) for s, exs in evals.items()}
            results["generator"]["parameters"] = sum(p.numel() for p in gen.parameters())
        else:
            marg = "token" if name == "rag-token" else "sequence"
            model = build_rag(kb, gen_path, cfg, marg, freeze_query_encoder=name == "rag-frozen")
            stats = train_rag(model, train_pairs, cfg, budget_s)
            if name == "rag-sequence":
                rag_seq_steps = stats.steps
            t = time.monotonic()
            ev = {s: evaluate_rag(model, exs, cfg) for s, exs in evals.items()}
        eval_s = time.monotonic() - t
        results["systems"][name] = {"train": dataclasses.asdict(stats), "eval_seconds": eval_s, "eval": ev}
        for s in splits:
            e = ev[s]
            logger.info("%s %s: EM %.3f F1 %.3f %s (train %.1f min, %d steps, %.1f epochs; eval %.0fs)", name, s, e["em"], e["f1"],
                        " ".join(f"R@{k} {e[f'recall@{k}']:.3f}" for k in RECALL_AT if f"recall@{k}" in e),
                        stats.seconds / 60, stats.steps, stats.epochs, eval_s)
        atomic_write_json(args.out / "results.json", results)

    results["wall_seconds"] = time.monotonic() - t_all
    results["machine"]["load_average_end"] = list(os.getloadavg())
    atomic_write_json(args.out / "results.json", results)
    table = markdown_table(results, splits)
    atomic_write_text(args.out / "results.md", table + "\n")
    plot(results, args.out / "learning_demo.png", "test" if "test" in splits else splits[0])
    print(table)
    print(f"\nwall time {results['wall_seconds'] / 60:.1f} min; results in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
