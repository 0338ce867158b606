"""Operator-set bounds on what one HTTP request may ask of `rag serve` (sizes, time, queue).

Kept apart from :mod:`rag.serve.app` so that the command line can read the defaults and validate an
operator's settings before FastAPI is imported or a model is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rag.generation.options import option_specs
from rag.utils.errors import ConfigError
from rag.utils.validate import check_number

__all__ = ["ServeLimits", "MAX_QUESTIONS", "MAX_N_DOCS", "MAX_BEAMS", "MAX_NEW_TOKENS", "MAX_PROMPT_TOKENS"]

MAX_QUESTIONS = 64
"""Most questions per request the request schema accepts (the ceiling of ``max_batch``)."""
MAX_N_DOCS = int(option_specs()["n_docs"].high)
"""Most passages per question the request schema accepts (the ceiling of ``max_n_docs``)."""
MAX_BEAMS = int(option_specs()["num_beams"].high)
"""Most beams the request schema accepts (the ceiling of ``max_beams``)."""
MAX_NEW_TOKENS = int(option_specs()["max_new_tokens"].high)
"""Most new tokens the request schema accepts (the ceiling of ``max_new_tokens``)."""

MAX_PROMPT_TOKENS = 1 << 20
"""The ceiling of ``max_prompt_tokens``."""

_CEILINGS = {"max_prompt_tokens": MAX_PROMPT_TOKENS, "max_step_rows": MAX_N_DOCS * MAX_BEAMS, "max_n_docs": MAX_N_DOCS,
             "max_beams": MAX_BEAMS, "max_new_tokens": MAX_NEW_TOKENS, "max_batch": MAX_QUESTIONS}


@dataclass(frozen=True)
class ServeLimits:
    """What one request may ask for, and how long and how many may wait.

    A request over a size limit is refused with 422 naming the limit (``rag serve --max-...``);
    one that has not finished after `request_timeout` seconds (queueing included) gets 504; one
    that finds `max_queue` requests already waiting for a model slot gets 503 with ``Retry-After:
    retry_after`` seconds. Work stops at the next question when its client disconnects or its
    time is up.

    Attributes:
        max_n_docs: most passages per question (``n_docs`` of /generate, ``k`` of /retrieve).
        max_beams: most beams (``num_beams``; ``num_return_sequences`` cannot exceed it either).
        max_new_tokens: most generated tokens per answer.
        max_batch: most questions per request.
        max_step_rows: most rows one decoding step of a request may run: passages x beams (n_docs x num_beams for
            RAG, ensemble x num_beams for a causal reader; unset options count as the model's stored ones). A step is
            one unit of work, so this bounds how long a cheap request waits beside any admitted one; more: 422.
        max_prompt_tokens: most prompt tokens one scoring request (``/v1/completions`` with ``max_tokens: 0``) may send,
            all its prompts together; more: 400 naming it. Each prompt is scored in windows, one unit of work each.
        request_timeout: seconds a request may take, waiting included; None: no limit.
        max_queue: requests that may wait for a model slot beyond the ``max_concurrency`` running.
        retry_after: the ``Retry-After`` seconds of a 503.
    """

    max_n_docs: int = 20
    max_beams: int = 8
    max_new_tokens: int = 64
    max_batch: int = 16
    max_prompt_tokens: int = 4096
    max_step_rows: int = 32
    request_timeout: Optional[float] = 60.0
    max_queue: int = 16
    retry_after: int = 1

    def __post_init__(self) -> None:
        def integer(name: str, low: int, high: Optional[int]) -> None:
            check_number(getattr(self, name), f"{name} (rag serve {self.option(name)})", integer=True, low=low, high=high,
                         error=ConfigError)

        for name, ceiling in _CEILINGS.items():
            integer(name, 1, ceiling)
        integer("max_queue", 0, None)
        integer("retry_after", 1, None)
        check_number(self.request_timeout, "request_timeout (rag serve --request-timeout, seconds; none: no limit)", above=0,
                     allow_none=True, error=ConfigError)

    @staticmethod
    def option(name: str) -> str:
        """The `rag serve` option that sets field `name`."""
        return "--" + name.replace("_", "-")
