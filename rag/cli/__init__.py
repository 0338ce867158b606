"""The `rag` command.

    rag index build|info|search ...     knowledge bases (rag.cli.index)
    rag lm prepare [--force]            the demo causal LM, converted and verified (rag.cli.lm)
    rag lm-eval ...                     perplexity with In-Context RALM (rag.cli.lm_eval)
    rag evaluate ...                    a model or retriever over an evaluation set; --compare two runs (rag.cli.evaluate)
    rag nli prepare [--force]           the default NLI model, trained on SNLI (rag.cli.nli)
    rag fit|validate|test|predict ...   training and evaluation with LightningCLI
    rag export CKPT DIR                 a `rag fit` checkpoint as a model directory (rag.cli.export)

Each subcommand module exposes `add_parser(subparsers)`; Lightning's subcommands are
handed to LightningCLI unchanged so that `--config`, `--print_config` and every
model/data argument work as Lightning users expect.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import logging
import re
import sys
import traceback
import warnings
from typing import Optional, Sequence

import rag
from rag.utils.errors import RagError
from rag.utils.quiet import quiet
from rag.utils.truncation import counting_cut_prompts

LIGHTNING_COMMANDS = ("fit", "validate", "test", "predict")
# subcommand -> (module with add_parser(subparsers), the one-line help its parser gives); each parser sets `func`.
COMMANDS = {
    "demo": ("rag.cli.demo", "answer questions with the bundled demo model and knowledge base (offline)"),
    "export": ("rag.cli.export", "write the model of a `rag fit` checkpoint (.ckpt) as a model directory"),
    "generate": ("rag.cli.generate", "answer questions (arguments, --file, or one per line on stdin) with a RAG model, or "
                                     "continue prompts with a causal LM (In-Context RALM)"),
    "index": ("rag.cli.index", "build, inspect and query knowledge bases"),
    "serve": ("rag.cli.serve", "serve a RAG model over HTTP (generate, retrieve, knowledge-base hot swap)"),
    "hotswap-eval": ("rag.cli.hotswap_eval",
                     "score one model on every question set with every knowledge base (matched vs mismatched EM)"),
    "lm": ("rag.cli.lm", "the demo causal LM (SmolLM2-135M-Instruct): prepare it"),
    "lm-eval": ("rag.cli.lm_eval",
                "perplexity (token, word, bits per byte) of texts under a causal LM, with In-Context RALM"),
    "nli": ("rag.cli.nli", "the NLI model of the RetRobust back-off: prepare it"),
    "evaluate": ("rag.cli.evaluate",
                 "score a model (or a knowledge base's retriever alone) on an evaluation set; --compare two runs"),
}
"""A command's module imports at its top what the command runs (torch, transformers, the server); :func:`build_parser`
imports only the module of the command being run, so ``rag --help`` imports none of them."""

_EXTRAS = {"fastapi": "serve", "uvicorn": "serve", "httpx": "remote-lm", "ray": "ray", "gguf": "lm"}
"""The optional dependencies of setup.cfg's extras, by the module a command's import misses."""


class _Parser(argparse.ArgumentParser):
    """No abbreviated options, here and in every subcommand (subparsers take this class): with them ``rag demo --k 3``
    meant ``--kb 3`` and built a knowledge base in a folder named ``3``."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def build_parser(command: Optional[str] = None) -> argparse.ArgumentParser:
    """The `rag` parser. `command` None: every command's full parser; otherwise only that command's, the others listed
    by name and help (`""`: none, for ``rag --help``)."""
    parser = _Parser(
        prog="rag",
        description="Retrieval-augmented generation: build knowledge bases, train, generate, evaluate.",
        epilog=f"Training: rag {{{','.join(LIGHTNING_COMMANDS)}}} --config lightning_configs/NAME.yaml (see README).",
    )
    parser.add_argument("--version", action="version", version=f"rag {rag.__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level; show tracebacks and every warning")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help) in COMMANDS.items():
        if command is None or command == name:
            importlib.import_module(module).add_parser(sub)
        else:
            sub.add_parser(name, help=help)
    _add_verbose_everywhere(parser)
    return parser


def _add_verbose_everywhere(parser: argparse.ArgumentParser) -> None:
    """Accept -v after the subcommand as well (`rag index build ... -v`), not only before it."""
    for action in parser._actions:  # argparse has no public walk over subparsers
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                if "-v" not in child._option_string_actions:
                    child.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                                       help="log at INFO level; show tracebacks and every warning")
                _add_verbose_everywhere(child)


_USAGE_ERRNOS = {errno.ENOENT: "check the path", errno.EACCES: "check its permissions, or choose another path",
                 errno.EPERM: "check its permissions, or choose another path", errno.EISDIR: "give a file, not a directory",
                 errno.ENOTDIR: "a part of the path is a file, not a directory", errno.EEXIST: "choose another path",
                 errno.EROFS: "the file system is read-only; choose another path",
                 errno.ENOSPC: "the disk is full; free space or choose another path"}


def describe_error(e: BaseException, *, batch_option: Optional[str] = None) -> tuple[str, int]:
    """The one-line message and exit status `rag` gives for an exception a command raised.

    RagError (the library's errors for bad input), undecodable input and file-system errors are the
    user's to fix: exit 2 with a message naming the file and the fix. Anything else is unexpected:
    exit 1, naming the exception and pointing to -v for the traceback. A message is always one line.
    `batch_option`: the command's batch-size option, suggested when memory ran out (None: it has none).
    """
    message, status = _describe(e, batch_option)
    return " ".join(part.strip() for part in message.splitlines() if part.strip()), status


