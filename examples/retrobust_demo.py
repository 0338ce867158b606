"""RetRobust demonstration (Yoran et al. 2024): irrelevant retrieved contexts hurt a reader; an NLI back-off and
training on mixed contexts make it robust; Self-Ask with retrieval answers two-hop questions.

Reader: the warm-start seq2seq generator of the bundled demo RAG model (``checkpoints/demo/generator``: frozen
MiniLM encoder, 2-layer decoder, copy head; it reads a passage and copies the answer). Three readers are fine-tuned
from it for ``--minutes`` CPU-minutes each on the demo training questions (``demo:train``), through the package's
:class:`~rag.training.data.QADataModule`:

* **closed-book**: the question alone (the paper's NoRet model; it can learn the training facts, never the held-out);
* **top-1**: ``context_mixing`` with ``p_top1=1`` (a plain retrieval-augmented reader);
* **RetRobust**: ``context_mixing`` with the paper's mix (1/3 top-1, 1/3 low-ranked = ranks 5–9 of the top 10,
  1/3 random = another question's top-1, §2.2).

The top-1 and RetRobust readers also learn to write Self-Ask steps (``Follow up:`` / ``So the final answer is:``)
from the training two-hop questions (``rag/demo/elements_multihop.jsonl``).

Evaluation, two kinds of question: **known** (``--n-known`` training questions: facts the readers were trained on)
and **KB-only** (``--n-kb`` test questions about held-out elements: the answer is only in the knowledge base). For
each of top-1, low-ranked (rank 5–9) and random (another question's top-1) retrieved contexts, EM of: no retrieval
(closed-book); retrieval as is (top-1 reader); retrieval + NLI back-off (§2.1: keep the top-1 reader's answer when
the NLI model gives P(entailment | passage, question + answer) >= ``--threshold``, else the closed-book answer);
the RetRobust reader. Then Self-Ask on the two-hop test questions (``--n-multihop``): follow-ups answered with
retrieval (top-1 passage, RetRobust reader) or without (closed-book reader), and with the NLI filter over every step.

NLI model: the MiniLM SNLI cross-encoder ``rag nli prepare`` builds (``$RAG_CACHE/nli/minilm-snli``), called directly
through :class:`~rag.retrobust.nli.NLIScorer` in :func:`nli_backoff`.

    OMP_NUM_THREADS=1 python examples/retrobust_demo.py --minutes 4     # ~15 CPU-minutes on 1 thread

writes ``--out`` (``runs/retrobust_demo``: the trained readers) and ``--results``
(``benchmarks/results/retrobust_demo.json``). A trained reader found in ``--out`` is reused.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "examples"):
    if str(p) not in sys.path:  # run from a checkout without installing; elements_recipe is a sibling
        sys.path.insert(0, str(p))

from elements_recipe import DemoConfig, _generate_alone, build_model  # noqa: E402

from rag.demo.kb import ensure_demo_kb  # noqa: E402
from rag.demo.multihop import load_multihop  # noqa: E402
from rag.eval.metrics import ExactMatch  # noqa: E402
from rag.eval.qa_data import read_qa  # noqa: E402
from rag.generation.decoding import GenerationConfig  # noqa: E402
from rag.generators.warm_start import cache_encoder_outputs, save_generator  # noqa: E402
from rag.retrobust.nli import NLIScorer, nli_premise  # noqa: E402
from rag.retrobust.selfask import chain_training_examples, self_ask, step_hypotheses  # noqa: E402
from rag.training.context_mixing import ContextMixing, retrieve_rows, sample_context_choices  # noqa: E402
from rag.training.data import QADataModule  # noqa: E402
from rag.training.schedules import warmup_linear_decay  # noqa: E402
from rag.utils.io import atomic_directory, atomic_write_json  # noqa: E402

logger = logging.getLogger("retrobust_demo")
READERS = ("closed-book", "top-1", "retrobust")
MIXES = {"top-1": (1.0, 0.0, 0.0), "retrobust": (1 / 3, 1 / 3, 1 / 3)}
CONDITIONS = {"top-1": (1.0, 0.0, 0.0), "low-ranked": (0.0, 1.0, 0.0), "random": (0.0, 0.0, 1.0)}
TOP_K = 10


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--minutes", type=float, default=4.0, help="CPU-minutes of fine-tuning per reader")
    p.add_argument("--lr", type=float, default=5e-4, help="peak learning rate (warm-up 5%%, linear decay)")
    p.add_argument("--batch", type=int, default=8, help="QA pairs per step")
    p.add_argument("--selfask-batch", type=int, default=4, help="Self-Ask step-writing examples per step (top-1, RetRobust)")
    p.add_argument("--n-known", type=int, default=100, help="known (training) questions evaluated")
    p.add_argument("--n-kb", type=int, default=100, help="KB-only (test) questions evaluated")
    p.add_argument("--n-multihop", type=int, default=40, help="two-hop test questions for Self-Ask")
    p.add_argument("--threshold", type=float, default=0.5, help="NLI entailment threshold (paper: 0.5)")
    p.add_argument("--max-steps", type=int, default=4, help="Self-Ask step limit")
    p.add_argument("--nli", default=None, help="NLI model directory (default: $RAG_CACHE/nli/minilm-snli)")
    p.add_argument("--reader", type=Path, default=REPO / "checkpoints" / "demo" / "generator", help="starting generator")
    p.add_argument("--readers", default=",".join(READERS), help="train (or load) only these readers, then stop unless all exist")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("runs/retrobust_demo"))
    p.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results" / "retrobust_demo.json")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------- training


def train_reader(name: str, kb, args) -> tuple[object, dict]:
    """Fine-tune one reader for ``args.minutes`` CPU-minutes (AdamW, warm-up + linear decay); returns (model, record)."""
    cfg = DemoConfig(n_docs=1, seed=args.seed)
    torch.manual_seed(args.seed)
    model = build_model(kb, cfg, "reader", args.reader)
    mixing = None
    if name in MIXES:
        p1, pl, pr = MIXES[name]
        mixing = ContextMixing(knowledge_base=str(kb.path), top_k=TOP_K, p_top1=p1, p_low=pl, p_random=pr, seed=args.seed)
    data = QADataModule(train="demo:train", batch_size=args.batch, context_mixing=mixing)
    data.setup("fit")
    chains = chain_training_examples(load_multihop("train")) if name != "closed-book" else []
    rng = random.Random(args.seed)
    params = [p for p in model.parameter_groups()["generator"]]
    opt = torch.optim.AdamW(params, lr=0.0, weight_decay=0.0, fused=True)
    budget, steps, losses = 60.0 * args.minutes, 0, []
    model.train()
    t0 = time.process_time()
    with cache_encoder_outputs(model.generator):
        while (progress := (time.process_time() - t0) / budget) < 1.0:
            for batch in data.train_dataloader():
                progress = (time.process_time() - t0) / budget
                if progress >= 1.0:
                    break
                for g in opt.param_groups:
                    g["lr"] = args.lr * warmup_linear_decay(int(progress * 10_000), 500, 10_000)
                loss = model.generator_loss(batch["questions"], batch["targets"], batch.get("contexts"))
                if chains:
                    sample = rng.sample(chains, args.selfask_batch)
                    w = args.selfask_batch / (args.selfask_batch + len(batch["questions"]))
                    loss = (1 - w) * loss + w * model.generator_loss([c for c, _ in sample], [t for _, t in sample])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                steps += 1
                losses.append(float(loss.detach()))
    model.eval()
    kinds = data.train_pairs.context_kinds
    record = {"steps": steps, "cpu_seconds": round(time.process_time() - t0, 1),
              "final_loss": round(sum(losses[-50:]) / max(1, len(losses[-50:])), 4),
              "train_pairs": len(data.train_pairs), "selfask_examples": len(chains),
              "context_kinds": None if kinds is None else {k: kinds.count(k) for k in ("top1", "low", "random")}}
    logger.info("%s: %s", name, record)
    return model, record


def ensure_reader(name: str, kb, args) -> tuple[object, dict]:
    """The trained reader `name` from ``--out`` (trained and saved first if absent)."""
    path = args.out / name
    if (path / "training.json").is_file():
        cfg = DemoConfig(n_docs=1, seed=args.seed)
        model = build_model(kb, cfg, "reader", path)
        model.eval()
        return model, json.loads((path / "training.json").read_text())
    model, record = train_reader(name, kb, args)
    with atomic_directory(path, overwrite=True, replaces=lambda p: (p / "config.json").is_file(), kind="trained reader") as tmp:
        save_generator(model.generator, model.generator_tokenizer, tmp)
        atomic_write_json(tmp / "training.json", record)
    return model, record


# ----------------------------------------------------------------------------------------------- evaluation


def nli_backoff(scorer: NLIScorer, passages, questions: Sequence[str], retrieval_answers: Sequence[str],
                fallback_answers: Sequence[str], threshold: float) -> tuple[list[str], list[float]]:
    """§2.1: keep each retrieval answer when P(entailment | passage, "question answer") >= `threshold`, else the
    no-retrieval answer. Returns (answers, entailment probabilities). (The online back-off module of ``rag.load(...)
    .generate(nli=...)`` does the same for a pipeline; this demo calls the scorer directly.)"""
    probs = scorer.entailment_probs([nli_premise(p.title, p.text) for p in passages],
                                    [f"{q} {a}" for q, a in zip(questions, retrieval_answers)]).tolist()
    return [r if p >= threshold else f for r, f, p in zip(retrieval_answers, fallback_answers, probs)], probs


def read(model, questions: Sequence[str], passages=None, bs: int = 50, raw: bool = False) -> list[str]:
    """Greedy answers of a reader: on the question alone, or on one passage per question. A decoder-only reader
    (:class:`~rag.training.causal_reader.CausalReaderModule`) formats the questions with its prompt unless `raw`."""
    if hasattr(model, "answer"):
        return [a for i in range(0, len(questions), bs)
                for a in model.answer(list(questions[i:i + bs]), None if passages is None else passages[i:i + bs],
                                      raw_prompts=raw)]
    fmt, gcfg, out = model.context_format, GenerationConfig(num_beams=1, max_new_tokens=16), []
    for i in range(0, len(questions), bs):
        qs = list(questions[i:i + bs])
        inputs = ([fmt.prefix + q for q in qs] if passages is None else
                  [str(fmt.context(p.title, p.text, q)) for p, q in zip(passages[i:i + bs], qs)])
        out.extend(_generate_alone(model, inputs, gcfg, 160))
    return out


def em(preds: Sequence[str], golds: Sequence[Sequence[str]]) -> float:
    m = ExactMatch()
    m.update(list(preds), [list(g) for g in golds])
    return round(100 * float(m.compute()), 1)


def evaluate_contexts(readers: dict, kb, scorer: NLIScorer, args) -> dict:
    """EM table of known and KB-only questions under top-1 / low-ranked / random contexts."""
    rng = random.Random(args.seed)
    known = rng.sample(read_qa("demo:train"), args.n_known)
    kb_only = read_qa("demo:test")[: args.n_kb]
    groups = {"known": known, "kb-only": kb_only}
    questions = [e.question for e in known + kb_only]
    rows = retrieve_rows(kb, questions, TOP_K)
    closed = read(readers["closed-book"], questions)
    out: dict = {}
    for cond, (p1, pl, pr) in CONDITIONS.items():
        choices = sample_context_choices(rows, ContextMixing(top_k=TOP_K, p_top1=p1, p_low=pl, p_random=pr, seed=args.seed + 1))
        passages = kb.get_passages([[c.row for c in choices]])[0]
        plain = read(readers["top-1"], questions, passages)
        robust = read(readers["retrobust"], questions, passages)
        backoff, probs = nli_backoff(scorer, passages, questions, plain, closed, args.threshold)
        robust_backoff, _ = nli_backoff(scorer, passages, questions, robust, closed, args.threshold)
        start = 0
        for group, examples in groups.items():
            sl = slice(start, start + len(examples))
            start += len(examples)
            golds = [e.answers for e in examples]
            has_answer = [any(a.lower() in (p.title + " " + p.text).lower() for a in g) for p, g in zip(passages[sl], golds)]
            out.setdefault(group, {})[cond] = {
                "no_retrieval": em(closed[sl], golds), "retrieval": em(plain[sl], golds), "retrieval+nli": em(backoff[sl], golds),
                "retrobust": em(robust[sl], golds), "retrobust+nli": em(robust_backoff[sl], golds),
                "nli_kept_retrieval": round(100 * sum(p >= args.threshold for p in probs[sl]) / len(examples), 1),
                "context_has_answer": round(100 * sum(has_answer) / len(examples), 1), "n": len(examples),
                "samples": [{"question": q, "gold": list(g), "context": p.title, "no_retrieval": c, "retrieval": a,
                             "nli": round(pr_, 3),
                             "retrobust": r} for q, g, p, c, a, pr_, r in
                            list(zip(questions[sl], golds, passages[sl], closed[sl], plain[sl], probs[sl], robust[sl]))[:4]],
            }
        logger.info("%s: %s", cond, {g: {k: v for k, v in out[g][cond].items() if k != "samples"} for g in groups})
    return out


def evaluate_selfask(readers: dict, kb, scorer: NLIScorer, args) -> dict:
    """Self-Ask on two-hop test questions: the RetRobust reader writes the follow-ups; each is answered with retrieval
    (top-1 passage, RetRobust reader) or without (closed-book reader); with retrieval + NLI, a chain whose steps are not
    all entailed falls back to the no-retrieval chain's answer."""
    from rag.knowledge.retriever import DenseRetriever, default_query_encoder

    writer = readers["retrobust"]
    retriever = DenseRetriever(kb, default_query_encoder(kb))
    records = load_multihop("test")[: args.n_multihop]

    def write(prompt: str) -> str:
        if hasattr(writer, "answer"):  # a decoder-only reader continues the chain text itself
            return read(writer, [prompt.rstrip("\n")], raw=True)[0]
        return read(writer, [prompt.removeprefix(writer.context_format.prefix)])[0]

    def with_retrieval(follow_up: str):
        p = retriever.retrieve([follow_up], 1).passages[0][0]
        return read(readers["retrobust"], [follow_up], [p])[0], nli_premise(p.title, p.text)

    def without_retrieval(follow_up: str):
        return read(readers["closed-book"], [follow_up])[0], None

    results = {"with_retrieval": [], "without_retrieval": []}
    for r in records:
        results["with_retrieval"].append(self_ask(r["question"], write, with_retrieval, max_steps=args.max_steps))
        results["without_retrieval"].append(self_ask(r["question"], write, without_retrieval, max_steps=args.max_steps))
    golds = [r["answers"] for r in records]
    entailed = []
    for res in results["with_retrieval"]:
        pairs = step_hypotheses(res)
        probs = scorer.entailment_probs([p for p, _ in pairs], [h for _, h in pairs]).tolist() if pairs else []
        entailed.append(bool(pairs) and all(p >= args.threshold for p in probs))
    nli_answers = [a.answer if ok else b.answer
                   for a, b, ok in zip(results["with_retrieval"], results["without_retrieval"], entailed)]
    gold_steps = [[f["question"] for f in r["follow_ups"]] for r in records]
    out = {"n": len(records), "with_retrieval+nli": {"em": em([a or "" for a in nli_answers], golds),
                                                     "chains_all_steps_entailed": round(100 * sum(entailed) / len(records), 1)}}
    for mode, res in results.items():
        stops: dict = {}
        for x in res:
            stops[x.stopped] = stops.get(x.stopped, 0) + 1
        out[mode] = {"em": em([x.answer or "" for x in res], golds), "stopped": stops,
                     "follow_ups_as_gold": round(100 * sum([s.question.lower() for s in x.steps] == [g.lower() for g in gs]
                                                           for x, gs in zip(res, gold_steps)) / len(records), 1),
                     "samples": [x.provenance() for x in res[:3]]}
    logger.info("self-ask: %s", {k: (v if not isinstance(v, dict) else {kk: vv for kk, vv in v.items() if kk != "samples"})
                                 for k, v in out.items()})
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    for noisy in ("transformers", "httpx", "rag.generation.contexts"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    torch.set_num_threads(1)
    kb = ensure_demo_kb(show_progress=False)
    wanted = [r for r in READERS if r in args.readers.split(",")]
    readers, training = {}, {}
    for name in wanted:
        readers[name], training[name] = ensure_reader(name, kb, args)
    if len(readers) < len(READERS):
        logger.info("trained %s; run again with all readers to evaluate", wanted)
        return 0
    evaluate_and_write("examples/retrobust_demo.py", readers, training, kb, args, argv)
    return 0


def evaluate_and_write(script: str, readers: dict, training: dict, kb, args, argv: Optional[Sequence[str]]) -> None:
    """The demonstration's tables (every context condition, then Self-Ask) for trained `readers`, written to
    ``args.results`` with the command, the settings, the NLI model and each reader's training record."""
    t0, w0 = time.process_time(), time.monotonic()
    scorer = NLIScorer.from_pretrained(args.nli)
    results = {"command": f"python {script} " + " ".join(sys.argv[1:] if argv is None else argv),
               "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
               "nli_model": scorer.name, "readers": training}
    with torch.no_grad():
        results["contexts"] = evaluate_contexts(readers, kb, scorer, args)
        results["selfask"] = evaluate_selfask(readers, kb, scorer, args)
    results["eval_cpu_seconds"] = round(time.process_time() - t0, 1)
    results["eval_wall_seconds"] = round(time.monotonic() - w0, 1)
    atomic_write_json(args.results, results)
    logger.info("wrote %s", args.results)


if __name__ == "__main__":
    raise SystemExit(main())
