"""Command-line options shared by several `rag` commands: generation options (from the one schema,
:class:`~rag.generation.options.GenerationOptions`) and the retrieval temperature (one name for RAG, REPLUG and LSR)."""

from __future__ import annotations

import argparse
import warnings

from rag.generation.options import FALLBACK_DEFAULTS, GenerationOptions, option_specs


def add_retrieval_temperature(p: argparse.ArgumentParser, help: str, *, deprecated_alias: bool = True) -> None:
    """``--retrieval-temperature T`` (default None: the model's / 1), and ``--temperature`` as its deprecated alias."""
    p.add_argument("--retrieval-temperature", type=float, default=None, metavar="T", help=help)
    if deprecated_alias:
        p.add_argument("--temperature", dest="deprecated_temperature", type=float, default=None, help=argparse.SUPPRESS)


def retrieval_temperature(args, default: float = FALLBACK_DEFAULTS["retrieval_temperature"]) -> float:
    """The value of ``--retrieval-temperature`` (or of the deprecated ``--temperature``, with a warning), else `default`."""
    old = getattr(args, "deprecated_temperature", None)
    if old is not None:
        warnings.warn("--temperature is deprecated: use --retrieval-temperature (one name for RAG, REPLUG and REPLUG LSR)",
                      FutureWarning, stacklevel=2)
        if args.retrieval_temperature is None:
            return old
    return default if args.retrieval_temperature is None else args.retrieval_temperature


ALIASES = {"do_sample": ("--sample",)}
"""Extra flag spellings kept for existing scripts."""


def add_generation_options(p: argparse.ArgumentParser, *, skip: tuple[str, ...] = ()) -> None:
    """One flag per :class:`GenerationOptions` field (``--num-beams``, ...), all defaulting to None: an option not given
    is not passed, so the model's stored setting applies."""
    g = p.add_argument_group("generation options (unset: the model's stored setting)")
    for name, spec in option_specs().items():
        if name in skip:
            continue
        flags = (spec.flag, *ALIASES.get(name, ()))
        if spec.type is bool:
            g.add_argument(*flags, dest=name, action="store_const", const=True, default=None, help=spec.help)
        elif spec.choices and all(isinstance(c, str) for c in spec.choices):
            g.add_argument(*flags, dest=name, choices=spec.choices, default=None, help=spec.help)
        elif spec.choices:  # early_stopping: true / false / never
            g.add_argument(*flags, dest=name, type=_bool_or_str, choices=spec.choices, default=None, help=spec.help,
                           metavar="{true,false,never}")
        else:
            g.add_argument(*flags, dest=name, type=spec.type, default=None, help=spec.help,
                           metavar="T" if spec.type is float else "N")


def generation_options(args: argparse.Namespace) -> GenerationOptions:
    """The options the command line set (validated; a bad value is a ConfigError naming the flag)."""
    return GenerationOptions(**{n: getattr(args, n) for n in option_specs() if getattr(args, n, None) is not None})


def _bool_or_str(text: str):
    return {"true": True, "false": False}.get(text.lower(), text)
