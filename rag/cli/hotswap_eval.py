"""`rag hotswap-eval`: one model, several knowledge bases, several question sets (paper §4.5)."""

from __future__ import annotations

import sys
from pathlib import Path

from rag.cli.index import check_positive
from rag.eval.hotswap_eval import evaluate_hotswap
from rag.generation.options import option_specs
from rag.pipeline.api import load
from rag.pipeline.windows import end_of_run_line, held_window_lines
from rag.retrobust.backoff import resolve_nli
from rag.retrobust.nli import validate_threshold
from rag.utils.devices import check_device
from rag.utils.errors import RagError
from rag.utils.io import to_json
from rag.utils.truncation import counting_cut_prompts


def add_parser(sub) -> None:
    p = sub.add_parser(
        "hotswap-eval",
        help="score one model on every question set with every knowledge base (matched vs mismatched EM)",
        description="Hot-swaps the model through each --kb and answers each --data question set, printing the exact-match "
                    "matrix (rows: knowledge bases, columns: question sets). With as many --kb as --data, knowledge base i is "
                    "paired with question set i: the diagonal is 'matched', the rest 'mismatched' (Lewis et al. 2020, §4.5).",
    )
    p.add_argument("--model", default="demo", help="checkpoint directory, transformers RAG directory, or 'demo'")
    p.add_argument("--kb", action="append", required=True, metavar="DIR", help="knowledge-base directory (repeatable; rows)")
    p.add_argument("--data", action="append", required=True, metavar="FILE",
                   help="question set: NQ-open JSONL with question/answers, or any format `rag fit` reads (repeatable; columns)")
    p.add_argument("--kb-label", action="append", default=None, metavar="NAME", help="row labels (default: directory names)")
    p.add_argument("--data-label", action="append", default=None, metavar="NAME", help="column labels (default: file names)")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    p.add_argument("--plot", default=None, metavar="PNG", help="also write the matrix as a heatmap PNG")
    p.add_argument("--metric", default="em", choices=["em", "f1"], help="metric of the table and heatmap (default: em)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--limit", type=int, default=None, help="only the first N questions of each set")
    p.add_argument("--n-docs", type=int, default=None, help="passages per question (default: the model's)")
    specs = option_specs()  # the generation options' help and choices; unset: the model's stored setting
    p.add_argument("--num-beams", type=int, default=None, help=specs["num_beams"].help)
    p.add_argument("--marginalization", choices=specs["marginalization"].choices, default=None, help="default: the model's")
    p.add_argument("--decoding", choices=specs["decoding"].choices, default=None, help=specs["decoding"].help)
    p.add_argument("--max-new-tokens", type=int, default=None, help=specs["max_new_tokens"].help)
    p.add_argument("--allow-encoder-change", action="store_true",
                   help="accept knowledge bases embedded by another document encoder than the model's")
    p.add_argument("--verify", default="full", choices=["full", "size"], help="checksum verification when opening each --kb")
    p.add_argument("--nli", nargs="?", const=True, default=None, metavar="MODEL",
                   help="RetRobust NLI back-off with this NLI model (no MODEL = the default, `rag nli prepare`); the result "
                        "records the fraction of answers that kept retrieval")
    p.add_argument("--nli-threshold", type=float, default=0.5, help="entailment probability the back-off needs (default 0.5)")
    p.add_argument("--device", default=None)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_hotswap_eval)


def cmd_hotswap_eval(args) -> int:
    check_positive(args, "batch_size", "n_docs", "num_beams", "max_new_tokens", "limit")
    check_device(args.device)
    for data in args.data:  # before the model loads
        if not Path(data).exists():
            raise RagError(f"--data {data}: no such file or directory; give a question set with answers (NQ-open "
                           f"JSONL, CSV, ...)")
    nli = None
    if args.nli is not None:
        validate_threshold(args.nli_threshold, "--nli-threshold")
        nli = resolve_nli(args.nli)
    # Load on the first knowledge base: the checkpoint's own may not exist here (or, for transformers
    # checkpoints, is not recorded at all).
    extra = {"allow_encoder_change": True} if args.allow_encoder_change else {}
    with held_window_lines() as window_lines:  # said once, in the end-of-run line
        pipe = load(args.model, knowledge_base=args.kb[0], device=args.device, **extra)
    with counting_cut_prompts() as cut:  # reported once, over every (knowledge base, question set) cell
        result = evaluate_hotswap(
            pipe, args.kb, args.data, batch_size=args.batch_size, n_docs=args.n_docs, num_beams=args.num_beams,
            marginalization=args.marginalization, decoding=args.decoding, max_new_tokens=args.max_new_tokens,
            limit=args.limit, allow_encoder_change=args.allow_encoder_change, verify=args.verify,
            kb_labels=args.kb_label, data_labels=args.data_label, show_progress=not args.quiet, nli=nli,
            nli_threshold=args.nli_threshold,
        )
    line = end_of_run_line(cut.summary(), window_lines)
    if line:
        print(f"rag hotswap-eval: {line}", file=sys.stderr)
    if args.plot:
        path = result.plot(args.plot, metric=args.metric)
    if args.json:
        print(to_json(result.to_dict(), indent=2))
    else:
        print(result.table(args.metric))
        if args.plot:
            print(f"heatmap: {path}")
    return 0
