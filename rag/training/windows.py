"""A training run's reading windows measured on its own data before the first step (``model.windows``).

:func:`measure_training_prompts` retrieves for up to ``questions`` of the distinct training questions (evenly spaced
through them) and measures each reader input whole, as the generator lays it out
(:meth:`~rag.generators.base.Generator.prompt_ids`), while counting those the window cuts
(:func:`~rag.utils.truncation.sample_cut_prompts`). With ``model.windows.max_context_length: auto`` the run's
``rag.max_context_length`` becomes the window holding ``share`` of those inputs whole (at most the generator's positions
less ``rag.max_target_length``); with ``model.windows.max_new_tokens: auto`` the decoding's ``max_new_tokens`` becomes
the longest training answer's tokens plus the end token (at most ``rag.max_target_length``): decoding stops at the end
token, so room past an answer costs nothing where the reader stops, and a window short of an answer cuts it. Each is
reported in one line; the values are kept in the checkpoint, so a resumed run reads as the first did.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional, Sequence

from rag.utils.errors import ConfigError
from rag.utils.truncation import CutPrompts, sample_cut_prompts
from rag.utils.validate import check_number

__all__ = ["DataWindows", "TrainingPrompts", "measure_training_prompts", "answer_window", "quantile_window",
           "model_positions"]


@dataclass
class DataWindows:
    """``model.windows``: reading windows chosen from the training data at setup instead of written by hand."""

    max_context_length: Optional[Literal["auto"]] = None
    """``auto``: ``rag.max_context_length`` := the window that holds ``share`` of the training prompts whole."""
    max_new_tokens: Optional[Literal["auto"]] = None
    """``auto``: ``decoding.max_new_tokens`` := the longest training answer's tokens, plus the end."""
    share: float = 0.99
    """The share of training prompts the chosen ``max_context_length`` holds whole, in (0, 1]."""
    questions: int = 64
    """Distinct training questions retrieved for to measure the prompts."""

    def __post_init__(self) -> None:
        for name in ("max_context_length", "max_new_tokens"):
            if getattr(self, name) not in (None, "auto"):
                raise ConfigError(f"model.windows.{name}={getattr(self, name)!r}; give auto, or null to keep the one set")
        check_number(self.share, "model.windows.share", above=0.0, high=1.0, error=ConfigError)
        check_number(self.questions, "model.windows.questions", integer=True, low=1, error=ConfigError)


def quantile_window(lengths: Sequence[int], share: float, multiple: int = 1) -> int:
    """The smallest length (a multiple of `multiple`) that at least `share` of `lengths` do not exceed (0: none)."""
    ordered = sorted(int(x) for x in lengths)
    if not ordered:
        return 0
    need = ordered[max(math.ceil(share * len(ordered)) - 1, 0)]
    return -(-need // multiple) * multiple


def model_positions(generator) -> Optional[int]:
    """The generator's most positions (``max_position_embeddings`` / ``n_positions`` of its config), or None."""
    cfg = getattr(generator.model, "config", None)
    found = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    return int(found) if found else None


@dataclass(frozen=True)
class TrainingPrompts:
    """The reader inputs of a sample of training questions: their whole lengths and the count the window cut."""

    lengths: list[int]
    cut: CutPrompts
    questions: int
    """Distinct questions retrieved for."""
    of: int
    """Distinct training questions."""

    def covering(self, share: float, multiple: int = 8) -> int:
        """The window (a multiple of `multiple` tokens) that holds `share` of these prompts whole."""
        return quantile_window(self.lengths, share, multiple)


def measure_training_prompts(model, questions: Sequence[str], *, limit: int = 64) -> TrainingPrompts:
    """Retrieve for up to `limit` of the distinct `questions` with `model` (a RagModel) and measure every reader input
    whole, counting those cut at ``model.config.max_context_length``. The caller keeps the random state and gradients
    out of it (see ``RagModule``)."""
    lengths: list[int] = []

    def prepare(batch: list[str]):
        inputs = model.prepare_inputs(batch)
        for q, passages in zip(batch, inputs.retrieved.passages):
            lengths.extend(len(row) for row in model.lm.prompt_ids(q, passages, model.config))
        return inputs

    cut, n = sample_cut_prompts(prepare, questions, limit=limit)
    return TrainingPrompts(lengths, cut, n, len(set(questions)))


def answer_window(tokenizer, answers: Sequence[str], cap: int) -> tuple[int, int]:
    """``max_new_tokens`` for `answers`: the longest one's tokens (no special tokens) plus one for the end token, at most
    `cap`; and that longest answer's tokens."""
    answers = [a.strip() for a in answers if a and a.strip()]
    if not answers:
        raise ConfigError("model.windows.max_new_tokens=auto needs training answers, and this run has none; set "
                          "model.decoding.max_new_tokens")
    longest = max(len(r) for r in tokenizer(answers, add_special_tokens=False)["input_ids"])
    return min(longest + 1, int(cap)), longest