def _describe(e: BaseException, batch_option: Optional[str]) -> tuple[str, int]:
    if isinstance(e, RagError):
        return str(e), 2
    if isinstance(e, UnicodeDecodeError):
        return (f"input is not valid {e.encoding} text (byte {e.object[e.start:e.start + 1]!r} at offset {e.start}); "
                f"convert it to UTF-8 (e.g. `iconv -f latin1 -t utf-8`)"), 2
    if isinstance(e,
                  (FileExistsError, FileNotFoundError, IsADirectoryError, NotADirectoryError,
                   PermissionError)) and e.errno is None:
        return str(e), 2  # raised with a message of its own (e.g. FileExistsError("... pass overwrite=True"))
    if isinstance(e, OSError) and (e.filename is not None or e.errno in _USAGE_ERRNOS):
        where = f"{e.filename}: " if e.filename is not None else ""
        return f"{where}{e.strerror or e}; {_USAGE_ERRNOS.get(e.errno, 'check the path')}", 2
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":
        lower = f"lower {batch_option}, or " if batch_option else ""
        return f"out of memory ({type(e).__name__}); {lower}use a machine with more memory", 1
    return (f"unexpected {type(e).__name__}: {e}; rerun with -v for the traceback, and please report it if the input was "
            f"valid"), 1


def user_error_in(e: BaseException) -> Optional[BaseException]:
    """The first error in `e`'s chain of causes that is the user's to fix (a RagError, a file-system error, undecodable
    input, memory): LightningCLI (jsonargparse) reports a module's ``ConfigError`` from its ``__init__`` as a ValueError
    ("Does not validate against any of the Union subtypes") whose cause it is. None when there is none."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (RagError, UnicodeDecodeError, MemoryError)) or (isinstance(e, OSError) and describe_error(e)[1] == 2):
            return e
        e = e.__cause__  # explicit causes only: an error raised while handling another is not caused by it
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    own = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    verbose = [a for a in argv if a in ("-v", "--verbose")]
    rest = [a for a in argv if a not in ("-v", "--verbose")]
    if rest and rest[0] in LIGHTNING_COMMANDS:  # `rag -v test ...` / `rag test ... -v`: -v is rag's, not LightningCLI's
        from rag.cli.train import run_lightning_cli

        if verbose:
            logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
            if own:
                sys.argv[1:] = rest  # LightningCLI reads the process's command line
        try:
            try:
                # the training loop's bar stays; the libraries' bars, logs and warnings only with -v. Cut reader prompts
                # are counted, not warned per step: RagModule reports them before training and once per epoch
                with quiet(f"rag {rest[0]}", enabled=not verbose), counting_cut_prompts():
                    run_lightning_cli(rest)
            except Exception as e:  # jsonargparse wraps a class's own error in its ValueError: the user's is the cause
                cause = user_error_in(e)
                if cause is None:
                    raise
                raise cause from e
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130
        except (RagError, OSError, UnicodeDecodeError, MemoryError) as e:  # the user's to fix: one line (-v: traceback)
            message, status = describe_error(e, batch_option="--data.batch_size")
            # RagModelConfig's checks name its fields; here they are the options --model.rag.<field>
            message = re.sub(r"\bRagModelConfig\.(\w+)", r"--model.rag.\1", message)
            if verbose:
                traceback.print_exc()
            print(f"rag {rest[0]}: error: {message}", file=sys.stderr)
            return status
        return 0
    command = rest[0] if rest and rest[0] in COMMANDS else ""
    try:
        parser = build_parser(command)
    except ModuleNotFoundError as e:  # an optional dependency the command's module imports (fastapi for `rag serve`)
        if e.name is None or e.name.split(".")[0] == "rag":
            raise
        extra = _EXTRAS.get(e.name.split(".")[0])
        fix = f"pip install 'rag[{extra}]'" if extra else f"pip install {e.name.split('.')[0]}"
        print(f"rag {command}: error: it needs the package {e.name.split('.')[0]!r}, which is not installed; {fix}",
              file=sys.stderr)
        return 2
    args, extra = parser.parse_known_args(argv)
    trailing = getattr(args, "trailing_positional", None)
    if extra and trailing:
        unknown = [e for e in extra if e.startswith("-")]
        if unknown:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        # `rag index search KB -k 2 oxygen`: argparse gives `queries` nothing once an option follows the first
        # positional, so words after the options are queries too (in order)
        setattr(args, trailing, [*getattr(args, trailing), *extra])
    elif extra:
        parser.parse_args(argv)  # argparse's own error for what is really unknown (exit 2)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    command = " ".join(c for c in (args.command, getattr(args, "index_command", None)) if c)
    # rag's warnings one line each, without the source line they were issued from; other packages' warnings, progress
    # bars and log records only with -v (which shows everything as Python and the libraries would)
    with quiet(f"rag {command}", enabled=not args.verbose):
        if not args.verbose:
            # A model's own max_context_length shortening its passages (keeping the question) is how it was configured,
            # not news on every run; -v shows it. Questions that are themselves cut still warn.
            warnings.filterwarnings("ignore", message="Some generator contexts are longer than max_length")
        try:
            return int(args.func(args) or 0)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130
        except BrokenPipeError:  # `rag index search ... | head`
            return 0
        except Exception as e:  # noqa: BLE001 - every failure becomes one line (and a traceback with -v)
            message, status = describe_error(e, batch_option="--batch-size" if hasattr(args, "batch_size") else None)
            if args.verbose:
                traceback.print_exc()
            print(f"rag {command}: error: {message}", file=sys.stderr)
            return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
