"""Command-line options shared by several `rag` commands: the retrieval temperature (one name for RAG, REPLUG and LSR)."""

from __future__ import annotations

import argparse
import warnings


def add_retrieval_temperature(p: argparse.ArgumentParser, help: str, *, deprecated_alias: bool = True) -> None:
    """``--retrieval-temperature T`` (default None: the model's / 1), and ``--temperature`` as its deprecated alias."""
    p.add_argument("--retrieval-temperature", type=float, default=None, metavar="T", help=help)
    if deprecated_alias:
        p.add_argument("--temperature", dest="deprecated_temperature", type=float, default=None, help=argparse.SUPPRESS)


def retrieval_temperature(args, default: float = 1.0) -> float:
    """The value of ``--retrieval-temperature`` (or of the deprecated ``--temperature``, with a warning), else `default`."""
    old = getattr(args, "deprecated_temperature", None)
    if old is not None:
        warnings.warn("--temperature is deprecated: use --retrieval-temperature (one name for RAG, REPLUG and REPLUG LSR)",
                      FutureWarning, stacklevel=2)
        if args.retrieval_temperature is None:
            return old
    return default if args.retrieval_temperature is None else args.retrieval_temperature
