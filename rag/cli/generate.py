"""`rag generate`: answer questions with a RAG model, or continue prompts with a causal LM (In-Context RALM), with provenance."""

from __future__ import annotations

import sys
import textwrap

from rag.cli.index import check_positive, read_queries
from rag.cli.options import add_generation_options, generation_options
from rag.generators.load import is_causal_lm_checkpoint
from rag.knowledge.rerank_options import check_stage_options
from rag.pipeline.api import load, plot_token_posterior
from rag.pipeline.windows import end_of_run_line, held_window_lines
from rag.retrobust.backoff import resolve_nli
from rag.retrobust.nli import validate_threshold
from rag.utils.errors import ConfigError, OutputExistsError
from rag.utils.io import to_json
from rag.utils.truncation import counting_cut_prompts


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="answer questions (arguments, --file, or one per line on stdin) with a RAG model, "
                                        "or continue prompts with a causal LM (In-Context RALM)",
                       description="Answer questions with a RAG model (default: the bundled demo), or continue prompts with a "
                                   "causal LM (a directory, or 'smollm2') over --kb, re-retrieving every --stride tokens.")
    p.add_argument("queries", nargs="*", metavar="questions", help="questions; none = read --file or stdin")
    p.add_argument("--model", default="demo", help="checkpoint directory, transformers RAG directory, 'demo' (default), "
                                                     "or a causal LM directory / 'smollm2' (In-Context RALM; needs --kb)")
    p.add_argument("--kb", default=None, help="knowledge-base directory (default: the one the checkpoint references)")
    p.add_argument("--file", default=None, help="read questions from this file, one per line")
    p.add_argument("--no-retrieval", action="store_true",
                   help="retrieve nothing: the generator answers the bare questions (the closed-book baseline; no passages)")
    p.add_argument("--max-length", type=int, default=None, help="causal LM: its window in tokens (default: min(positions, 1024))")
    p.add_argument("--doc-max-length", type=int, default=None,
                   help="causal LM: retrieved documents are cut to this many tokens (default 256)")
    add_generation_options(p)
    p.add_argument("--show-passages", type=int, default=3, help="passages to print per answer (human-readable output)")
    p.add_argument("--json", action="store_true", help="one JSON object per answer, with full provenance")
    p.add_argument("--heatmap-dir", default=None, help="write each RAG-Token answer's per-token document posterior as a PNG here "
                                                             "(answer_NNNN.png, numbered past the files already there: "
                                                             "none is replaced)")
    p.add_argument("--batch-size", type=int, default=8)
    add_rerank_options(p)
    p.add_argument("--nli", nargs="?", const=True, default=None, metavar="MODEL",
                   help="RetRobust back-off (Yoran et al. 2024, §2.1): also generate without retrieval and keep the retrieval "
                        "answer only if this NLI model says its evidence entails it; no MODEL = the default model "
                        "($RAG_CACHE/nli/minilm-snli, built by `rag nli prepare`); put --nli after the questions, or name the "
                        "default model: --nli minilm-snli")
    p.add_argument("--nli-threshold", type=float, default=0.5, help="entailment probability the back-off needs (default 0.5)")
    p.set_defaults(func=cmd_generate, trailing_positional="queries")  # questions may also follow the options


def add_rerank_options(p) -> None:
    """``--rerank K --reranker DIR``: the rerank stage of `rag generate`, `rag serve` and `rag evaluate`."""
    p.add_argument("--rerank", type=int, default=None, metavar="K",
                   help="retrieve K candidates, rescore them with --reranker and read the best (K >= the passages read)")
    p.add_argument("--reranker", default=None, metavar="DIR",
                   help="the cross-encoder of --rerank: a sequence-classification model directory, or one "
                        "`rag fit --config lightning_configs/reranker_demo.yaml` wrote")


def rerank_options(args) -> dict:
    """``rerank=`` / ``reranker=`` for :func:`rag.load`, only those given; a missing partner is refused now."""
    check_stage_options(args.rerank, args.reranker)
    return {k: v for k, v in (("rerank", args.rerank), ("reranker", args.reranker)) if v is not None}


