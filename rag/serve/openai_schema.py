"""The OpenAI-compatible request bodies of `rag serve` and how they map onto the one generation-options schema.

``POST /v1/chat/completions`` and ``POST /v1/completions`` take OpenAI's fields. Each field is one of:

* **honoured**: ``model``, ``messages`` / ``prompt``, ``max_tokens`` (``max_completion_tokens``) -> ``max_new_tokens``,
  ``n`` -> ``num_return_sequences`` (``num_beams`` raised to ``n``; sampled: ``n`` independent draws),
  ``temperature`` / ``top_p`` -> sampling (``do_sample``; ``temperature: 0`` is greedy), ``seed`` (sampling),
  ``stream``, ``stream_options.include_usage``, and for completions ``echo`` and ``logprobs``;
* **accepted and ignored**, as they do not change the answer: :data:`IGNORED` (``user``, ``metadata``, ...);
* **refused with 400 naming it** unless it has its neutral value, as this server cannot honour it: :data:`NEUTRAL`
  (``stop``, ``tools``, ``logit_bias``, penalties, ...).

Any other field is refused with 400 naming it. ``rag`` (the extension) carries any option of
:class:`~rag.generation.options.GenerationOptions` (``n_docs``, ``marginalization``, ``num_beams``, ...) and the NLI
back-off (``nli``, ``nli_threshold``); the official client sends it with ``extra_body={"rag": {...}}``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, create_model, model_validator

from rag.generation.options import GenerationOptions, option_specs
from rag.serve.bodies import check_text_tree, option_request_field, valid_unicode
from rag.serve.requests import RequestRefused
from rag.utils.errors import ConfigError

__all__ = ["ChatRequest", "CompletionRequest", "RagOptions", "option_request_field", "IGNORED", "NEUTRAL", "Plan",
           "plan_generation",
           "check_fields", "question_of", "MAX_LOGPROBS"]

MAX_LOGPROBS = 5
"""Most alternatives per position a completions request may ask for (``logprobs``; OpenAI's limit)."""

IGNORED = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
                     "prompt_cache_retention", "parallel_tool_calls"})
"""OpenAI fields accepted and ignored: bookkeeping that does not change the answer."""

NEUTRAL: dict[str, tuple] = {
    "stop": (None, "", []),
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none", "auto"),
    "function_call": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "web_search_options": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "top_logprobs": (None, 0),
    "best_of": (None, 1),
    "suffix": (None, ""),
}
"""OpenAI fields this server cannot honour, with the values that ask for nothing (accepted); any other value: 400."""


Text = Annotated[str, AfterValidator(valid_unicode)]
ModelName = Annotated[str, StringConstraints(min_length=1, max_length=256), AfterValidator(valid_unicode)]


class _OpenAIBody(BaseModel):
    # Unknown fields are kept so that check_fields can tell "ignored" from "cannot honour" from "unknown"; every field
    # the server reads is typed (strict: "3" is not 3), finite, valid Unicode.
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:  # every string of every content form, extra fields included
        return check_text_tree(data)


