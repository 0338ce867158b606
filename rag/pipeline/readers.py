"""The readers a pipeline holds, one per method: ``RagReader`` (a RagModel, RAG-Sequence / RAG-Token over a seq2seq or
causal generator, REPLUG's ensemble as RAG-Token) and ``RalmReader`` (a causal LM with In-Context RALM, or REPLUG).

Both satisfy the :class:`Reader` protocol (``method``, ``generator``, ``model``, ``retriever``, ``kb_version``,
``retrieve``, ``generate``), so :class:`~rag.pipeline.api.RagPipeline`, ``rag serve`` and hot swap take either; options
only one method takes are listed in :data:`READER_OPTIONS` and refused for the other, naming the flag.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Literal, Optional, Protocol, Sequence, Union, runtime_checkable

import torch

from rag.utils.errors import ConfigError
from rag.utils.validate import check_number, check_strings

if TYPE_CHECKING:  # pragma: no cover
    from rag.knowledge.knowledge_base import KnowledgeBase
    from rag.models.rag.model import RagModel
    from rag.models.ralm.model import DocumentScorer

from rag.demo.kb import resolve_knowledge_base
from rag.generation.answers import Answer, Retrieval, check_k, retrievals
from rag.generation.options import FALLBACK_DEFAULTS, reader_options, resolve_generation, retrieval_options
from rag.generators.base import Generator
from rag.generators.load import as_generator, check_generator_kind, load_generator
from rag.knowledge.retriever_kinds import KnowledgeBaseRetrievers
from rag.models.rag.generate import answers_with_provenance, closed_book_answers, generate_closed_book, generate_for_questions
from rag.models.ralm.generate import continuation_answer, ralm_generate
from rag.models.ralm.model import InContextRALM, RalmConfig
from rag.models.replug.ensemble import ensemble_over_rag, replug_answers


@runtime_checkable
class Reader(Protocol):
    """What a :class:`RagPipeline` holds: a generator with its retrieval, answering with provenance.

    ``method``: ``"rag"`` (Lewis et al. 2020) | ``"ralm"`` (In-Context RALM and REPLUG, Ram et al. 2023, Shi et al.
    2023), the keys of :data:`READER_OPTIONS`: options of the other method are refused by the pipeline, naming them.
    ``generator``: its LM as a :class:`~rag.generators.base.Generator` (``tokenizer``, ``eos_token_id``);
    ``generator_kind``: its family, ``"seq2seq"`` | ``"causal"``.
    ``continues_prompts``: whether the reader continues raw text token by token (scores a prompt, streams tokens).
    ``retriever``: what a :class:`~rag.knowledge.hotswap.KnowledgeBaseSlot` swaps (``knowledge_base``,
    ``set_knowledge_base``). ``model``: the underlying model. ``retrieve`` / ``generate`` take checked lists of
    strings; every result of one call comes from one knowledge-base version, named in its ``kb_version``.
    """

    method: str
    continues_prompts: bool
    model: Any

    @property
    def generator(self) -> Generator: ...

    @property
    def generator_kind(self) -> str: ...

    @property
    def retriever(self) -> Any: ...

    @property
    def kb_version(self) -> str: ...

    def retrieve(self, questions: Sequence[str], k: int = 5, **options) -> list[Retrieval]: ...

    def generate(self, questions: Sequence[str], **options) -> list[Answer]: ...

    def generate_without_retrieval(self, questions: Sequence[str], **options) -> list[Answer]: ...

    def description(self) -> dict:
        """``method`` (as a server names it), ``generator_kind``, ``extractive``, and ``reader``: the reader's
        method (``rag`` / ``ralm``), which says which of the options in :data:`READER_OPTIONS` it takes."""

    def step_rows(self, options: dict) -> int:
        """Rows (passages x beams) one decoding step with `options` runs: what a server bounds."""


READER_OPTIONS = {method: reader_options(method) for method in ("rag", "ralm")}
"""Per method, the options only it takes: RAG's marginalization over ``n_docs`` passages, In-Context RALM's retrieval."""

RETRIEVAL_OPTIONS = retrieval_options()
"""Options that say how to retrieve or mix passages: a generation without retrieval refuses them."""


def _refuse_retrieval_options(options: dict) -> None:
    """Drop unset retrieval options from `options`; a set one is a :class:`ConfigError` naming its flag."""
    for name, flag in RETRIEVAL_OPTIONS.items():
        if options.get(name) is not None:
            raise ConfigError(f"{name}= ({flag}) says how to retrieve, but this generation retrieves nothing (retrieval=False, "
                              f"--no-retrieval): drop {flag}")
        options.pop(name, None)


READS = {"rag": "a RAG model (RAG-Sequence / RAG-Token over n_docs passages, seq2seq or causal generator)",
         "ralm": "a causal LM with In-Context RALM (a document re-retrieved every --stride tokens)"}


class RagReader:
    """The RAG reader: a :class:`~rag.models.rag.model.RagModel` (RAG-Sequence / RAG-Token, Lewis et al. 2020) with a
    seq2seq or a causal generator (``generator_kind``).

    Thread-safe with respect to knowledge-base swaps: a call reads the knowledge-base
    reference once (inside retrieval) and builds every answer (or retrieval) from that one
    version, which it names in ``kb_version``.
    """

    method = "rag"
    continues_prompts = False

    def __init__(self, model: "RagModel"):
        self.model = model.eval()

    @property
    def generator(self) -> Generator:
        """The RAG model's generator (seq2seq or causal) as a :class:`~rag.generators.base.Generator`."""
        return self.model.lm

    @property
    def generator_kind(self) -> str:
        return self.generator.kind

    def description(self) -> dict:
        """What a server says it reads with: ``method`` (``rag-sequence`` / ``rag-token``: the stored marginalization),
        ``generator_kind`` and ``extractive`` (the stored setting)."""
        config = self.model.config
        stored = dict(config.generation or {})
        return {"method": f"rag-{config.marginalization}", "generator_kind": self.generator_kind,
                "extractive": bool(stored.get("extractive", False)), "reader": self.method}

    def step_rows(self, options: dict) -> int:
        """Rows one decoding step with `options` runs: n_docs x num_beams (closed-book: num_beams); unset = stored."""
        config = self.model.config
        docs = 1 if options.get("retrieval") is False else (options.get("n_docs") or config.n_docs)
        beams = options.get("num_beams") or dict(config.generation or {}).get("num_beams") or FALLBACK_DEFAULTS["num_beams"]
        return int(docs) * int(beams)

    @property
    def retriever(self):
        return self.model.retriever

    # ------------------------------------------------------------------ knowledge base
    @property
    def knowledge_base(self) -> "KnowledgeBase":
        return self.model.knowledge_base

    @property
    def kb_version(self) -> str:
        """The serving knowledge base's version id (``+unverified`` when it was not fully verified on opening)."""
        return self.knowledge_base.served_version

    # ------------------------------------------------------------------ retrieval
    @torch.no_grad()
    def retrieve(self, questions: Sequence[str], k: int = 5, *, retrieval: Optional[str] = None) -> list[Retrieval]:
        """Top-k passages per question with their scores and priors (no generation), one
        :class:`Retrieval` per question naming the knowledge-base version they came from (the
        same for all questions of a call, even if the knowledge base is swapped meanwhile). `retrieval`: another kind
        than the model's for this call."""
        questions = check_strings(questions, "questions")
        if retrieval is not None:
            inputs = self.model.prepare_inputs(questions, n_docs=self._check_k(k, "k"), retrieval=retrieval)
            retrieved, doc_scores = inputs.retrieved, inputs.doc_scores
        else:
            retrieved, doc_scores = self.model.retrieve(questions, n_docs=self._check_k(k, "k"))
        return retrievals(questions, retrieved.kb_version, retrieved.passages, doc_scores,
                          temperature=self.model.retrieval_temperature)

    def _check_k(self, k, name: str) -> int:
        return check_k(k, name, self.knowledge_base)

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(
        self,
        questions: Sequence[str],
        *,
        n_docs: Optional[int] = None,
        num_beams: Optional[int] = None,
        marginalization: Optional[Literal["sequence", "token"]] = None,
        decoding: Optional[Literal["thorough", "fast"]] = None,
        max_new_tokens: Optional[int] = None,
        num_return_sequences: int = 1,
        ensemble: Optional[int] = None,
        retrieval_temperature: Optional[float] = None,
        retrieval: Optional[str] = None,
        **generation_kw,
    ) -> list[Answer]:
        """Answer B questions; returns B * `num_return_sequences` answers, best first per question.

        marginalization: "sequence" (RAG-Sequence: beam search per passage, then Thorough or Fast
            decoding, §2.5) or "token" (RAG-Token: beam search over the marginal transition); default
            the model's own. decoding: RAG-Sequence only. Further keywords go to
            :class:`~rag.generation.decoding.GenerationConfig` (min_length, length_penalty,
            no_repeat_ngram_size, early_stopping, ...). Options left unset take the model's stored defaults
            (``model.config.generation``, e.g. an imported transformers checkpoint's ``num_beams``, ``max_length``,
            ``forced_bos_token_id``), then the generation options' table; an explicit ``max_new_tokens`` or
            ``max_length`` replaces a stored ``max_length``.

        ensemble: REPLUG's ensemble of K documents with a frozen seq2seq generator *is* RAG-Token decoding over K passages
            (the next-token distributions mixed with the retrieval prior at every step), so ``ensemble=K`` means
            ``n_docs=K, marginalization="token"``; combined with a different ``n_docs`` or ``marginalization="sequence"``
            it is refused. retrieval_temperature: a RAG model's is part of its config (``RagModelConfig.retrieval_temperature``,
            set when loading: ``rag.load(path, retrieval_temperature=T)``); passing it here is refused.
        retrieval: ``dense`` | ``bm25`` | ``hybrid`` for this call (default: the model's ``config.retrieval``).
        """
        questions, found = self._generate(questions, False, n_docs, num_beams, marginalization, decoding, max_new_tokens,
                                          num_return_sequences, ensemble=ensemble, retrieval_temperature=retrieval_temperature,
                                          retrieval=retrieval, **generation_kw)
        return answers_with_provenance(self.model, questions, found.inputs, found.contexts, found.output, num_return_sequences,
                             found.marginalization)

    @torch.no_grad()
    def generate_with_and_without_retrieval(self, questions: Sequence[str], **options) -> tuple[list[Answer], list[Answer]]:
        """:meth:`generate`'s answers (same `options`), and the generator's answers to the bare questions (no passage),
        decoded in one batch (the RetRobust back-off's two generations, Yoran et al. 2024 §2.1). The no-retrieval answers
        list no passages; their ``kb_version`` is the call's (nothing was read from it)."""
        questions, found = self._generate(questions, True, **options)
        n_ret = options.get("num_return_sequences", 1)
        return (answers_with_provenance(self.model, questions, found.inputs, found.contexts, found.output, n_ret,
                                        found.marginalization),
                closed_book_answers(self.model, questions, found.no_retrieval, n_ret, found.inputs.retrieved.kb_version))

    @torch.no_grad()
    def generate_without_retrieval(self, questions: Sequence[str], *, num_beams: Optional[int] = None,
                                   max_new_tokens: Optional[int] = None, num_return_sequences: int = 1,
                                   **generation_kw) -> list[Answer]:
        """The generator's answers to the bare questions, nothing retrieved (the closed-book baseline, Lewis et al. 2020
        Table 1; ``rag generate --no-retrieval``): no passages, ``answered_with="no_retrieval"``. Generation options as
        :meth:`generate` (``num_beams``, ``max_new_tokens``, ...); retrieval options (``n_docs``, ``ensemble``, ...) are
        refused."""
        from dataclasses import replace

        questions = check_strings(questions, "questions")
        _refuse_retrieval_options(generation_kw)
        config = self._generation_config(num_beams, max_new_tokens, num_return_sequences, generation_kw)
        out = generate_closed_book(self.model, questions, config)
        return [replace(a, answered_with="no_retrieval")
                for a in closed_book_answers(self.model, questions, out, num_return_sequences, self.kb_version)]

    def _generation_config(self, num_beams, max_new_tokens, num_return_sequences: int, generation_kw: dict):
        """The generation config of a call: explicit options, then the model's stored defaults, then the table's
        (:func:`~rag.generation.options.resolve_generation`)."""
        config = self.model.config
        return resolve_generation({"num_beams": num_beams, "max_new_tokens": max_new_tokens,
                                   "num_return_sequences": num_return_sequences, **generation_kw},
                                  config.generation, trained=not config.hf_compat)

    def _generate(self, questions, with_no_retrieval: bool, n_docs=None, num_beams=None, marginalization=None, decoding=None,
                  max_new_tokens=None, num_return_sequences: int = 1, ensemble=None, retrieval_temperature=None,
                  retrieval=None, **generation_kw):
        questions = check_strings(questions, "questions")
        if retrieval_temperature is not None:
            raise ConfigError("retrieval_temperature= (--retrieval-temperature) of a RAG model is part of its "
                              "config: load it with "
                              "rag.load(path, retrieval_temperature=T) (RagModelConfig.retrieval_temperature), not "
                              "per generate call")
        if ensemble is not None:
            n_docs, marginalization = ensemble_over_rag(ensemble, n_docs, marginalization)
        k = self._check_k(self.model.config.n_docs if n_docs is None else n_docs, "n_docs")
        config = self._generation_config(num_beams, max_new_tokens, num_return_sequences, generation_kw)
        found = generate_for_questions(self.model, questions, config, n_docs=k, marginalization=marginalization,
                                       decoding=decoding, with_no_retrieval=with_no_retrieval, retrieval=retrieval)
        return questions, found


