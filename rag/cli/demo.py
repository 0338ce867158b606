"""`rag demo`: the embedded default — the bundled corpus and model, offline."""

from __future__ import annotations

import contextlib
import sys

from rag.cli.generate import print_answer
from rag.cli.index import _print_results, check_positive
from rag.demo.kb import demo_kb_needs_build, ensure_demo_kb
from rag.demo.model import demo_checkpoint_dir
from rag.generators.demo_lm import demo_lm_needs_conversion, prepare_demo_lm
from rag.knowledge.retriever_kinds import retriever_for_kind
from rag.models.rag.config import RagModelConfig
from rag.pipeline.api import load
from rag.pipeline.windows import end_of_run_line, held_window_lines
from rag.utils.files import read_json
from rag.utils.quiet import stage
from rag.utils.truncation import counting_cut_prompts
from rag.utils.validate import check_strings

DEFAULT_ANSWERS = {  # the examples `rag demo` answers, and their answers as the passages state them
    # held-out questions of the trained kinds (no training question is about these elements): retrieval by name,
    # by number and by a two-letter symbol (BM25 in the hybrid retrieval finds "Cm")
    "what is the chemical symbol of mercury?": "Hg",
    "what is the atomic number of lead?": "82",
    "which element has the symbol Cm?": "Curium",
    # of no trained kind: the prior splits between the Copper and Cuprum passages, the
    # posterior goes to the one the answer is read from (provenance: "Known by the Romans as 'cuprum.'" of Copper)
    "What did the Romans call copper?": "Cuprum",
}
DEFAULT_QUESTIONS = list(DEFAULT_ANSWERS)


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="answer questions with the bundled demo model and knowledge base (offline)",
                       description="Runs the embedded default: the demo RAG model (checkpoints/demo_causal: "
                                   "SmolLM2-135M-Instruct "
                                   "with a LoRA adapter) answering from the Elements corpus through hybrid retrieval (the "
                                   "bundled all-MiniLM-L6-v2 and BM25). The knowledge base is built and the reader converted "
                                   "from its GGUF file on first use.")
    p.add_argument("questions", nargs="*", help=f"questions (default: {len(DEFAULT_QUESTIONS)} held-out examples)")
    p.add_argument("--kb", default=None,
                   help="where the demo knowledge base lives (default: $RAG_CACHE/demo_kb or ~/.cache/rag/demo_kb)")
    p.add_argument("-k", type=int, default=3, help="passages shown per answer")
    p.add_argument("--retrieve-only", action="store_true", help="print the top-k passages only (no generation)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress lines (building the knowledge base and converting the LM on "
                                                         "first use, loading the model)")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args) -> int:
    check_positive(args, "k")
    if args.questions:
        check_strings(args.questions, "questions")
    verbose = bool(getattr(args, "verbose", False))
    with _stage("building the demo knowledge base", args, show=demo_kb_needs_build(args.kb)):
        kb = ensure_demo_kb(args.kb, show_progress=verbose)
    questions = args.questions or DEFAULT_QUESTIONS
    if not args.json:
        print(f"demo knowledge base: {kb.path} ({kb.version}, {len(kb)} passages, {kb.index_spec.kind})")
    if args.retrieve_only:
        # the default model's own retrieval (hybrid), read from its config without loading the reader

        cfg_file = demo_checkpoint_dir() / "rag_config.json"
        config = RagModelConfig.from_dict(read_json(cfg_file, fix="reinstall rag").get("config") or {}, str(cfg_file))
        _print_results(questions, retriever_for_kind(config.retrieval, kb, settings=config).retrieve(questions, args.k),
                       args.json)
        return 0

    if demo_lm_needs_conversion():  # otherwise loading reuses (and verifies) the converted LM
        with _stage("converting the demo LM from its GGUF file", args):
            prepare_demo_lm(show_progress=verbose)
    with _stage("loading the demo model", args):
        with held_window_lines() as window_lines:  # said once, in the end-of-run line
            pipe = load(demo_checkpoint_dir(), knowledge_base=kb)
    if not args.json:
        print(f"demo model: {demo_checkpoint_dir()} (see checkpoints/README.md for how it was trained and how well it does)")
    with counting_cut_prompts() as cut:
        answers = pipe.generate(questions)  # the model's stored decoding settings
    for a in answers:
        print_answer(a, as_json=args.json, show_passages=args.k)
    line = end_of_run_line(cut.summary(), window_lines)
    if line:
        print(f"rag demo: {line}", file=sys.stderr)
    return 0


def _stage(label: str, args, show: bool = True):
    """One timed line on stderr for a first-run step (none with --quiet, or when the step has nothing to do)."""
    if args.quiet or not show:
        return contextlib.nullcontext()
    return stage(label, inline=not getattr(args, "verbose", False))
