"""Validators of user-given arguments shared by the whole package (lists of strings, positive integers).

Each raises a :mod:`rag.errors` exception whose message names the argument (and the bad item) and says
the fix, so every public entry point refuses bad input with the same words.
"""

from __future__ import annotations

from typing import Any

from rag.errors import RagError

__all__ = ["check_strings", "check_positive_int"]


def check_strings(items: Any, what: str, *, allow_empty: bool = False, allow_blank: bool = False,
                  error: type[RagError] = RagError) -> list[str]:
    """`items` as a list of strings, or `error` naming the bad item.

    A single string is refused (it would be read as a list of characters). By default the list must
    be non-empty (``allow_empty``) and every string hold text (``allow_blank``). Messages name the bad
    item by its index (``questions[1] is int, not a string``).
    """
    if isinstance(items, str):
        raise error(f"{what} must be a list of strings, got a single string; wrap it in a list")
    try:
        items = list(items)
    except TypeError as e:
        raise error(f"{what} must be a list of strings, got {type(items).__name__}") from e
    if not items and not allow_empty:
        raise error(f"{what} is empty; give at least one item")
    for i, s in enumerate(items):
        if not isinstance(s, str):
            t = type(s).__name__
            raise error(f"{what}[{i}] is {t}, not a string; pass text")
        if not allow_blank and not s.strip():
            raise error(f"{what}[{i}] is empty (blank text); give it text or remove it")
    return items


def check_positive_int(value: Any, what: str, *, error: type[RagError] = RagError) -> int:
    """`value` if it is an integer >= 1 (not a bool), else `error` naming `what`."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise error(f"{what} must be a positive integer, got {value!r}")
    return value