def print_answer(a, *, as_json: bool = False, show_passages: int = 3, heatmap=None) -> None:
    """One answer: a JSON line with full provenance (``citations`` and ``cited_text`` included), or the answer with its
    ``[n]`` citation markers, its score and knowledge-base version, and its best passages by posterior (prior when
    there is none), each cited one prefixed with its marker."""
    if as_json:
        print(to_json(a.to_dict()))
        return
    cites = a.citations
    marker = {c.passage: f"[{c.number}]" for c in cites}
    print(f"\nQ: {a.question}\nA: {a.cited_text}    (log p = {a.score:.3f}, knowledge base {a.kb_version})")
    if a.answered_with is not None and a.nli_entailment is not None:
        p_ent = ", ".join(f"{s.get('entailment', float('nan')):.3f}" for s in a.nli_entailment)
        print(f"   answered with {a.answered_with} (NLI P(entailment) of the retrieval answer: {p_ent})")
    elif a.answered_with == "no_retrieval":
        print("   answered without retrieval (--no-retrieval): no passage was read")
    if a.segments:  # In-Context RALM: the document in context for each stride of generated tokens
        number = {(a.passages[c.passage].id, a.passages[c.passage].title): c.number for c in cites}
        for s in a.segments:
            n = number.get((s.passage_id, s.title))
            print(f"{'' if n is None else f'[{n}]':>5} tokens {s.start:>3}-{s.end:<3} score {s.score:8.3f}  {s.title} "
                  f"[{s.passage_id}]")
        return
    ranked = sorted(range(len(a.passages)), key=lambda i: -(a.passages[i].posterior if a.passages[i].posterior is not None
                                                            else a.passages[i].prior))
    for i in ranked[:show_passages]:
        p = a.passages[i]
        post = f"{p.posterior:.3f}" if p.posterior is not None else "  -  "
        print(f"{marker.get(i, ''):>5} posterior {post}  prior {p.prior:.3f}  {p.title} [{p.id}]")
        body = p.text if len(p.text) <= 160 else p.text[:157] + "..."
        print(textwrap.fill(body, width=100, initial_indent=" " * 6, subsequent_indent=" " * 6))
    if heatmap:
        print(f"   heatmap: {heatmap}")


def _new_heatmap(answer, directory, first: int = 1):
    """Draw `answer`'s heatmap as ``answer_NNNN.png`` in `directory` under the first number from `first` on that no file
    holds yet: a file there (a heatmap of an earlier run, or anything else) is never replaced. Returns (path, number)."""
    n = first
    while True:
        path = directory / f"answer_{n:04d}.png"
        if not (path.exists() or path.is_symlink()):
            try:
                return plot_token_posterior(answer, path), n
            except OutputExistsError:  # appeared meanwhile (another run writing there): take the next number
                pass
        n += 1


def cmd_generate(args) -> int:
    from pathlib import Path

    check_positive(args, "batch_size", "doc_max_length", "max_length")
    stage = rerank_options(args)
    if args.show_passages < 0:
        raise ConfigError(f"--show-passages {args.show_passages}: must be 0 (print no passage) or more")
    options = generation_options(args).set_options()  # only what was given: the rest is the model's stored setting
    if args.heatmap_dir and Path(args.heatmap_dir).exists() and not Path(args.heatmap_dir).is_dir():
        raise ConfigError(f"--heatmap-dir {args.heatmap_dir}: is a file; give a directory (created if missing) for the PNGs")
    queries = read_queries(args)  # checked before the model is loaded
    nli = None
    if args.nli is not None:
        validate_threshold(args.nli_threshold, "--nli-threshold")
        nli = resolve_nli(args.nli)
    settings = {k: v for k, v in (("max_length", args.max_length), ("doc_max_length", args.doc_max_length)) if v is not None}
    if settings:
        if not is_causal_lm_checkpoint(args.model):
            raise ConfigError(f"--max-length / --doc-max-length set the window of a causal LM (In-Context RALM); "
                              f"--model {args.model} "
                              "is not one: drop them, or pass a causal LM directory or 'smollm2'")
    with held_window_lines() as window_lines:  # said once, in the end-of-run line
        pipe = load(args.model, knowledge_base=args.kb, **settings, **stage)
    number = [0]  # the last heatmap's number

    def run(batch: list[str]) -> None:
        extra = {"retrieval": False} if args.no_retrieval else {}
        answers = pipe.generate(batch, nli=nli, nli_threshold=args.nli_threshold, **{**options, **extra})
        for a in answers:
            heatmap = None
            if args.heatmap_dir and a.token_doc_posterior:
                heatmap, number[0] = _new_heatmap(a, Path(args.heatmap_dir), number[0] + 1)
            print_answer(a, as_json=args.json, show_passages=args.show_passages, heatmap=heatmap)
        sys.stdout.flush()

    batch: list[str] = []
    with counting_cut_prompts() as cut:  # reported once, after the answers, instead of a warning per batch
        for q in queries:
            batch.append(q)
            if len(batch) == args.batch_size:
                run(batch)
                batch = []
        if batch:
            run(batch)
    line = end_of_run_line(cut.summary(), window_lines)
    if line:
        print(f"rag generate: {line}", file=sys.stderr)
    return 0
