"""One schema of generation options, one table of their defaults, and the resolved form the search reads.

* :data:`FALLBACK_DEFAULTS`: what an option is when neither the call nor the model's stored settings set it. It is
  the only place a default is written: the help of every flag and request field, :class:`GenerationConfig`'s field
  defaults, training's validation decoding (``model.decoding``) and In-Context RALM's stride / query length read it.
* :class:`GenerationOptions`: per-call options, every one None ("unset") by default; `rag generate`'s flags and
  `rag serve`'s request fields derive from it. It validates what is set (types, ranges, choices) naming the option
  and its flag (:func:`check_option`, the one check of a value).
* :class:`GenerationConfig`: the resolved search settings. :func:`resolve_generation` (and
  :meth:`GenerationOptions.resolve`) builds one from the options set, then the model's stored settings (an exported
  model keeps those its `rag fit` run was scored with), then :data:`FALLBACK_DEFAULTS`. Only options a caller sets
  override a stored setting, so a flag nobody typed never does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Optional, Union

from rag.utils.errors import ConfigError
from rag.utils.validate import check_bool, check_choice, check_number

__all__ = ["FALLBACK_DEFAULTS", "GenerationConfig", "GenerationOptions", "OptionSpec", "check_option", "option_specs",
           "reader_options", "resolve_generation", "retrieval_options"]

FALLBACK_DEFAULTS: dict[str, Any] = {
    "num_beams": 1, "max_new_tokens": 32, "min_new_tokens": 0, "num_return_sequences": 1, "length_penalty": 1.0,
    "no_repeat_ngram_size": 2, "early_stopping": False, "decoding": "thorough", "stride": 4, "query_length": 32,
    "retrieval_temperature": 1.0, "do_sample": False, "temperature": 1.0, "top_p": 1.0, "extractive": False,
}
"""What an option resolves to when neither the call nor the model's stored settings set it. ``no_repeat_ngram_size``
is that of a generator trained here (a small or briefly trained generator otherwise loops, and a short factoid answer
has no legitimate repeated bigram); an imported transformers checkpoint or a frozen LM decodes without one (0) unless
its stored settings say otherwise."""


@dataclass(frozen=True)
class OptionSpec:
    """How one option is checked and offered: its type, bounds, choices, help, and which readers take it."""

    type: type
    help: str
    low: Optional[float] = None  # inclusive
    high: Optional[float] = None  # inclusive; the server may lower it (ServeLimits)
    choices: tuple = ()
    method: Optional[Literal["rag", "ralm"]] = None  # the one reader method that takes it; None: every reader
    retrieval: bool = False  # says how to retrieve or mix passages: refused by a generation without retrieval
    cost: bool = True  # `high` bounds what a call costs (a caller may go past it); False: the value's own domain
    name: str = ""  # set by option_specs()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def _opt(type_: type, help: str, **kw: Any) -> Any:
    return field(default=None, metadata={"spec": OptionSpec(type_, help, **kw)})


@dataclass(frozen=True)
class GenerationOptions:
    """Per-call generation options (None: the model's stored setting, then :data:`FALLBACK_DEFAULTS`).

    RAG (seq2seq): ``n_docs`` passages marginalized by ``marginalization`` (Eq. 1 RAG-Sequence / Eq. 2 RAG-Token),
    RAG-Sequence ``decoding`` thorough or fast (§2.5). In-Context RALM (causal): re-retrieve every ``stride`` tokens
    with the last ``query_length`` tokens as the query. REPLUG: ``ensemble=K`` documents mixed with weights
    softmax(scores / ``retrieval_temperature``).
    """

    n_docs: Optional[int] = _opt(int, "passages to retrieve per question (default: the model's)", low=1, high=100,
                                 method="rag", retrieval=True)
    num_beams: Optional[int] = _opt(int, "beam width (default: the model's stored setting, else {default})", low=1, high=16)
    marginalization: Optional[str] = _opt(str, "RAG-Sequence (Eq. 1) or RAG-Token (Eq. 2) (default: the model's)",
                                          choices=("sequence", "token"), method="rag", retrieval=True)
    decoding: Optional[str] = _opt(str, "RAG-Sequence decoding (§2.5; default {default})", choices=("thorough", "fast"),
                                   method="rag", retrieval=True)
    max_new_tokens: Optional[int] = _opt(int, "most tokens per answer (default: the model's stored setting, else {default})",
                                         low=1, high=256)
    min_new_tokens: Optional[int] = _opt(int, "fewest tokens per answer (default {default})", low=0, high=256)
    num_return_sequences: Optional[int] = _opt(int, "answers per question, best first (at most num_beams; default {default})",
                                               low=1, high=16)
    length_penalty: Optional[float] = _opt(float, "beam score = log p / length**penalty (default: the model's, else {default})",
                                           low=-10.0, high=10.0)
    no_repeat_ngram_size: Optional[int] = _opt(int,
                                               "never repeat an n-gram of this size (0: off; default: the model's, "
                                               "else {default})",
                                               low=0, high=16)
    early_stopping: Optional[Union[bool, str]] = _opt(object, "beam search stops when num_beams answers are done (true), "
                                                              "by a heuristic (false), or never", choices=(True, False, "never"))
    stride: Optional[int] = _opt(int, "causal LM: generated tokens between retrievals (default {default})", low=1, high=256,
                                 method="ralm", retrieval=True)
    query_length: Optional[int] = _opt(int, "causal LM: the last this-many tokens are the query (default {default})", low=1,
                                       high=4096, method="ralm", retrieval=True)
    retrieval: Optional[str] = _opt(str, "retriever: dense, bm25, or hybrid (both fused: as a RAG model's config says, "
                                         "else by score); default: a RAG model's configured one; a causal LM's bm25 "
                                         "when the knowledge base has a BM25 index, else dense",
                                    choices=("bm25", "dense", "hybrid"), retrieval=True)
    ensemble: Optional[int] = _opt(int, "REPLUG (Shi et al. 2023): mix the next-token distributions of the top-K "
                                        "documents (a RAG model: RAG-Token over K passages)", low=1, high=100, retrieval=True)
    retrieval_temperature: Optional[float] = _opt(float, "causal LM with ensemble: temperature T of the REPLUG weights "
                                                         "softmax(scores / T) (default {default}; at least 1e-4); a "
                                                         "RAG model's is "
                                                         "part of its config",
                                                  low=1e-4, high=1e6, retrieval=True)
    do_sample: Optional[bool] = _opt(bool, "sample instead of greedy decoding (num_beams 1)")
    temperature: Optional[float] = _opt(float, "sampling (do_sample): the next-token scores are divided by T before top-p "
                                               "(default {default})", low=1e-3, high=100.0)
    top_p: Optional[float] = _opt(float, "sampling (do_sample): draw from the smallest set of most likely tokens whose "
                                         "probability reaches P (nucleus sampling; default {default}: all tokens)", low=1e-6,
                                  high=1.0,
                                 cost=False)
    seed: Optional[int] = _opt(int, "causal LM: seed of sampling", low=0, high=2**32 - 1, method="ralm")
    extractive: Optional[bool] = _opt(bool, "answer with a span of a retrieved passage: each answer is a run of whole "
                                            "words from the title or text of the passages read, not starting with a word "
                                            "of the question (default: the model's, else {default})", method="rag",
                                      retrieval=True)

    def __post_init__(self) -> None:
        for name in _SPECS:
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, check_option(name, value))
        for small, large in (("num_return_sequences", "num_beams"), ("min_new_tokens", "max_new_tokens")):
            a, b = getattr(self, small), getattr(self, large)
            if a is not None and b is not None and a > b:
                raise ConfigError(f"{small} ({a}) must not exceed {large} ({b})")
        for name in ("temperature", "top_p"):  # they shape a sampled draw: set without sampling they would do nothing
            if getattr(self, name) is not None and self.do_sample is not True:
                raise ConfigError(f"{name}={getattr(self, name)!r} ({option_specs()[name].flag}) applies to sampling only: "
                                  "set do_sample=true (--sample) too, or drop it")

    @classmethod
    def from_dict(cls, options: dict, *, where: str = "generation options") -> "GenerationOptions":
        """Options from a mapping (a request, a config); an unknown name is a :class:`ConfigError` listing the known."""
        unknown = sorted(set(options) - set(option_specs()))
        if unknown:
            raise ConfigError(f"{where}: unknown option(s) {', '.join(unknown)}; known: {', '.join(option_specs())}")
        return cls(**options)

    def set_options(self) -> dict:
        """``{name: value}`` of the options that were set (the rest take the model's defaults)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}

    def resolve(self, stored: Optional[Mapping] = None, *, trained: bool = True, **config: Any) -> "GenerationConfig":
        """The search settings of a call with these options (and the :class:`GenerationConfig` fields `config`) over a
        model storing `stored` (:func:`resolve_generation`); options that do not shape the search (``n_docs``,
        ``stride``, ...) are the reader's and are not in it."""
        search = {n: v for n, v in self.set_options().items() if n in _SEARCH_OPTIONS}
        return resolve_generation({**search, **config}, stored, trained=trained)


def option_specs() -> dict[str, OptionSpec]:
    """``{name: OptionSpec}`` of every option, in declaration order; a help's ``{default}`` is the table's value now."""
    out = {}
    for f in dataclasses.fields(GenerationOptions):
        spec = f.metadata["spec"]
        shown = _shown(FALLBACK_DEFAULTS[f.name]) if f.name in FALLBACK_DEFAULTS else ""
        out[f.name] = dataclasses.replace(spec, name=f.name, help=spec.help.replace("{default}", shown))
    return out


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"{value:g}" if isinstance(value, float) else str(value)


def reader_options(method: str) -> dict[str, str]:
    """``{name: flag}`` of the options only the `method` reader takes ("rag" or "ralm")."""
    return {n: s.flag for n, s in option_specs().items() if s.method == method}


def retrieval_options() -> dict[str, str]:
    """``{name: flag}`` of the options that say how to retrieve or mix passages."""
    return {n: s.flag for n, s in option_specs().items() if s.retrieval}


def check_option(name: str, value: Any, what: Optional[str] = None, *, per_call: bool = True) -> Union[int, float, str, bool]:
    """`value` if it is valid for option `name` (its type, range and choices), else a :class:`ConfigError` naming
    `what` (default: the option and its flag). ``per_call=False``: without the upper bounds on a call's cost."""
    spec = _SPECS[name]
    what = what or f"{name}={value!r} ({spec.flag} {value})"
    if spec.choices:
        return check_choice(value, what, spec.choices, error=ConfigError)
    if spec.type is bool:
        return check_bool(value, what, error=ConfigError)
    return check_number(value, what, integer=spec.type is int, low=spec.low, high=spec.high if per_call or not spec.cost
                        else None,
                        error=ConfigError)


_SPECS = option_specs()


def _default(name: str) -> Any:
    return field(default=FALLBACK_DEFAULTS[name])


@dataclass(frozen=True)
class GenerationConfig:
    """The resolved search settings (built by :func:`resolve_generation`). Lengths follow transformers:
    `max_length`/`min_length` count the start tokens (the decoder start token of a seq2seq model, the prompt of a
    causal LM). A field that is also a :class:`GenerationOptions` option is checked by that option's range
    (:func:`check_option`, without the per-call upper bound) and defaults to :data:`FALLBACK_DEFAULTS` (except
    ``no_repeat_ngram_size``: 0, off, the search's neutral setting).

    Token ids left as `None` are read from `generator.generation_config`, then `generator.config`.
    """

    max_new_tokens: int = _default("max_new_tokens")
    """Most tokens generated after the start tokens (used when `max_length` is None)."""
    max_length: int | None = None
    """Total output length including the start tokens (transformers' `max_length`); overrides `max_new_tokens`."""
    min_length: int = 0
    """EOS is banned while the output (start tokens included) is shorter than this (transformers' `min_length`)."""
    min_new_tokens: int = _default("min_new_tokens")
    """EOS is banned until this many tokens were generated after the start tokens."""
    num_beams: int = _default("num_beams")
    """Beam width; 1 means greedy search (or sampling with `do_sample`)."""
    num_return_sequences: int = _default("num_return_sequences")
    """Sequences returned per question (RAG-Token: at most `num_beams`; RAG-Sequence: best of all candidates)."""
    length_penalty: float = _default("length_penalty")
    """Finished beams are ranked by `sum_logprob / generated_len ** length_penalty` (0 = no normalisation)."""
    early_stopping: bool | Literal["never"] = _default("early_stopping")
    """True: stop a question once `num_beams` beams finished; False: stop when a running beam cannot beat the
    worst finished one at its current length (transformers' heuristic); "never": canonical beam search bound."""
    no_repeat_ngram_size: int = 0
    """If > 0, no n-gram of this size (over all tokens, start tokens included) occurs twice."""
    forced_bos_token_id: int | None = None
    """Token forced as the first generated token (BART checkpoints use 0). A forced token scores log 1 = 0."""
    forced_eos_token_id: int | None = None
    """Token forced as the last token when `max_length` is reached (BART checkpoints use 2)."""
    decoder_start_token_id: int | None = None
    """Seq2seq only: first decoder input (BART: `</s>`=2, T5: pad=0); from the generator's config when None."""
    eos_token_id: int | None = None
    """End-of-sequence token; from the generator's config when None."""
    pad_token_id: int | None = None
    """Fills sequences after EOS; from the generator's config when None."""
    bos_token_id: int | None = None
    """Only used by the transformers-compatible RAG-Sequence scoring (skips a leading BOS); from the config when None."""
    do_sample: bool = _default("do_sample")
    """Sample the next token (`num_beams=1` only; `sample` with a seeded `torch.Generator`) instead of the argmax."""
    temperature: float = _default("temperature")
    """Sampling: scores are divided by this before top-k / top-p."""
    top_k: int = 0
    """Sampling: keep only the `top_k` most likely tokens (0 = all)."""
    top_p: float = _default("top_p")
    """Sampling: keep the smallest set of most likely tokens whose probability reaches `top_p` (1 = all)."""
    extractive: bool = _default("extractive")
    """RAG decoding: every answer is a word-aligned span of the passages read (:mod:`rag.generation.spans`); no effect
    where no passage is read (closed book)."""

    def __post_init__(self) -> None:
        for name in _SEARCH_OPTIONS:
            check_option(name, getattr(self, name), f"GenerationConfig.{name}", per_call=False)
        check_number(self.max_length, "GenerationConfig.max_length (it counts the start tokens)", integer=True, low=2,
                     allow_none=True, error=ConfigError)
        for name in ("min_length", "top_k"):  # top_k 0 = off
            check_number(getattr(self, name), f"GenerationConfig.{name}", integer=True, low=0, error=ConfigError)
        if self.do_sample and self.num_beams > 1:
            raise ConfigError(f"GenerationConfig.do_sample: sampling needs num_beams=1, got num_beams={self.num_beams!r}")

    @property
    def total_max_length(self) -> int:
        """Output length limit including a single decoder start token."""
        return self.length_limit(1)

    def length_limit(self, prompt_len: int) -> int:
        """Output length limit including `prompt_len` start tokens."""
        return self.max_length if self.max_length is not None else prompt_len + self.max_new_tokens


_SEARCH_OPTIONS = tuple(n for n in _SPECS if n in {f.name for f in dataclasses.fields(GenerationConfig)})
"""The options that shape the search (the rest say how to retrieve and read: the reader's)."""


def resolve_generation(options: Mapping, stored: Optional[Mapping] = None, *, trained: bool = True) -> GenerationConfig:
    """The one resolution of a call's search settings: `options` set by the call (:class:`GenerationConfig` field ->
    value; None: unset), else the model's `stored` settings (``RagModelConfig.generation``), else
    :data:`FALLBACK_DEFAULTS`. A length the call sets (``max_new_tokens`` or ``max_length``) replaces both stored ones.
    `trained`: the generator was trained here, so its fallback ``no_repeat_ngram_size`` is the table's (False: an
    imported checkpoint or a frozen LM, which decodes without one, as its authors' ``generate`` does)."""
    given = {k: v for k, v in options.items() if v is not None}
    kept = {k: v for k, v in (stored or {}).items() if v is not None}
    if "max_new_tokens" in given or "max_length" in given:
        kept.pop("max_new_tokens", None)
        kept.pop("max_length", None)
    table = {k: FALLBACK_DEFAULTS[k] for k in _SEARCH_OPTIONS if k in FALLBACK_DEFAULTS}
    if not trained:
        table.pop("no_repeat_ngram_size")
    return GenerationConfig(**{**table, **kept, **given})
