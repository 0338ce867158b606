"""`rag evaluate`: a model or a retriever alone over an evaluation set, into a results directory; or two such
directories compared (``--compare RUN_A RUN_B``)."""

from __future__ import annotations

import sys

from rag.cli.generate import add_rerank_options, rerank_options
from rag.cli.index import check_positive
from rag.cli.options import add_generation_options, generation_options
from rag.eval.benchmarks import FORMATS
from rag.eval.compare import compare_runs, format_comparison
from rag.eval.faithfulness import DEFAULT_THRESHOLD, LABELS_PATH, FaithfulnessJudge, calibrate, format_calibration, read_labels
from rag.eval.runner import evaluate, markdown
from rag.utils.errors import ConfigError
from rag.utils.io import to_json


def add_parser(sub) -> None:
    p = sub.add_parser(
        "evaluate", help="score a model (or a knowledge base's retriever alone) on an evaluation set; --compare two runs",
        description="Runs --model (or, without it, the retriever of --kb alone) over --data and writes --out: records.jsonl "
                    "(one line per question), summary.json, results.md and plots/. A killed run resumes when the same "
                    "command is run again. --compare RUN_A RUN_B prints paired bootstrap intervals of B - A instead.")
    p.add_argument("--model", default=None, help="anything `rag generate --model` takes ('demo', a model directory, "
                                                  "'smollm2' with --kb); omitted: evaluate the retriever of --kb alone")
    p.add_argument("--kb", default=None, help="knowledge-base directory (default: the model's)")
    p.add_argument("--data", default=None, help="evaluation set: KILT .jsonl, DPR .json / .qa.csv, HotpotQA .json, a BEIR "
                                                "directory (DIR#SPLIT), the project's JSONL, or demo:SPLIT")
    p.add_argument("--format", default="auto", choices=FORMATS, help="format of --data (default: told from its files)")
    p.add_argument("--out", default=None, help="results directory (created; resumed when it holds an unfinished run)")
    p.add_argument("--k", default="1,5,10,20", help="retrieval cut-offs, comma-separated (default 1,5,10,20)")
    p.add_argument("--limit", type=int, default=None, help="only the first N questions")
    p.add_argument("--seed", type=int, default=0, help="seed of torch / numpy / random before each batch (default 0)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--verify", default="full", choices=["full", "size"], help="checksums checked when opening --kb alone")
    p.add_argument("--device", default=None)
    add_rerank_options(p)
    add_generation_options(p, skip=("seed",))  # --seed is the run's (below)
    p.add_argument("--compare", nargs=2, default=None, metavar=("RUN_A", "RUN_B"),
                   help="compare two results directories (B - A) instead of evaluating")
    p.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples of --compare (default 2000)")
    p.add_argument("--faithfulness", default=None, metavar="NLI_DIR",
                   help="judge each answer with this NLI model (a directory, or 'minilm-snli': `rag nli prepare`'s): adds "
                        "supported_top / supported_cited / supported_any (by the top-posterior, a cited, any passage read)")
    p.add_argument("--faithfulness-threshold", type=float, default=DEFAULT_THRESHOLD,
                   help=f"P(entailment) at which a passage supports an answer (default {DEFAULT_THRESHOLD})")
    p.add_argument("--calibrate", nargs="?", const=str(LABELS_PATH), default=None, metavar="LABELS",
                   help="with --faithfulness: print the judge's agreement (accuracy, Cohen's kappa) with hand labels "
                        "(default: the bundled 40 Elements pairs) instead of evaluating")
    p.add_argument("--json", action="store_true", help="print the summary (or comparison) as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_evaluate)


def cmd_evaluate(args) -> int:
    check_positive(args, "batch_size", "limit", "resamples")
    stage = rerank_options(args)
    if args.compare:
        result = compare_runs(*args.compare, resamples=args.resamples, seed=args.seed)
        print(to_json(result) if args.json else format_comparison(result))
        return 0
    if args.calibrate is not None:
        if args.faithfulness is None:
            raise ConfigError("--calibrate measures an NLI judge: give it with --faithfulness NLI_DIR (e.g. minilm-snli)")
        result = calibrate(FaithfulnessJudge.open(args.faithfulness, args.faithfulness_threshold, device=args.device),
                           read_labels(args.calibrate))
        print(to_json(result) if args.json else format_calibration(result))
        return 0
    if args.data is None or args.out is None:
        raise ConfigError("rag evaluate needs --data (the evaluation set) and --out (the results directory), or "
                          "--compare RUN_A RUN_B")

    options = {n: v for n, v in generation_options(args).set_options().items() if n != "seed"}
    summary = evaluate(args.model, args.data, args.out, knowledge_base=args.kb, format=args.format, ks=args.k,
                       limit=args.limit, seed=args.seed, batch_size=args.batch_size, verify=args.verify, device=args.device,
                       progress=not args.quiet, faithfulness=args.faithfulness,
                       faithfulness_threshold=args.faithfulness_threshold, **stage, **options)
    if args.json:
        print(to_json(summary))
    else:
        sys.stdout.write(markdown(summary))
        cut = summary.get("cut_prompts") or {}
        if cut.get("prompts"):  # what the reader's window still cut, counted over this run's questions
            print(f"\nreader prompts cut to the window (max_context_length={'/'.join(map(str, cut['max_context_length']))}): "
                  f"{cut['cut']} of {cut['prompts']} ({cut['fraction']:.1%}), over {cut['questions']} questions")
        print(f"\nresults: {args.out} (records.jsonl, summary.json, results.md, plots/)")
    return 0