class RalmReader:
    """The causal reader: a frozen decoder-only LM with In-Context RALM (Ram et al. 2023) over a knowledge base.

    Generation re-retrieves every ``stride`` generated tokens with the last ``query_length`` tokens as the query and
    prepends the document (:func:`rag.models.ralm.generate.ralm_generate`); BM25 or dense retrieval per call. A call
    pins one knowledge-base version (:class:`~rag.knowledge.retriever_kinds.KnowledgeBaseRetrievers`), so all its
    retrievals, and every answer's ``kb_version``, come from that version even while the knowledge base is swapped.

    Args:
        model, tokenizer: the causal LM (:func:`~rag.generators.load.load_generator` with ``kind="causal"``).
        knowledge_base: an open KnowledgeBase or its directory.
        config: stride, query length, window and document lengths (:class:`~rag.models.ralm.model.RalmConfig`).
        retrieval: the default ``bm25`` | ``dense`` (None: BM25 when the knowledge base has a BM25 index).
        reranker: optional §6 reranker choosing among ``config.k`` retrieved documents.
    """

    method = "ralm"
    continues_prompts = True

    def __init__(self, model, tokenizer, knowledge_base: Union[str, os.PathLike, "KnowledgeBase"],
                 config: Optional["RalmConfig"] = None, *, retrieval: Optional[str] = None,
                 reranker: Optional["DocumentScorer"] = None):
        if knowledge_base is None:
            raise ConfigError("a causal LM carries no knowledge base: pass knowledge_base=<directory> (--kb DIR)")
        kb = resolve_knowledge_base(knowledge_base)
        if tokenizer is None:  # a CausalGenerator: the one a causal RAG model or a training module holds
            self.generator: Generator = model
        else:
            check_generator_kind(model, "causal", "In-Context RALM (--model)")
            self.generator = as_generator(model, tokenizer)
        self.model, self.tokenizer, self.reranker = self.generator.model.eval(), self.generator.tokenizer, reranker
        self.config = config or RalmConfig()
        self._retriever = KnowledgeBaseRetrievers(kb, retrieval)
        self._ralm(self._retriever, self.config, reranker)  # checks the settings now, not per call

    def _ralm(self, retriever, config: "RalmConfig", reranker) -> InContextRALM:
        """In-Context RALM over this reader's generator (its LM, tokenizer and document layout)."""
        return InContextRALM(self.generator, None, retriever, config, reranker)

    @property
    def generator_kind(self) -> str:
        return self.generator.kind

    def description(self) -> dict:
        """What a server says it reads with: ``method`` (``replug`` with an ensemble, else ``in-context-ralm``),
        ``generator_kind``, ``extractive`` (never)."""
        method = "replug" if self.config.ensemble else "in-context-ralm"
        return {"method": method, "generator_kind": self.generator_kind, "extractive": False,
                "reader": self.method}

    def step_rows(self, options: dict) -> int:
        """Rows one decoding step with `options` runs: ensemble x num_beams (closed-book: num_beams); unset = stored."""
        docs = 1 if options.get("retrieval") is False else (options.get("ensemble") or self.config.ensemble or 1)
        beams = options.get("num_beams") or getattr(self.config, "num_beams", None) or 1
        return int(docs) * int(beams)

    @property
    def retriever(self):
        return self._retriever

    @property
    def knowledge_base(self) -> "KnowledgeBase":
        return self._retriever.knowledge_base

    @property
    def kb_version(self) -> str:
        return self.knowledge_base.served_version

    @torch.no_grad()
    def retrieve(self, questions: Sequence[str], k: int = 5, *, retrieval: Optional[str] = None) -> list[Retrieval]:
        """Top-k passages per question (BM25 or dense, `retrieval`), prior = softmax of the scores."""
        questions = check_strings(questions, "questions")
        served = self._retriever.pin()
        r = served.retriever(retrieval).retrieve(questions, check_k(k, "k", served.knowledge_base))
        return retrievals(questions, r.kb_version, r.passages, r.scores)

    @torch.no_grad()
    def generate(self, questions: Sequence[str], *, stride: Optional[int] = None, query_length: Optional[int] = None,
                 retrieval: Optional[str] = None, max_new_tokens: Optional[int] = None, num_beams: Optional[int] = None,
                 num_return_sequences: int = 1, seed: Optional[int] = None, ensemble: Optional[int] = None,
                 retrieval_temperature: Optional[float] = None, **generation_kw) -> list[Answer]:
        """Continue each prompt (`questions`) with In-Context RALM, or with a REPLUG ensemble; B * `num_return_sequences` answers.

        stride / query_length: ``s`` and ``ℓ`` (default: the reader's config); retrieval: ``bm25`` | ``dense``.
        Greedy by default; ``do_sample=True`` samples (``seed`` makes it reproducible; ``temperature``, ``top_k``,
        ``top_p``); ``num_beams > 1`` runs beam search in which every beam re-retrieves for its own prefix. Further
        keywords go to :class:`~rag.generation.search.GenerationConfig` (``min_new_tokens``, ``no_repeat_ngram_size``).

        ensemble: REPLUG (Shi et al. 2023, §3): the top-K documents for the prompt's last ``ℓ`` tokens are retrieved once,
        each is prepended separately (one KV cache per document) and the K next-token distributions are mixed at every
        step with weights λ = softmax(scores / retrieval_temperature) (default: the reader's config, 1); each answer's
        ``passages`` are the K documents with ``prior`` = λ. Default: the reader's ``config.ensemble`` (None: In-Context RALM).
        """
        return self._generate(questions, False, stride, query_length, retrieval, max_new_tokens, num_beams, num_return_sequences,
                              seed, ensemble=ensemble, retrieval_temperature=retrieval_temperature, **generation_kw)

    @torch.no_grad()
    def generate_with_and_without_retrieval(self, questions: Sequence[str], **options) -> tuple[list[Answer], list[Answer]]:
        """:meth:`generate`'s answers (same `options`), and the LM's continuations of the prompts alone (no document),
        decoded in one batch (the RetRobust back-off's two generations, Yoran et al. 2024 §2.1). The no-retrieval answers
        have no passages or segments; their ``kb_version`` is the call's. With ``do_sample``, one `seed` drives both
        halves' draws."""
        questions = check_strings(questions, "questions")
        answers = self._generate(questions, True, **options)
        n = len(questions) * options.get("num_return_sequences", 1)
        return answers[:n], answers[n:]

    @torch.no_grad()
    def generate_without_retrieval(self, questions: Sequence[str], **options) -> list[Answer]:
        """The LM's continuations of the prompts alone, nothing retrieved (``rag generate --no-retrieval``): no passages or
        segments, ``answered_with="no_retrieval"``. Generation options as :meth:`generate`; retrieval options
        (``stride``, ``ensemble``, ...) are refused."""
        from dataclasses import replace

        _refuse_retrieval_options(options)
        return [replace(a, answered_with="no_retrieval")
                for a in self._generate(questions, False, only_no_retrieval=True, **options)]

    def _generate(self, questions, with_no_retrieval: bool, stride=None, query_length=None, retrieval=None, max_new_tokens=None,
                  num_beams=None, num_return_sequences: int = 1, seed=None, ensemble=None, retrieval_temperature=None,
                  only_no_retrieval: bool = False, **generation_kw) -> list[Answer]:
        from dataclasses import replace

        questions = check_strings(questions, "questions")
        config = resolve_generation({"max_new_tokens": max_new_tokens, "num_beams": num_beams,
                                     "num_return_sequences": num_return_sequences, **generation_kw}, trained=False)
        check_number(seed, "seed (--seed)", integer=True, low=0, allow_none=True, error=ConfigError)
        given = {"stride": stride, "query_length": query_length, "ensemble": ensemble,
                 "retrieval_temperature": retrieval_temperature}
        cfg = replace(self.config, **{name: v for name, v in given.items() if v is not None})
        cfg.check()
        served = self._retriever.pin()  # one knowledge-base version for every retrieval of this call
        if cfg.ensemble is not None:
            check_k(cfg.ensemble, "ensemble", served.knowledge_base)
            if self.reranker is not None:
                raise ConfigError("ensemble= (--ensemble, REPLUG) mixes the top-K retrieved documents; this reader "
                                  "has a reranker "
                                  "choosing one document: drop the reranker or the ensemble")
        ralm = self._ralm(served.retriever(retrieval), cfg, None if cfg.ensemble else self.reranker)
        rng = None
        if seed is not None:
            rng = torch.Generator(device=ralm.scorer.device).manual_seed(seed)
        if only_no_retrieval:
            return [continuation_answer(ralm, c, served.kb_version) for c in ralm_generate(ralm, questions, config, rng=rng,
                                                                                     retrieve=[False] * len(questions))]
        if cfg.ensemble is not None:
            answers = replug_answers(ralm, questions, config, rng, served.kb_version)
            if with_no_retrieval:  # the back-off's other branch: the LM on the prompts alone
                bare = ralm_generate(ralm, questions, config, rng=rng, retrieve=[False] * len(questions))
                answers += [continuation_answer(ralm, c, served.kb_version) for c in bare]
            return answers
        prompts, retrieve = questions, None
        if with_no_retrieval:
            prompts, retrieve = questions + questions, [True] * len(questions) + [False] * len(questions)
        found = ralm_generate(ralm, prompts, config, rng=rng, retrieve=retrieve)
        return [continuation_answer(ralm, c, served.kb_version) for c in found]

    @classmethod
    def load(cls, path_or_name, knowledge_base, *, device=None, retrieval: Optional[str] = None,
             reranker: Optional["DocumentScorer"] = None, **config_overrides) -> "RalmReader":
        """A causal LM directory or name (:func:`~rag.generators.load.load_generator`, e.g. ``"smollm2"``) over
        `knowledge_base`; `config_overrides` are :class:`~rag.models.ralm.model.RalmConfig` fields (``stride=4``, ...)."""
        from dataclasses import fields

        known = {f.name for f in fields(RalmConfig)}
        unknown = sorted(set(config_overrides) - known)
        if unknown:
            raise ConfigError(f"{path_or_name}: is a causal LM (In-Context RALM), which takes no {unknown}; "
                              f"its settings are {sorted(known)} and retrieval=")
        config = RalmConfig(**config_overrides)
        config.check()
        if knowledge_base is None:
            raise ConfigError(f"{path_or_name}: a causal LM carries no knowledge base; pass "
                              f"knowledge_base=<directory> (--kb DIR)")
        model, tok, _ = load_generator(path_or_name, kind="causal")
        if device is not None:
            model = model.to(device)
        return cls(model, tok, knowledge_base, config, retrieval=retrieval, reranker=reranker)
