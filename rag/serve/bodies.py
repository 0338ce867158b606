"""Request bodies of `rag serve`'s own routes (``/generate``, ``/retrieve``, ``/admin/*``) and the text check they share
with the OpenAI-compatible bodies (:mod:`rag.serve.openai_schema`).

Every body is strict (``"3"`` is not 3, 1 is not true), refuses unknown fields, NaN and infinities, and strings that
are not valid Unicode (:func:`valid_unicode`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, create_model, model_validator

from rag.generation.options import GenerationOptions, OptionSpec, option_specs
from rag.serve.limits import MAX_N_DOCS, MAX_QUESTIONS
from rag.utils.errors import ConfigError

__all__ = ["GenerateRequest", "RetrieveRequest", "SwapRequest", "SwapBackRequest", "Question", "valid_unicode", "check_text_tree",
           "option_request_field", "MAX_QUESTION_CHARS", "MAX_PATH_CHARS"]

MAX_QUESTION_CHARS = 4096
"""Longest question accepted (characters; the tokenizer truncates further)."""
MAX_PATH_CHARS = 4096


def valid_unicode(s: str) -> str:
    """Refuse strings that are not valid Unicode text: JSON's ``\\ud800`` escapes decode to lone
    surrogates, which no tokenizer, file system or UTF-8 response can take."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"contains a lone surrogate at character {e.start}; send valid Unicode text") from None
    return s


def check_text_tree(value: Any) -> Any:
    """`value` (a parsed JSON body) unchanged if every string in it, keys included, is valid Unicode
    (:func:`valid_unicode`); else ValueError naming where the first bad one is (``messages.0.content.1.text``). The
    one check of every text field of every request form (string content, content parts, unknown fields); iterative, so
    a deeply nested body cannot exhaust the stack."""
    stack: list[tuple[Any, tuple]] = [(value, ())]
    while stack:
        node, where = stack.pop()
        if isinstance(node, str):
            try:
                valid_unicode(node)
            except ValueError as e:
                raise ValueError(f"{'.'.join(map(str, where)) or 'the body'}: {e}") from None
        elif isinstance(node, dict):
            for k, v in node.items():
                if isinstance(k, str):
                    stack.append((k, where + ("<field name>",)))
                stack.append((v, where + (k,)))
        elif isinstance(node, (list, tuple)):
            stack.extend((v, where + (i,)) for i, v in enumerate(node))
    return value


Question = Annotated[str, StringConstraints(min_length=1, max_length=MAX_QUESTION_CHARS, strip_whitespace=False),
                     AfterValidator(valid_unicode)]


def option_request_field(spec: OptionSpec) -> tuple:
    """A request field from the generation-options schema (for /generate and the OpenAI routes alike): unset (None)
    means the model's stored default."""
    if spec.choices:
        strs = tuple(c for c in spec.choices if isinstance(c, str))
        typ = Literal[strs] if len(strs) == len(spec.choices) else Union[bool, Literal[strs]]
        return Optional[typ], Field(None, description=spec.help)
    return Optional[spec.type], Field(None, ge=spec.low, le=spec.high, description=spec.help)


_RETRIEVERS = tuple(option_specs()["retrieval"].choices)


def _only_false(value: bool) -> bool:
    if value:
        raise ValueError("retrieval: true is the default; send false (closed-book: nothing retrieved) or a retriever "
                         f"({', '.join(_RETRIEVERS)})")
    return value


class _Body(BaseModel):
    # strict: "3" is not 3 and 1 is not true; unknown fields are an error, not silently ignored;
    # NaN and +-Infinity (which Python's JSON parser accepts) are not numbers a request may carry.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        return check_text_tree(data)


class _GenerateFields(_Body):
    questions: list[Question] = Field(min_length=1, max_length=MAX_QUESTIONS)
    nli: Optional[bool] = None
    """The RetRobust NLI back-off (needs a server started with ``rag serve --nli``); default: on when it was."""
    nli_threshold: Optional[float] = Field(None, ge=0.0, le=1.0)
    """Entailment probability the back-off needs (default: the server's, 0.5 unless set)."""

    @model_validator(mode="after")
    def _consistent(self):
        options = {k: v for k, v in self.options().items() if not (k == "retrieval" and v is False)}
        try:  # the schema's own cross-field checks (num_return_sequences <= num_beams, ...)
            GenerationOptions(**options)
        except ConfigError as e:
            raise ValueError(str(e)) from None
        return self

    def options(self) -> dict:
        """The generation options the request set (the rest: the model's stored defaults); ``retrieval: false``
        (closed-book: nothing retrieved) is kept, for the pipeline."""
        return self.model_dump(exclude={"questions", "nli", "nli_threshold"}, exclude_unset=True)

    @property
    def closed_book(self) -> bool:
        """``"retrieval": false``: answer the bare questions, nothing retrieved (the closed-book baseline)."""
        return getattr(self, "retrieval", None) is False


GenerateRequest = create_model(
    "GenerateRequest", __base__=_GenerateFields, __module__=__name__,
    __doc__="Body of ``POST /generate``: questions, the generation options of "
            ":class:`~rag.generation.options.GenerationOptions` (unset: the model's defaults), and the NLI back-off.",
    **{name: option_request_field(spec) for name, spec in option_specs().items() if name != "retrieval"},
    retrieval=(Optional[Union[Annotated[bool, AfterValidator(_only_false)], Literal[_RETRIEVERS]]],
               Field(None, description="dense, bm25 or hybrid; false: nothing retrieved, the closed-book answer")))


class RetrieveRequest(_Body):
    """Body of ``POST /retrieve``."""

    questions: list[Question] = Field(min_length=1, max_length=MAX_QUESTIONS)
    k: int = Field(5, ge=1, le=MAX_N_DOCS)


class SwapRequest(_Body):
    """Body of ``POST /admin/swap``: a knowledge-base directory inside a configured root."""

    path: Annotated[str, StringConstraints(min_length=1, max_length=MAX_PATH_CHARS), AfterValidator(valid_unicode)]
    allow_encoder_change: bool = False
    allow_metric_change: bool = False
    verify: Literal["full"] = "full"
    """Always "full": a swapped-in knowledge base is served under its version id only after every file's
    SHA-256 matched (``"size"`` is refused with 422; size-only checks stay a local choice of
    :class:`~rag.knowledge.hotswap.KnowledgeBaseSlot` / ``KnowledgeBase.open``)."""


class SwapBackRequest(_Body):
    """Body of ``POST /admin/swap_back`` (may be omitted); re-opened knowledge bases are verified fully."""

    verify: Literal["full"] = "full"
