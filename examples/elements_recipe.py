"""The Elements recipe: RAG learns to answer from its knowledge base; a closed-book model cannot (and ``checkpoints/demo``).

This is the hand-written training loop the demo checkpoint was made with, kept to reproduce it and to compare RAG-Token;
for any corpus (the Elements demo included) the package's recipe is ``lightning_configs/cpu_reader.yaml``, compared
across systems by ``examples/learning_demo.py``.

On the bundled Elements corpus (``rag/demo``: 137 passages of a public-domain database; QA pairs split
by element, so every held-out answer exists only in the corpus) this trains four systems, each within
the same CPU-time budget (``--minutes``):

1. **RAG-Sequence** (Lewis et al. 2020, Eq. 1), query encoder trained end to end;
2. **RAG-Token** (Eq. 2), query encoder trained end to end;
3. **closed-book**: the same generator (same size and initial weights) trained on the same question →
   answer pairs, seeing only the question (the paper's Table 1 comparison);
4. **RAG-Frozen**: RAG-Sequence with the query encoder kept fixed (Table 6), to compare its retrieval
   recall@k with the end-to-end-trained encoders'.

Every system shares the generator recipe of :mod:`rag.generators.warm_start` (no pretrained BART can be
downloaded here, and one trained from scratch only memorises): the bundled all-MiniLM-L6-v2 as a
frozen encoder, a fresh 2-layer BERT decoder with MiniLM's word embeddings, frozen and tied to its
output layer, and a copy head (:mod:`rag.generators.pointer`). All systems start from one such generator
pre-trained for ``--pretrain-minutes`` (5) CPU-minutes on reading practice alone (cached; this demo's
stand-in for BART's pre-training), so each system trains 5 + ``--minutes`` (10) CPU-minutes in all.
Every system also gets the same auxiliary loss during fine-tuning, *reading practice*
(:mod:`rag.demo.reading_practice`): training passages with randomised facts and a question about one
of them, each given with its passage (``RagModel.generator_loss``). It teaches the generator to read;
it cannot teach it the held-out facts, which only retrieval can supply. Each step = ``--real`` real QA
pairs + ``--practice`` practice examples. RAG systems use the bundled MiniLM as query encoder over
the demo knowledge base (document encoder and index frozen, §2.4).

Model, loss, decoding and metrics are the package's (:class:`~rag.models.rag.model.RagModel`,
:mod:`rag.generation.decoding`, :mod:`rag.eval.metrics`: EM/F1 with SQuAD normalisation, recall@k = an
answer string occurs in one of the top-k passages). Budgets are process CPU time (1 torch thread);
evaluation is outside the budget.

Usage (two systems at a time on 2 cores: about 2 x the budget plus evaluation)::

    python examples/elements_recipe.py --jobs 2 --out runs/elements_recipe     # ~30 min wall on 2 cores

writes ``results.json``, ``results.md`` and ``elements_recipe.png`` (learning curves and final held-out
metrics) to ``--out``. ``--save-frozen DIR`` also saves the trained RAG-Frozen model (that is how
``checkpoints/demo`` is made: ``python checkpoints/make_demo.py``).
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
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run from a clone without `pip install -e .`
    sys.path.insert(0, str(REPO))

from rag.demo import load_demo_corpus, load_demo_qa  # noqa: E402
from rag.demo.kb import ensure_demo_kb  # noqa: E402
from rag.demo.reading_practice import ReadingPractice  # noqa: E402
from rag.eval.metrics import ExactMatch, RetrievalRecall, TokenF1  # noqa: E402
from rag.eval.qa_data import expand_answers, read_qa  # noqa: E402
from rag.generation.decoding import GenerationConfig, encode_contexts, rag_token_generate  # noqa: E402
from rag.generation.detokenize import decode_answer  # noqa: E402
from rag.generators.warm_start import build_warm_start_generator, cache_encoder_outputs, load_warm_start  # noqa: E402
from rag.knowledge.encoders import TextEncoder  # noqa: E402
from rag.models.rag.model import RagModel, RagModelConfig  # noqa: E402
from rag.training.modules import generate_answers  # noqa: E402
from rag.training.schedules import warmup_linear_decay  # noqa: E402
from rag.utils.io import atomic_write_json, atomic_write_text  # noqa: E402

logger = logging.getLogger("elements_recipe")

SYSTEMS = ("rag-sequence", "rag-token", "closed-book", "rag-frozen")
LABELS = {"rag-sequence": "RAG-Sequence", "rag-token": "RAG-Token", "closed-book": "closed-book",
          "rag-frozen": "RAG-Frozen (RAG-Seq.)"}
RECALL_AT = (1, 3, 5)


@dataclass
class DemoConfig:
    """Everything that decides a run (recorded in results.json)."""

    minutes: float = 10.0
    """CPU-time fine-tuning budget per system (process CPU time, evaluation excluded)."""
    real: int = 4
    """Real training QA pairs per step."""
    practice: int = 4
    """Reading-practice examples per step (auxiliary generator loss, keeps the generator reading)."""
    practice_pool: int = 1000
    """Size of the fixed pool of practice examples drawn from during fine-tuning."""
    pretrain_minutes: float = 5.0
    """CPU-time budget of the shared generator pre-training on reading practice (the stand-in for BART's
    pre-training; done once, cached, and reused by every system)."""
    pretrain_threads: int = 1
    pretrain_batch: int = 16
    pretrain_pool: int = 4000
    n_docs: int = 3
    max_context_length: int = 160
    decoder_layers: int = 2
    pointer: bool = True
    """Give the generator a copy head (:mod:`rag.generators.pointer`). Without it the reader needs ~6x the
    pre-training to read half as well (measured: oracle dev EM 0.049 vs 0.657 after 8 CPU-min)."""
    generator_lr: float = 2e-4
    """Peak generator learning rate while fine-tuning on real QA (1e-3 makes it memorise the training
    answers within 10 CPU-minutes: measured dev EM 0.14, 'fermium' for 'which element has the symbol Fe?')."""
    pretrain_lr: float = 1e-3
    query_encoder_lr: float = 2e-5
    query_encoder_start: float = 0.2
    """Fraction of the run before the query encoder starts training (while the generator cannot read
    yet, gradients through p(z|x) carry no signal)."""
    warmup: float = 0.05
    max_new_tokens: int = 12
    curve_points: int = 4
    """Dev evaluations during training (for the learning curve), evenly spaced in the budget."""
    seed: int = 0
    threads: int = 1


def parse_args(argv: Optional[Sequence[str]] = None) -> tuple[DemoConfig, argparse.Namespace]:
    d = DemoConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(DemoConfig):
        value = getattr(d, f.name)
        if isinstance(value, bool):
            p.add_argument("--" + f.name.replace("_", "-"), action=argparse.BooleanOptionalAction, default=value)
        else:
            p.add_argument("--" + f.name.replace("_", "-"), type=type(value), default=value)
    p.add_argument("--out", type=Path, default=Path("runs/elements_recipe"), help="output directory")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--jobs", type=int, default=1, help="systems trained at once, each in its own process")
    p.add_argument("--eval-splits", default="dev,test", help="held-out splits to evaluate at the end")
    p.add_argument("--eval-limit", type=int, default=0, help="evaluate on the first N questions of each split only (0: all)")
    p.add_argument("--kb", type=Path, default=None, help="demo knowledge-base directory (default: rag's cache)")
    p.add_argument("--reader", type=Path, default=None, help="pre-trained generator directory (default: cached by configuration)")
    p.add_argument("--save-frozen", type=Path, default=None, help="save the trained RAG-Frozen model here")
    p.add_argument("--part", action="store_true", help=argparse.SUPPRESS)  # child process of --jobs
    args = p.parse_args(argv)
    if not 0 < args.minutes:
        p.error("--minutes must be positive")
    if args.jobs < 1:
        p.error("--jobs must be >= 1")
    unknown = sorted(set(args.systems.split(",")) - set(SYSTEMS))
    if unknown:
        p.error(f"unknown system(s) {unknown}; choose from {','.join(SYSTEMS)}")
    cfg = DemoConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(DemoConfig)})
    return cfg, args


# ----------------------------------------------------------------------------------------------- components


def build_model(kb, cfg: DemoConfig, system: str, reader: Optional[Path] = None) -> RagModel:
    """A RagModel whose generator is the pre-trained `reader` (every system starts from the same weights),
    or a fresh warm-started one (seeded) when None."""
    if reader is None:
        gen, tok = build_warm_start_generator("minilm", decoder_layers=cfg.decoder_layers, pointer=cfg.pointer, seed=cfg.seed)
    else:
        gen, tok = load_warm_start(reader)
    rag_cfg = RagModelConfig(
        n_docs=cfg.n_docs, marginalization="token" if system == "rag-token" else "sequence",
        freeze_query_encoder=system in ("rag-frozen", "closed-book", "reader"),
        max_context_length=cfg.max_context_length, max_target_length=24, max_question_length=32,
    )
    return RagModel(TextEncoder("minilm", role="question"), gen, tok, kb, rag_cfg)


def practice_pool(tokenizer, cfg: DemoConfig, size: int, seed: int) -> list:
    """A fixed pool of `size` reading-practice examples over the *training* elements' passages."""
    train_elements = {x["element"] for x in load_demo_qa("train")}
    passages = [p for p in load_demo_corpus() if p.title in train_elements]
    names = sorted(w.capitalize() for w in tokenizer.get_vocab() if w.isalpha() and len(w) > 4)
    return ReadingPractice(passages, names, seed=seed).examples(size)


