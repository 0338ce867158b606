"""Validators of user-given arguments shared by the whole package (lists of strings, positive integers).

Each raises a :mod:`rag.utils.errors` exception whose message names the argument (and the bad item) and says
the fix, so every public entry point refuses bad input with the same words.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional

from rag.utils.errors import RagError

__all__ = ["check_strings", "check_positive_int", "check_number", "check_choice", "check_bool", "is_integer", "is_number"]


def is_integer(value: Any) -> bool:
    """True for an integer (Python or numpy), never for a bool (True is not 1 here)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """True for a finite real number (Python or numpy, integer or float), never for a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


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


def check_positive_int(value: Any, what: str, *, allow_none: bool = False, error: type[RagError] = RagError) -> Any:
    """`value` if it is an integer >= 1 (not a bool; None too with `allow_none`), else `error` naming `what`."""
    if value is None and allow_none:
        return None
    if not is_integer(value) or value < 1:
        raise error(f"{what} must be a positive integer, got {value!r}")
    return value


def check_number(value: Any, what: str, *, integer: bool = False, low: Optional[float] = None, high: Optional[float] = None,
                 above: Optional[float] = None, allow_none: bool = False, error: type[RagError] = RagError) -> Any:
    """`value` if it is a finite number (an integer with `integer`; never a bool) within [`low`, `high`] and greater than
    `above` (None too with `allow_none`), else `error` naming `what` and the range."""
    if value is None and allow_none:
        return None
    kind = "an integer" if integer else "a number"
    if not (is_integer(value) if integer else is_number(value)):
        raise error(f"{what} must be {kind}, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high) or (above is not None and not value > above):
        parts = ([f"> {above:g}"] if above is not None else []) + (
            [f"between {low:g} and {high:g}"] if low is not None and high is not None
            else [f">= {low:g}"] if low is not None else [f"<= {high:g}"] if high is not None else [])
        raise error(f"{what} must be {kind} {' and '.join(parts)}, got {value!r}")
    return value


def check_choice(value: Any, what: str, choices: tuple, *, error: type[RagError] = RagError) -> Any:
    """`value` if it is one of `choices`, else `error` listing them."""
    if not any(value == c and type(value) is type(c) for c in choices):  # 1 is not True, True is not 1
        raise error(f"{what} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def check_bool(value: Any, what: str, *, allow_none: bool = False, error: type[RagError] = RagError) -> Any:
    """`value` if it is True or False (not 0/1, not a string; None too with `allow_none`), else `error` naming `what`."""
    if value is None and allow_none:
        return None
    if not isinstance(value, bool):
        raise error(f"{what} must be true or false{' (or null)' if allow_none else ''}, got {value!r}")
    return value