class _RagFields(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    nli: Optional[bool] = None
    nli_threshold: Optional[float] = Field(None, ge=0.0, le=1.0)


RagOptions = create_model(
    "RagOptions", __base__=_RagFields, __module__=__name__,
    __doc__="The ``rag`` extension of an OpenAI request: generation options (unset: the model's defaults) and the NLI back-off.",
    **{name: option_request_field(spec) for name, spec in option_specs().items()})


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: Optional[bool] = None


class _Common(_OpenAIBody):
    model: ModelName
    max_tokens: Optional[int] = Field(None, ge=0, le=1 << 20)
    n: Optional[int] = Field(None, ge=1, le=int(option_specs()["num_return_sequences"].high))
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    seed: Optional[int] = Field(None, ge=-(1 << 63), le=(1 << 64) - 1)
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    rag: Optional[RagOptions] = None


class Message(BaseModel):
    """One chat message. Only the last one is read (it must be the user's question); the others are accepted as
    conversation history that a retrieval-augmented reader does not use."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Optional[Union[Text, list[dict[str, Any]]]] = None


class ChatRequest(_Common):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[Message] = Field(min_length=1, max_length=256)
    max_completion_tokens: Optional[int] = Field(None, ge=0, le=1 << 20)
    logprobs: Optional[bool] = None


TokenIds = Annotated[list[Annotated[int, Field(ge=0, lt=1 << 31)]], Field(min_length=1)]


class CompletionRequest(_Common):
    """Body of ``POST /v1/completions``."""

    prompt: Union[Text, list[Text], TokenIds, list[TokenIds]]
    echo: Optional[bool] = None
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)


def check_fields(req: _OpenAIBody) -> None:
    """400 naming the fields the server cannot honour (:data:`NEUTRAL` with another value) or does not know; fields of
    :data:`IGNORED` pass. Chat's ``logprobs: true`` is refused too (per-token log-probs of an answer are not computed)."""
    extra = dict(req.model_extra or {})
    unknown = sorted(k for k in extra if k not in IGNORED and k not in NEUTRAL)
    if unknown:
        raise RequestRefused(f"unknown field(s) {', '.join(unknown)}: this server does not know them; drop them "
                             "(rag options go in the \"rag\" object)", 400, param=unknown[0])
    refused = sorted(k for k, v in extra.items() if k in NEUTRAL and not any(_same(v, ok) for ok in NEUTRAL[k]))
    if isinstance(req, ChatRequest) and req.logprobs:
        refused.append("logprobs")
    if refused:
        raise RequestRefused(f"field(s) {', '.join(refused)}: this server cannot honour them (a retrieval-augmented reader "
                             "with greedy, beam or sampled decoding); drop them or send their neutral value", 400,
                             param=refused[0])


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b or (a is None and b is None) or (
        isinstance(a, (int, float)) and not isinstance(a, bool) and isinstance(b, (int, float)) and a == b)


def question_of(req: ChatRequest) -> str:
    """The question: the text of the last message, which must be the user's (400 otherwise)."""
    last = req.messages[-1]
    if last.role != "user":
        raise RequestRefused(f"messages[-1] is the {last.role}'s; end the messages with the user's question", 400,
                             param="messages")
    content = last.content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestRefused(f"messages[-1].content[{i}] is not a text part; this server reads text only", 400,
                                     param="messages")
            parts.append(valid_unicode(part["text"]))
        content = "\n".join(parts)
    if not content or not content.strip():
        raise RequestRefused("messages[-1], the user's message, is empty; send the question as its content", 400,
                             param="messages")
    return content


class Plan:
    """How one OpenAI request runs: generation options (``kw``), per-copy options (sampled ``n``: one seed each), the
    number of choices per prompt, and the NLI back-off."""

    def __init__(self, kw: dict, copies: int, per_copy: Optional[list[dict]], nli: Optional[bool],
                 nli_threshold: Optional[float]):
        self.kw, self.copies, self.per_copy, self.nli, self.nli_threshold = kw, copies, per_copy, nli, nli_threshold

    @property
    def sampled(self) -> bool:
        return bool(self.kw.get("do_sample"))


_FROM_OPENAI = {"max_new_tokens": "max_tokens", "num_return_sequences": "n", "do_sample": "temperature",
                "temperature": "temperature", "top_p": "top_p", "seed": "seed"}


def plan_generation(req: _Common, max_new_tokens: Optional[int]) -> Plan:
    """Map OpenAI's fields (and the ``rag`` extension) onto :class:`~rag.generation.options.GenerationOptions`; 400
    naming the field when two say different things or the schema refuses a value."""
    rag = req.rag.model_dump(exclude_unset=True, exclude_none=True) if req.rag is not None else {}
    nli, nli_threshold = rag.pop("nli", None), rag.pop("nli_threshold", None)
    kw = dict(rag)
    ours = {}
    if max_new_tokens is not None:
        ours["max_new_tokens"] = max_new_tokens
    t, p = req.temperature, req.top_p
    sampled = (t is not None and t > 0) or (t is None and p is not None and p < 1)
    if sampled:
        ours["do_sample"] = True
        if t is not None and t != 1:
            ours["temperature"] = t
        if p is not None and p < 1:
            if p <= 0:
                raise RequestRefused("top_p=0 keeps no token; send a value in (0, 1], or temperature 0 for greedy decoding", 400,
                                     param="top_p")
            ours["top_p"] = p
        if req.seed is not None:  # any integer, as OpenAI takes it; the sampler's seed is its value mod 2**32
            ours["seed"] = req.seed % (1 << 32)
    clash = sorted(name for name in ours if name in kw) + (["num_return_sequences"] if req.n is not None
                                                           and "num_return_sequences" in kw else [])
    if clash:
        raise RequestRefused(f"rag.{clash[0]} and {_FROM_OPENAI[clash[0]]} both set it; set it once", 400,
                             param=f"rag.{clash[0]}")
    kw.update(ours)
    n = req.n or 1
    copies, per_copy = 1, None
    if n > 1 and kw.get("do_sample"):  # n independent draws: one generation per copy, each with its own seed
        copies = n
        if "seed" in kw:
            seed = kw.pop("seed")
            per_copy = [{"seed": (seed + i) % (1 << 32)} for i in range(n)]
    elif n > 1:
        beams = kw.get("num_beams")
        if beams is not None and beams < n:
            raise RequestRefused(f"n={n} answers need at least {n} beams, but rag.num_beams={beams}; raise it or drop it", 400,
                                 param="n")
        kw["num_return_sequences"] = n
        kw.setdefault("num_beams", n)
    try:
        GenerationOptions(**kw)
    except ConfigError as e:
        raise RequestRefused(str(e), 400) from None
    return Plan(kw, copies, per_copy, nli, nli_threshold)
