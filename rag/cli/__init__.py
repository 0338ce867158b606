"""The `rag` command.

    rag index build|info|search ...     knowledge bases (rag.cli.index)
    rag lm prepare [--force]            the demo causal LM, converted and verified (rag.cli.lm)
    rag nli prepare [--force]           the default NLI model, trained on SNLI (rag.cli.nli)
    rag fit|validate|test|predict ...   training and evaluation with LightningCLI

Each subcommand module exposes `add_parser(subparsers)`; Lightning's subcommands are
handed to LightningCLI unchanged so that `--config`, `--print_config` and every
model/data argument work as Lightning users expect.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Optional, Sequence

from rag.errors import RagError

LIGHTNING_COMMANDS = ("fit", "validate", "test", "predict")
# subcommand -> module with add_parser(subparsers); each parser sets `func`.
COMMANDS = {"demo": "rag.cli.demo", "generate": "rag.cli.generate", "index": "rag.cli.index", "serve": "rag.cli.serve", "hotswap-eval": "rag.cli.hotswap_eval", "lm": "rag.cli.lm", "nli": "rag.cli.nli"}


def build_parser() -> argparse.ArgumentParser:
    import rag

    parser = argparse.ArgumentParser(
        prog="rag",
        description="Retrieval-augmented generation: build knowledge bases, train, generate, evaluate.",
        epilog=f"Training: rag {{{','.join(LIGHTNING_COMMANDS)}}} --config lightning_configs/NAME.yaml (see README).",
    )
    parser.add_argument("--version", action="version", version=f"rag {rag.__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in COMMANDS.items():
        importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in LIGHTNING_COMMANDS:
        from rag.cli.train import run_lightning_cli

        run_lightning_cli(argv)
        return 0
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except RagError as e:
        print(f"rag {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `rag index search ... | head`
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