def reader_dir(cfg: DemoConfig) -> Path:
    """Where the pre-trained generator of this configuration is cached (`$RAG_CACHE/demo_reader-<hash>`)."""
    import hashlib

    from rag.demo.kb import cache_dir

    keys = ("decoder_layers", "pretrain_lr", "warmup", "max_context_length", "pretrain_minutes", "pretrain_threads",
            "pretrain_batch", "pretrain_pool", "seed")
    record = {("generator_lr" if k == "pretrain_lr" else k): getattr(cfg, k) for k in keys}  # (key name of the first release)
    if cfg.pointer:
        record["pointer"] = True
    digest = hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:12]
    return cache_dir() / f"demo_reader-{digest}"


def held_out(split: str, limit: int = 0) -> list:
    """The demo's `split` questions (the first `limit` of them when `limit` > 0)."""
    examples = read_qa(f"demo:{split}")
    return examples[:limit] if limit > 0 else examples


def ensure_reader(kb, cfg: DemoConfig, path: Optional[Path] = None, eval_limit: int = 0) -> tuple[Path, dict]:
    """The shared pre-trained generator: a fresh warm-started generator trained only on reading practice
    (randomised facts in training passages, each with its passage) for ``pretrain_minutes`` CPU minutes.
    It is this demo's stand-in for BART's pre-training: it learns to read, and it knows no held-out fact.
    Cached at `path` (default :func:`reader_dir`); returns the directory and its training record."""
    from rag.generators.warm_start import save_generator
    from rag.utils.io import atomic_directory

    path = reader_dir(cfg) if path is None else Path(path)
    record_file = path / "pretraining.json"
    if record_file.is_file():
        return path, json.loads(record_file.read_text())
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.pretrain_threads)
    try:
        torch.manual_seed(cfg.seed)
        model = build_model(kb, cfg, "reader")
        pool = practice_pool(model.generator_tokenizer, cfg, cfg.pretrain_pool, cfg.seed + 11)
        logger.info("=== reader: pre-training on %d reading-practice examples, budget %.1f CPU-min on %d threads",
                    len(pool), cfg.pretrain_minutes, cfg.pretrain_threads)
        stats = train(model, "reader", [], pool, held_out("dev", eval_limit), cfg)
    finally:
        torch.set_num_threads(threads)
    record = {"train": dataclasses.asdict(stats), "pool": len(pool), "threads": cfg.pretrain_threads}
    with atomic_directory(path, overwrite=True, replaces=lambda p: (p / "config.json").is_file(),
                          kind="pre-trained reader") as tmp:
        save_generator(model.generator, model.generator_tokenizer, tmp)
        atomic_write_json(tmp / "pretraining.json", record)
    return path, record


# ----------------------------------------------------------------------------------------------- evaluation


class _GoldPassages(dict):
    """question -> the passage of the element it asks about (for the reader's oracle evaluation)."""

    def __missing__(self, question):
        if not self:
            by_title = {p.title: p for p in load_demo_corpus()}
            self.update({x["question"]: by_title[x["element"]] for s in ("train", "dev", "test") for x in load_demo_qa(s)})
            return self[question]
        raise KeyError(question)


_GOLD = _GoldPassages()


def _per_type(examples, preds) -> dict:
    types = {x["question"]: x["type"] for s in ("train", "dev", "test") for x in load_demo_qa(s)}
    em: dict[str, ExactMatch] = defaultdict(ExactMatch)
    for ex, p in zip(examples, preds):
        em[types.get(ex.question, "?")].update([p], [list(ex.answers)])
    return {t: round(float(m.compute()), 4) for t, m in sorted(em.items())}


def _generate_alone(model: RagModel, inputs: list[str], gcfg: GenerationConfig, max_length: int) -> list[str]:
    """Greedy answers of the generator on the given input strings (one context each, prior 1)."""
    enc = model.generator_tokenizer(inputs, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    ctx = encode_contexts(model.generator, enc["input_ids"], enc["attention_mask"])
    out = rag_token_generate(model.generator, ctx, torch.zeros(len(inputs), 1), gcfg)
    return [decode_answer(model.generator_tokenizer, row) for row in out.sequences.tolist()]


@torch.no_grad()
def evaluate(model: RagModel, system: str, examples, cfg: DemoConfig, bs: int = 34) -> dict:
    """Greedy answers to `examples`: EM, F1, per-question-type EM, and (RAG) recall@k."""
    was_training = model.training
    model.eval()
    em, f1, recall = ExactMatch(), TokenF1(), RetrievalRecall(RECALL_AT)
    preds, samples = [], []
    gcfg = GenerationConfig(num_beams=1, max_new_tokens=cfg.max_new_tokens)
    for i in range(0, len(examples), bs):
        chunk = examples[i:i + bs]
        qs, golds = [e.question for e in chunk], [list(e.answers) for e in chunk]
        if system in ("reader", "closed-book"):  # the generator alone: on the gold passage, or on the question
            gold = [_GOLD[q] for q in qs] if system == "reader" else None
            fmt = model.context_format
            inputs = qs if gold is None else [str(fmt.context(p.title, p.text, q)) for p, q in zip(gold, qs)]
            answers = _generate_alone(model, inputs, gcfg, cfg.max_context_length)
            tops = [None] * len(qs) if gold is None else [p.title for p in gold]
        else:
            answers, retrieved, _ = generate_answers(model, qs, num_beams=1, max_new_tokens=cfg.max_new_tokens,
                                                        sequence_decoding="fast")
            deep, _ = model.retrieve(qs, n_docs=max(RECALL_AT))
            recall.update(deep.passages, golds)
            tops = [ps[0].title for ps in retrieved.passages]
        em.update(answers, golds)
        f1.update(answers, golds)
        preds.extend(answers)
        samples.extend({"question": q, "predicted": a, "gold": g, "top_passage": t}
                       for q, a, g, t in zip(qs, answers, golds, tops))
    out = {"em": float(em.compute()), "f1": float(f1.compute()), "n": len(examples), "em_by_type": _per_type(examples, preds),
           "samples": samples[:10]}
    if system not in ("closed-book", "reader"):
        out.update({k: float(v) for k, v in recall.compute().items()})
    model.train(was_training)
    return out


# ----------------------------------------------------------------------------------------------- training


@dataclass
class TrainStats:
    steps: int = 0
    cpu_seconds: float = 0.0
    wall_seconds: float = 0.0
    losses: list = field(default_factory=list)
    """(step, mean loss since the previous entry)"""
    curve: list = field(default_factory=list)
    """(cpu minutes, step, dev EM, dev recall@n_docs or None)"""


def train(model: RagModel, system: str, pairs, pool, dev, cfg: DemoConfig) -> TrainStats:
    """AdamW on real QA (RAG loss, or closed-book loss) + reading practice until the CPU budget is spent
    (system "reader": reading practice only, the shared pre-training).

    Learning rates follow warm-up + linear decay over the budget; the query encoder's starts at
    ``query_encoder_start`` of it. The frozen generator encoder's outputs are memoised
    (:func:`cache_encoder_outputs`): each distinct context is encoded once per run, inside the budget.
    """
    if system == "reader":
        minutes, n_real, n_practice = cfg.pretrain_minutes, 0, cfg.pretrain_batch
    else:
        minutes, n_real, n_practice = cfg.minutes, cfg.real, cfg.practice
    budget = 60.0 * minutes
    groups = model.parameter_groups()
    generator_lr = cfg.pretrain_lr if system == "reader" else cfg.generator_lr
    params = [{"params": ps, "lr": 0.0, "name": name, "base": lr}
              for name, ps, lr in (("generator", groups["generator"], generator_lr),
                                   ("query_encoder", groups["query_encoder"], cfg.query_encoder_lr)) if ps]
    opt = torch.optim.AdamW(params, weight_decay=0.0, fused=True)  # fused: 4x faster steps on CPU than the for-loop default
    trainable = [p for g in params for p in g["params"]]
    rng = random.Random(cfg.seed)
    stats = TrainStats()
    order: list[int] = []
    window: list[float] = []
    excluded = 0.0  # CPU seconds spent on curve evaluations (outside the budget)
    t0, w0 = time.process_time(), time.monotonic()
    next_curve = 1
    model.train()
    with cache_encoder_outputs(model.generator):
        while True:
            progress = (time.process_time() - t0 - excluded) / budget
            if progress >= next_curve / cfg.curve_points or progress >= 1.0:
                e0 = time.process_time()
                ev = evaluate(model, system, dev, cfg)
                excluded += time.process_time() - e0
                point = (round(min(progress, 1.0) * minutes, 2), stats.steps, ev["em"], ev.get(f"recall@{cfg.n_docs}"))
                stats.curve.append(point)
                logger.info("%s  %.1f CPU-min  step %d  dev EM %.3f  recall@%d %s  e.g. %s", system, point[0], stats.steps,
                            ev["em"],
                            cfg.n_docs, point[3], [(s["question"], s["predicted"]) for s in ev["samples"][:2]])
                next_curve += 1
                if progress >= 1.0:
                    break
            for g in opt.param_groups:
                start = cfg.query_encoder_start if g["name"] == "query_encoder" else 0.0
                p = max(0.0, (progress - start) / (1.0 - start))
                g["lr"] = g["base"] * warmup_linear_decay(int(p * 10_000), int(cfg.warmup * 10_000),
                                                          10_000) if progress >= start else 0.0
            practice = rng.sample(pool, n_practice)
            loss = n_practice * model.generator_loss([e.question for e in practice], [e.answer for e in practice],
                                                     [e.passage for e in practice])
            if n_real:
                if len(order) < n_real:
                    order = list(range(len(pairs)))
                    rng.shuffle(order)
                batch, order = [pairs[i] for i in order[:n_real]], order[n_real:]
                qs, ans = [q for q, _ in batch], [a for _, a in batch]
                loss = loss + n_real * (model.generator_loss(qs, ans) if system == "closed-book" else model(qs, ans).loss)
            loss = loss / (n_real + n_practice)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            opt.step()
            stats.steps += 1
            window.append(float(loss.detach()))
            if stats.steps % 100 == 0:
                stats.losses.append((stats.steps, round(sum(window) / len(window), 4)))
                window = []
    stats.cpu_seconds = time.process_time() - t0 - excluded
    stats.wall_seconds = time.monotonic() - w0
    model.eval()
    return stats


def run_system(system: str, cfg: DemoConfig, args, reader: Path) -> dict:
    """Fine-tune and evaluate one system, starting from the pre-trained `reader`; returns its results entry."""
    kb = ensure_demo_kb(args.kb, show_progress=False)
    torch.manual_seed(cfg.seed)
    model = build_model(kb, cfg, system, reader)
    pairs = expand_answers(read_qa("demo:train"))
    pool = practice_pool(model.generator_tokenizer, cfg, cfg.practice_pool, cfg.seed + 1)
    dev = held_out("dev", args.eval_limit)
    logger.info("=== %s: %d training pairs, %d practice examples, budget %.1f CPU-min", system, len(pairs), len(pool),
                cfg.minutes)
    stats = train(model, system, pairs, pool, dev, cfg)
    t = time.process_time()
    ev = {s: evaluate(model, system, held_out(s, args.eval_limit), cfg) for s in args.eval_splits.split(",") if s}
    for s, e in ev.items():
        logger.info("%s %s: EM %.3f F1 %.3f %s", system, s, e["em"], e["f1"],
                    " ".join(f"R@{k} {e[f'recall@{k}']:.3f}" for k in RECALL_AT if f"recall@{k}" in e))
    if system == "rag-frozen" and args.save_frozen is not None:
        model.save_pretrained(args.save_frozen, reference_query_encoder=True)
        logger.info("saved %s", args.save_frozen)
    return {"train": dataclasses.asdict(stats), "eval_cpu_seconds": time.process_time() - t, "eval": ev,
            "trainable_parameters": sum(p.numel() for ps in model.parameter_groups().values() for p in ps)}


# ----------------------------------------------------------------------------------------------- report


def markdown_table(results: dict, splits: Sequence[str]) -> str:
    ks = [k for k in RECALL_AT]
    head = "| system | CPU-min | steps | " + " | ".join(
        f"{s} EM | {s} F1 | " + " | ".join(f"{s} R@{k}" for k in ks) for s in splits) + " |"
    rows = [head, "|" + "---|" * (3 + (2 + len(ks)) * len(splits))]
    for name, r in results["systems"].items():
        cells = [LABELS[name], f"{r['train']['cpu_seconds'] / 60:.1f}", str(r["train"]["steps"])]
        for s in splits:
            e = r["eval"][s]
            cells += [f"{100 * e['em']:.1f}", f"{100 * e['f1']:.1f}"]
            cells += [f"{100 * e[f'recall@{k}']:.1f}" if f"recall@{k}" in e else "–" for k in ks]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def plot(results: dict, path: Path, split: str) -> None:
    """Left: dev EM against CPU minutes (learning curves). Right: final held-out EM, F1 and recall."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["systems"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [1, 1.4]})
    for n in names:
        curve = results["systems"][n]["train"]["curve"]
        left.plot([c[0] for c in curve], [100 * c[2] for c in curve], marker="o", label=LABELS[n])
    left.set_xlabel("fine-tuning CPU minutes (all start from the same pre-trained reader)")
    left.set_ylabel("dev EM (%)")
    left.set_ylim(bottom=0)
    left.set_title("held-out dev EM while fine-tuning", fontsize=9)
    left.legend(fontsize=8)
    left.grid(alpha=0.3)
    n_docs = results["config"]["n_docs"]
    metrics = [("em", "EM"), ("f1", "F1"), ("recall@1", "recall@1"), (f"recall@{n_docs}", f"recall@{n_docs}")]
    width = 0.8 / len(names)
    for i, n in enumerate(names):
        e = results["systems"][n]["eval"][split]
        vals = [100 * e.get(m, float("nan")) for m, _ in metrics]
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(metrics))]
        bars = right.bar(xs, [0 if math.isnan(v) else v for v in vals], width, label=LABELS[n])
        for b, v in zip(bars, vals):
            right.text(b.get_x() + b.get_width() / 2, (0 if math.isnan(v) else v) + 1, "–" if math.isnan(v) else f"{v:.0f}",
                       ha="center", va="bottom", fontsize=7)
    right.set_xticks(range(len(metrics)), [m for _, m in metrics])
    right.set_ylim(0, 105)
    right.set_title(f"held-out {split} split ({results['systems'][names[0]]['eval'][split]['n']} questions), "
                    f"{results['config']['pretrain_minutes']:g} (shared) + {results['config']['minutes']:g} CPU-min per system",
                    fontsize=9)
    right.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------- main


def _child_command(system: str, argv: Sequence[str], part_dir: Path) -> list[str]:
    rest, skip = [], False
    for a in argv:  # drop the parent's --systems/--out/--jobs
        if skip:
            skip = False
            continue
        if a in ("--systems", "--out", "--jobs"):
            skip = True
            continue
        if a.startswith(("--systems=", "--out=", "--jobs=")):
            continue
        rest.append(a)
    return [sys.executable, __file__, *rest, "--systems", system, "--out", str(part_dir / system), "--part"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
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
    t_all = time.monotonic()
    kb = ensure_demo_kb(args.kb, show_progress=False)  # built once, before any child starts
    reader, pretraining = ensure_reader(kb, cfg, args.reader, args.eval_limit)  # pre-trained once, before any child starts

    results: dict = {
        "config": dataclasses.asdict(cfg),
        "command": "python examples/elements_recipe.py " + " ".join(argv),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "threads": cfg.threads, "jobs": args.jobs, "load_average_start": list(os.getloadavg())},
        "knowledge_base": {"path": str(kb.path), "version": kb.version, "passages": len(kb)},
        "reader": {"path": str(reader), **pretraining},
        "systems": {},
    }
    if args.jobs > 1 and len(systems) > 1 and not args.part:
        parts = args.out / "parts"
        pending, running = list(systems), []
        while pending or running:
            while pending and len(running) < args.jobs:
                s = pending.pop(0)
                running.append((s, subprocess.Popen(_child_command(s, argv, parts))))
            time.sleep(2)
            for s, proc in list(running):
                if proc.poll() is not None:
                    running.remove((s, proc))
                    if proc.returncode != 0:
                        logger.error("%s failed (exit %d)", s, proc.returncode)
        for s in systems:
            part = parts / s / "results.json"
            if part.is_file():
                results["systems"][s] = json.loads(part.read_text())["systems"][s]
    else:
        for s in systems:
            results["systems"][s] = run_system(s, cfg, args, reader)
            atomic_write_json(args.out / "results.json", results)

    results["wall_seconds"] = time.monotonic() - t_all
    results["machine"]["load_average_end"] = list(os.getloadavg())
    atomic_write_json(args.out / "results.json", results)
    if args.part or not results["systems"]:
        return 0 if results["systems"] else 1
    table = markdown_table(results, splits)
    atomic_write_text(args.out / "results.md", table + "\n")
    plot(results, args.out / "elements_recipe.png", "test" if "test" in splits else splits[0])
    print(table)
    print(f"\nwall time {results['wall_seconds'] / 60:.1f} min; results in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
