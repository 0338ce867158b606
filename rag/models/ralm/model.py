"""In-Context RALM (Ram et al. 2023, §3): a frozen causal LM reads one retrieved document prepended to its prefix,
re-retrieving every ``s`` tokens (stride) with a query of the last ``ℓ`` prefix tokens (query length), scored in batches.

A text is tokenized once into a *stream* ``[ctx] + tokens`` (``ctx`` = the tokenizer's BOS, else EOS, so that the
text's first token is scored too). Stream positions ``[a, b)`` of chunk ``j`` are ``a = 1 + j·s, b = min(a + s, n + 1)``;
chunk ``j ≥ 1`` is read after the document retrieved for the query ``stream[max(1, a - ℓ):a]`` (Eq. 4); chunk 0 has
an empty prefix and no retrieval. Every query of a text is known up front, so a text (or a group of texts) needs
one retrieval call. A window is ``doc ∘ stream[c:b]``: when document + prefix + chunk exceed the LM's window the
prefix is cut from the left (the document is already capped at ``doc_max_length`` tokens); the scored chunk is
never cut. Without retrieval the windows are the plain sliding-window ("fixed-length model") perplexity windows.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Optional, Protocol, Sequence

import numpy as np
import torch

from rag.demo.kb import resolve_knowledge_base
from rag.generation.marginalize import doc_log_prior, token_marginal_target_logprobs
from rag.generators.causal import doc_text
from rag.generators.load import as_generator, check_generator_kind
from rag.knowledge.passages import Passage
from rag.knowledge.retriever import Retrieved
from rag.knowledge.retriever_kinds import retriever_for_kind
from rag.models.ralm.prefix_scoring import score_after_documents
from rag.utils.errors import ConfigError, RagError
from rag.utils.validate import check_bool, check_number

__all__ = [
    "RalmConfig", "EvalText", "TextScore", "CausalScorer", "InContextRALM", "DocumentScorer",
    "chunk_spans", "query_spans", "window_start", "window_ids", "own_document_filter", "retrieve_excluding", "random_passages",
    "doc_text", "open_retriever",
]

DEFAULT_MAX_LENGTH = 1024  # the paper's sequence length (§4.2)
HEAD_ROWS = 1024  # scored positions per LM-head call: bounds the (rows, vocab) logits in memory
WINDOW_SLICE = 4096  # windows built (as token lists) at a time


@dataclass
class RalmConfig:
    """In-Context RALM settings (Ram et al. 2023, §3.2 and §4.3)."""

    stride: int = 4
    """Retrieval stride ``s``: tokens scored between two retrievals (``--stride``)."""
    query_length: int = 32
    """Retrieval query length ``ℓ``: the last ``ℓ`` prefix tokens form the query (``--query-length``)."""
    max_length: Optional[int] = None
    """The LM's window in tokens (``--max-length``); None: min(the model's positions, 1024)."""
    doc_max_length: int = 256
    """Retrieved documents are cut to this many tokens (§4.3) (``--doc-max-length``)."""
    k: int = 16
    """Documents retrieved per query when a reranker chooses among them (§6: top-16)."""
    exclude_own: bool = True
    """Leakage guard: never retrieve passages of the evaluated text's own document (same id or title)."""
    batch_size: int = 8
    """Windows per LM forward pass (CPU: small batches are fastest; GPU: raise it)."""
    retrieval_batch: int = 4096
    """Most queries per retrieval call (texts are grouped until this many)."""
    ensemble: Optional[int] = None
    """REPLUG (Shi et al. 2023, §3.2) (``--ensemble K``): each chunk is read after each of its top-K documents
    separately and the K next-token distributions are mixed in probability space with weights
    λ = softmax(scores / retrieval_temperature). None: In-Context RALM's single document."""
    retrieval_temperature: float = 1.0
    """REPLUG: temperature of the retrieval scores in the weights λ (``--retrieval-temperature``); the same setting as
    RAG's ``RagModelConfig.retrieval_temperature`` and REPLUG LSR's ``retrieval_temperature`` (γ)."""
    random_docs: bool = False
    """REPLUG control (Fig. 4, ``--random-docs``): K random passages with equal weights instead of the top-K."""
    seed: int = 0
    """Seed of the random passages of ``random_docs``."""
    window_step: Optional[int] = None
    """Without retrieval (the plain sliding-window LM): tokens each window scores (``--window-step``); None: half the
    window, (max_length − 1) // 2. Unused with retrieval, whose windows advance by ``stride``."""

    def check(self) -> None:
        for name, flag in (("stride", "--stride"), ("query_length", "--query-length"), ("doc_max_length", "--doc-max-length"),
                           ("k", "--rerank-k"), ("batch_size", "--batch-size"), ("retrieval_batch", "retrieval_batch")):
            check_number(getattr(self, name), f"{name} ({flag})", integer=True, low=1, error=ConfigError)
        check_number(self.max_length, "max_length (--max-length)", integer=True, low=2, allow_none=True, error=ConfigError)
        check_number(self.ensemble, "ensemble (--ensemble, documents per chunk)", integer=True, low=1, allow_none=True,
                     error=ConfigError)
        check_number(self.window_step, "window_step (--window-step)", integer=True, low=1, allow_none=True, error=ConfigError)
        check_number(self.seed, "seed (--seed)", integer=True, low=0, error=ConfigError)
        check_bool(self.exclude_own, "exclude_own", error=ConfigError)
        check_bool(self.random_docs, "random_docs (--random-docs)", error=ConfigError)
        # Any T > 0 is computed in log space (doc_log_prior shifts the scores by their maximum first): as T -> 0 the
        # weights tend to one-hot on the best document, never to NaN.
        check_number(self.retrieval_temperature, "retrieval_temperature (--retrieval-temperature)", above=0, error=ConfigError)
        if self.random_docs and self.ensemble is None:
            raise ConfigError("random_docs (--random-docs) replaces REPLUG's top-K documents; pass --ensemble K too")


@dataclass(frozen=True)
class EvalText:
    """One text to score; ``id`` / ``title`` name its source document for the leakage guard."""

    text: str
    id: Optional[str] = None
    title: Optional[str] = None


@dataclass
class TextScore:
    """Per-token log-likelihoods of one text.

    Attributes:
        token_logprobs: ``(n_tokens,)`` float64 log p(x_i | window), each text token exactly once, in order.
        tokens: ``(n_tokens,)`` int64 the text's token ids.
        doc_ids: per chunk, the id of the passage in context (None: no retrieval for that chunk).
    """

    id: Optional[str]
    token_logprobs: np.ndarray
    tokens: np.ndarray
    n_words: int
    n_bytes: int
    doc_ids: list = field(default_factory=list)


# ---------------------------------------------------------------------------- positions and windows (pure)


def chunk_spans(n_tokens: int, stride: int) -> list[tuple[int, int]]:
    """Stream positions ``[a, b)`` scored together, for a stream ``[ctx] + n_tokens`` tokens: ``a = 1 + j·stride``."""
    return [(a, min(a + stride, n_tokens + 1)) for a in range(1, n_tokens + 1, stride)]


def query_spans(spans: Sequence[tuple[int, int]], query_length: int) -> list[Optional[tuple[int, int]]]:
    """Per chunk, the stream span of its retrieval query ``q_j = x_{s·j-ℓ+1..s·j}`` (Eq. 4): the last ``query_length``
    text tokens before the chunk (never the ctx token); None for the first chunk, whose prefix is empty."""
    return [None if a <= 1 else (max(1, a - query_length), a) for a, _ in spans]


def window_start(start: int, end: int, doc_len: int, max_length: int) -> int:
    """``c``: where the prefix kept before ``stream[start:end]`` begins when a document of ``doc_len`` tokens comes first."""
    budget = max_length - doc_len - (end - start)
    if budget < 1:
        raise ConfigError(
            f"a document of {doc_len} tokens + {end - start} scored tokens + 1 prefix token cannot fit the LM's window of "
            f"{max_length} tokens; lower --doc-max-length or --stride, or raise --max-length"
        )
    return max(0, start - budget)


def window_ids(stream: Sequence[int], start: int, end: int, doc: Sequence[int], max_length: int) -> list[int]:
    """``doc ∘ stream[c:end]``, the prefix ``stream[c:start]`` cut from the left so the window fits ``max_length``;
    the scored tokens ``stream[start:end]`` and the one token before them are always kept."""
    return list(doc) + list(stream[window_start(start, end, len(doc), max_length):end])


def own_document_filter(text: EvalText) -> Optional[Callable[[Passage], bool]]:
    """The leakage guard for `text` (the paper's forbidden titles, §4.3): True for a passage of its own document —
    same title, same id, or a chunk ``"<id>-<n>"`` of it. None when the text names no source."""
    if not text.id and not text.title:
        return None
    chunk = re.compile(re.escape(text.id) + r"-\d+") if text.id else None

    def is_own(p: Passage) -> bool:
        return bool((text.title and p.title == text.title) or (text.id and (p.id == text.id or chunk.fullmatch(p.id))))

    return is_own


def _corpus_size(retriever) -> Optional[int]:
    kb = getattr(retriever, "knowledge_base", None)
    if kb is not None:
        return len(kb)
    index = getattr(retriever, "index", None)
    return len(index) if index is not None and hasattr(index, "__len__") else None


def retrieve_excluding(retriever, queries: Sequence[str], k: int,
                       exclude: Sequence[Optional[Callable[[Passage], bool]]]) -> list[list[tuple[Passage, float]]]:
    """Top-`k` passages per query, skipping those ``exclude[i]`` rejects, in one retrieval call (a second, deeper one
    only for the queries that lost too many passages). Returns per query `k` ``(passage, score)`` pairs, best first."""
    n = _corpus_size(retriever)
    need = [f is not None for f in exclude]
    fetch = k + (8 if any(need) else 0)
    if n is not None:
        fetch = min(fetch, n)
        if k > n:
            raise ConfigError(f"k={k} documents asked per query but the knowledge base holds {n}; lower --rerank-k")
    out: list[Optional[list]] = [None] * len(queries)
    todo = list(range(len(queries)))
    while todo:
        r: Retrieved = retriever.retrieve([queries[i] for i in todo], fetch)
        again = []
        for row, i in enumerate(todo):
            keep = [(p, float(s)) for p, s in zip(r.passages[row], r.scores[row].tolist()) if exclude[i] is None
                    or not exclude[i](p)]
            if len(keep) >= k or (n is not None and fetch >= n):
                if len(keep) < k:
                    raise RagError(
                        f"only {len(keep)} passages remain for query {queries[i]!r} after excluding the evaluated text's own "
                        f"document; lower --rerank-k or pass --no-exclude-own"
                    )
                out[i] = keep[:k]
            else:
                again.append(i)
        todo, fetch = again, (fetch * 4 if n is None else min(n, fetch * 4))
    return out  # type: ignore[return-value]


def random_passages(retriever, n_queries: int, k: int, exclude: Sequence[Optional[Callable[[Passage], bool]]], *,
                    seed: int = 0) -> list[list[Passage]]:
    """`k` distinct passages drawn uniformly from the retriever's corpus per query, skipping those ``exclude[i]`` rejects
    (REPLUG's random-document control, Shi et al. 2023 Fig. 4)."""
    n = _corpus_size(retriever)
    kb = getattr(retriever, "knowledge_base", None)
    lookup = kb.get_passages if kb is not None else getattr(getattr(retriever, "_source", None), "lookup", None)
    if n is None or lookup is None:
        raise ConfigError(f"--random-docs needs a retriever over a knowledge base of known size; "
                          f"{type(retriever).__name__} has none")
    if k > n:
        raise ConfigError(f"--ensemble {k} random documents per chunk but the knowledge base holds {n}; lower --ensemble")
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n_queries):
        keep: list[Passage] = []
        order = rng.permutation(n)
        for lo in range(0, n, k + 8):  # a few spare rows per lookup, for the excluded ones
            block = order[lo:lo + k + 8]
            keep += [p for p in lookup(block[None, :].astype(np.int64))[0] if exclude[i] is None or not exclude[i](p)]
            if len(keep) >= k:
                keep = keep[:k]
                break
        if len(keep) < k:
            raise RagError(f"only {len(keep)} passages remain after excluding the evaluated text's own document; "
                           f"lower --ensemble "
                           "or pass --no-exclude-own")
        out.append(keep)
    return out


def open_retriever(kind: str, kb_path):
    """The retriever `kind` (``bm25`` | ``dense`` | ``none``, the ``--retrieval`` option) over the knowledge base at
    `kb_path` (``--kb``); None for ``none``. BM25 needs the knowledge base's stored index (``rag index build --bm25``)."""
    if kind == "none":
        return None
    if kb_path is None:
        raise ConfigError(f"--retrieval {kind} needs --kb DIR (a knowledge base from `rag index build`), or pass "
                          f"--retrieval none")
    return retriever_for_kind(kind, resolve_knowledge_base(kb_path))


# ---------------------------------------------------------------------------- the LM side


class CausalScorer:
    """In-Context RALM's scoring over a causal :class:`~rag.generators.causal.CausalGenerator` (its LM, tokenizer, pad
    and the ``doc ∘ [ctx] ∘ text`` layout it tokenizes): windows scored in right-padded batches, logits computed only at
    the scored positions.

    `lm`: the generator, or a causal LM with its `tokenizer` (wrapped in one).
    """

    def __init__(self, lm, tokenizer=None, *, max_length: Optional[int] = None, doc_max_length: int = 256, batch_size: int = 8):
        check_generator_kind(lm.model if tokenizer is None else lm, "causal", "In-Context RALM (--model / --rerank-model)")
        generator = lm if tokenizer is None else as_generator(lm, tokenizer)
        generator.check_layout_tokens()
        self.generator = generator
        generator.model.eval()
        cfg = generator.model.config
        positions = getattr(cfg, "n_positions", None) or getattr(cfg, "max_position_embeddings", None) or DEFAULT_MAX_LENGTH
        self.max_length = int(max_length) if max_length is not None else min(int(positions), DEFAULT_MAX_LENGTH)
        if self.max_length > positions:
            raise ConfigError(f"--max-length {self.max_length} exceeds the LM's {positions} positions; lower it")
        self.doc_max_length, self.batch_size = int(doc_max_length), int(batch_size)

    @property
    def model(self):
        return self.generator.model

    @property
    def tokenizer(self):
        return self.generator.tokenizer

    @property
    def ctx_id(self) -> int:
        return self.generator.context_token_id

    @property
    def pad_id(self) -> int:
        return self.generator.padding_id

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def stream(self, text: str) -> list[int]:
        """``[ctx] + tokens(text)``: the text tokenized once, without special tokens (the generator's layout)."""
        return self.generator.stream(text)

    def doc_tokens(self, passages: Iterable[Passage]) -> list[list[int]]:
        """Token ids of each passage (:func:`doc_text`, cut to ``doc_max_length``), tokenized once by the generator."""
        return self.generator.document_ids(passages, self.doc_max_length)

    def clear_cache(self) -> None:
        self.generator.clear_documents()

    def _split_head(self):
        """``(base, head)`` when ``head(base(x).last_hidden_state)`` reproduces the model's logits (checked once on a short
        input), so logits can be computed only at the scored positions; else None (full logits, then gather)."""
        base, head = getattr(self.model, "base_model", None), self.model.get_output_embeddings()
        if base is None or base is self.model or head is None:
            return None
        x = torch.tensor([[self.ctx_id] * 4], device=self.device)
        with torch.no_grad():
            try:
                ok = torch.allclose(head(base(input_ids=x).last_hidden_state).float(), self.model(input_ids=x).logits.float(),
                                    atol=1e-4, rtol=1e-4)
            except (TypeError, AttributeError, RuntimeError):
                ok = False
        return (base, head) if ok else None

    @property
    def head_split(self):
        """``(base, head)`` of :meth:`_split_head`, checked once; None: the model's full logits are used."""
        if not hasattr(self, "_head"):
            self._head = self._split_head()
        return self._head

    def target_logprobs(self, states: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """log p(target) ``(rows,)`` float32 from ``(rows, hidden)`` states (LM head split) or ``(rows, vocab)`` logits; the
        head runs ``HEAD_ROWS`` rows at a time."""
        if not len(targets):
            return torch.zeros(0)
        if self.head_split is None:
            return torch.log_softmax(states.float(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        head = self.head_split[1]
        rows = range(0, len(targets), HEAD_ROWS)
        return torch.cat([torch.log_softmax(head(states[k:k + HEAD_ROWS]).float(), -1)
                          .gather(-1, targets[k:k + HEAD_ROWS, None]).squeeze(-1) for k in rows])

    def score(self, windows: Sequence[Sequence[int]], n_scored: Sequence[int], *, progress=None) -> list[np.ndarray]:
        """log p of the last ``n_scored[i]`` tokens of ``windows[i]`` given the tokens before them: ``(n_scored[i],)`` each."""
        return self.score_positions(windows, [range(len(w) - m, len(w)) for w, m in zip(windows, n_scored)], progress=progress)

    def positions_logprobs(self, windows: Sequence[Sequence[int]],
                           positions: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """One right-padded pass over `windows` (gradients flow when enabled): log p(window[t] | window[:t]) at each ``t``
        of ``positions[i]`` (every ``t >= 1``), concatenated ``(rows,)`` float32, and each row's window index ``(rows,)``.

        A causal LM never attends to later positions, so the pads cannot change a real position's output, and position
        ids stay 0..len-1 (no attention mask needed). The LM head runs only at the scored positions."""
        dev = self.device
        width = max(len(w) for w in windows)
        ids = torch.full((len(windows), width), self.pad_id, dtype=torch.long)
        rows, cols = [], []
        for r, (w, pos) in enumerate(zip(windows, positions)):
            pos = list(pos)
            if pos and (min(pos) < 1 or max(pos) >= len(w)):
                raise RagError(f"window {r}: scored positions must lie in [1, {len(w)}), got {min(pos)}..{max(pos)}")
            ids[r, :len(w)] = torch.as_tensor(w, dtype=torch.long)
            rows += [r] * len(pos)
            cols += pos
        ids = ids.to(dev)
        r_t, c_t = torch.as_tensor(rows, dtype=torch.long, device=dev), torch.as_tensor(cols, dtype=torch.long, device=dev)
        if self.head_split is not None:
            states = self.head_split[0](input_ids=ids).last_hidden_state[r_t, c_t - 1]
        else:
            states = self.model(input_ids=ids).logits[r_t, c_t - 1]
        return self.target_logprobs(states, ids[r_t, c_t]), r_t

    @torch.no_grad()
    def score_positions(self, windows: Sequence[Sequence[int]], positions: Sequence[Sequence[int]], *,
                        progress=None) -> list[np.ndarray]:
        """log p(window[t] | window[:t]) at each ``t`` of ``positions[i]`` (every ``t >= 1``): a float64 array per window.

        Windows are sorted by length and run ``batch_size`` at a time (:meth:`positions_logprobs`), the LM head
        ``HEAD_ROWS`` rows at a time.
        """
        order = sorted(range(len(windows)), key=lambda i: len(windows[i]))
        out: list[Optional[np.ndarray]] = [None] * len(windows)
        for lo in range(0, len(order), self.batch_size):
            idx = order[lo:lo + self.batch_size]
            lp, _ = self.positions_logprobs([windows[i] for i in idx], [positions[i] for i in idx])
            lp = lp.double().cpu().numpy()
            at = 0
            for i in idx:
                n = len(positions[i])
                out[i] = lp[at:at + n]
                at += n
            if progress is not None:
                progress.update(sum(len(positions[i]) for i in idx))
        return out  # type: ignore[return-value]


class DocumentScorer(Protocol):
    """Scores a chunk's retrieved candidate documents for In-Context RALM's reranking (§6): ``(n_requests, k)``, higher =
    better (:class:`~rag.models.ralm.rerank.LMReranker`, :class:`~rag.models.ralm.rerank.PredictiveReranker`). Not the retrieval
    :class:`~rag.knowledge.types.Reranker`, which reorders a :class:`Retrieved` for query strings."""

    def scores(self, ralm: "InContextRALM", requests: Sequence[tuple[list[int], int, list[Passage]]]) -> np.ndarray:
        """`requests`: ``(stream, a, candidates)`` — the main LM's stream, the chunk start, the k candidates."""
        ...


# ---------------------------------------------------------------------------- the loop


class InContextRALM:
    """In-Context RALM over a causal LM and any retriever with ``retrieve(queries, k) -> Retrieved`` (dense or BM25).

    ``retriever=None`` gives the plain sliding-window LM, whatever ``config.stride`` says (it is the retrieval stride):
    windows of ``max_length`` tokens advancing by :attr:`window_step` tokens (default (max_length − 1) // 2), each
    scoring its last ``window_step`` tokens, so every token is predicted from at least max_length − window_step (by
    default more than half the window) preceding tokens, or all of them near the start, and the LM reads about
    max_length / window_step (by default 2) times the text's tokens. `reranker` (§6) chooses among the top ``config.k``.
    `model`: a causal LM with its `tokenizer`, or a :class:`~rag.generators.causal.CausalGenerator` (`tokenizer` None).
    `scorer`: a :class:`CausalScorer` to use instead of one over `model` (e.g. a black-box LM behind an OpenAI-compatible
    endpoint, :class:`~rag.models.replug.lm_scorer.RemoteCausalScorer`, which scores whole windows: ``scorer.whole_windows``).
    """

    def __init__(self, model, tokenizer, retriever=None, config: Optional[RalmConfig] = None,
                 reranker: Optional[DocumentScorer] = None,
                 *, scorer: Optional[CausalScorer] = None):
        self.config = config or RalmConfig()
        self.config.check()
        self.scorer = scorer if scorer is not None else CausalScorer(
            model, tokenizer, max_length=self.config.max_length, doc_max_length=self.config.doc_max_length,
            batch_size=self.config.batch_size)
        self.retriever, self.reranker = retriever, reranker
        if self.config.ensemble is not None and (reranker is not None or retriever is None):
            raise ConfigError("--ensemble (REPLUG) mixes the top-K retrieved documents: it needs retrieval "
                              "(--retrieval bm25|dense) "
                              "and no --rerank")
        fixed_k = getattr(reranker, "rank_prior", 0)  # a reranker that learned one bias per retriever rank
        if fixed_k and fixed_k != self.config.k:
            raise ConfigError(f"the reranker was trained on the retriever's top {fixed_k} (its rank_prior) but --rerank-k is "
                              f"{self.config.k}; pass --rerank-k {fixed_k}")
        need = (self.config.doc_max_length if retriever is not None else 0) + self.stride + 1
        if need > self.scorer.max_length:
            raise ConfigError(
                f"a document of up to {self.config.doc_max_length} tokens (--doc-max-length) + a stride of {self.config.stride} "
                f"tokens (--stride) + 1 prefix token need {need} positions and cannot fit the LM's window of "
                f"{self.scorer.max_length} "
                "(--max-length); lower --doc-max-length or --stride"
            )

    @property
    def tokenizer(self):
        return self.scorer.tokenizer

    @property
    def window_step(self) -> int:
        """Tokens scored per window of the plain sliding-window LM (no retriever): ``config.window_step``, by default
        (max_length − 1) // 2."""
        if self.config.window_step is not None:
            return self.config.window_step
        return max(1, (self.scorer.max_length - 1) // 2)

    @property
    def stride(self) -> int:
        """Tokens scored per chunk: the retrieval stride ``config.stride``, or :attr:`window_step` without a retriever
        (plain perplexity does not depend on a retrieval stride; a stride of 4 would run one window per 4 tokens)."""
        return self.config.stride if self.retriever is not None else self.window_step

    def plan(self, stream: Sequence[int]) -> tuple[list[tuple[int, int]], list[Optional[str]]]:
        """Chunk spans of a stream and, per chunk, its retrieval query text (None: no retrieval)."""
        spans = chunk_spans(len(stream) - 1, self.stride)
        if self.retriever is None:
            return spans, [None] * len(spans)
        qs = query_spans(spans, self.config.query_length)
        texts = self.tokenizer.batch_decode([list(stream[q0:q1]) for q0, q1 in (q for q in qs if q is not None)])
        it = iter(texts)
        return spans, [None if q is None else next(it) for q in qs]

    def score_texts(self, texts: Iterable[EvalText], *, progress: bool = False) -> Iterator[TextScore]:
        """Per-token log-likelihoods of each text, in order (texts grouped so that one retrieval call serves a group)."""
        from tqdm.auto import tqdm

        cfg = self.config
        bar = tqdm(desc="lm-eval", unit="tok", disable=not progress, dynamic_ncols=True)
        group: list[tuple[EvalText, list[int]]] = []
        n_queries = 0
        try:
            for t in texts:
                if not isinstance(t, EvalText):
                    t = EvalText(str(t))
                stream = self.scorer.stream(t.text)
                n = len(stream) - 1
                if n < 1 or (self.retriever is not None and n < cfg.stride):
                    raise RagError(f"text {t.id or repr(t.text[:40])}: {n} tokens, shorter than one stride (--stride "
                                   f"{cfg.stride}); "
                                   "use a smaller --stride or drop the text")
                group.append((t, stream))
                n_queries += (n - 1) // self.stride
                if n_queries >= cfg.retrieval_batch:
                    yield from self._score_group(group, bar)
                    group, n_queries = [], 0
            if group:
                yield from self._score_group(group, bar)
        finally:
            bar.close()

    def _chunk_documents(self, group, plans, flat) -> dict[tuple[int, int], tuple[list[Passage], Optional[np.ndarray]]]:
        """Per retrieving chunk ``(g, j)``: the documents it is read after, and (REPLUG ensembles) their retrieval scores
        (None: equal weights). In-Context RALM: one document, the retriever's first or the reranker's choice."""
        cfg = self.config
        guards = [own_document_filter(group[g][0]) if cfg.exclude_own else None for g, _, _ in flat]
        if cfg.ensemble is not None:
            n = _corpus_size(self.retriever)
            if n is not None and cfg.ensemble > n:
                raise ConfigError(f"--ensemble {cfg.ensemble} documents per chunk but the knowledge base holds {n}; "
                                  f"lower --ensemble")
            if cfg.random_docs:
                picks = random_passages(self.retriever, len(flat), cfg.ensemble, guards, seed=cfg.seed)
                return {(g, j): (ps, None) for (g, j, _), ps in zip(flat, picks)}
            cands = retrieve_excluding(self.retriever, [q for _, _, q in flat], cfg.ensemble, guards)
            return {(g, j): ([p for p, _ in c], np.asarray([s for _, s in c], dtype=np.float64))
                    for (g, j, _), c in zip(flat, cands)}
        k = cfg.k if self.reranker is not None else 1
        cands = retrieve_excluding(self.retriever, [q for _, _, q in flat], k, guards)
        if self.reranker is not None:
            reqs = [(group[g][1], plans[g][0][j][0], [p for p, _ in c]) for (g, j, _), c in zip(flat, cands)]
            best = np.asarray(self.reranker.scores(self, reqs)).argmax(axis=1)
        else:
            best = np.zeros(len(flat), dtype=np.int64)
        return {(g, j): ([c[int(b)][0]], None) for (g, j, _), c, b in zip(flat, cands, best)}

    def _score_group(self, group: list[tuple[EvalText, list[int]]], bar) -> Iterator[TextScore]:
        cfg = self.config
        plans = [self.plan(stream) for _, stream in group]
        flat = [(g, j, q) for g, (_, qs) in enumerate(plans) for j, q in enumerate(qs) if q is not None]
        chosen = self._chunk_documents(group, plans, flat) if flat else {}
        unique = {(p.id, p.title, p.text): p for ps, _ in chosen.values() for p in ps}
        tokens = dict(zip(unique, self.scorer.doc_tokens(unique.values())))
        # Chunks of a text that read the same document after the same prefix cut have windows that are prefixes of one
        # another (before the prefix needs cutting, every chunk that retrieved d reads d ∘ stream[0:b]): one window, the
        # longest, scores them all — the causal LM gives each position the same context as in its own window. A REPLUG
        # chunk has one window per document; all of them are scored in the same batched passes.
        merged: dict[tuple, list] = {}
        L = self.scorer.max_length
        for g, (spans, _) in enumerate(plans):
            for j, (a, b) in enumerate(spans):
                for i, p in enumerate(chosen[(g, j)][0] if (g, j) in chosen else [None]):
                    key = None if p is None else (p.id, p.title, p.text)
                    doc = tokens[key] if p is not None else ()
                    merged.setdefault((g, key, window_start(a, b, len(doc), L)), [doc, []])[1].append((j, i, a, b))
        per_doc: dict[tuple[int, int, int], np.ndarray] = {}
        items = list(merged.items())
        for lo in range(0, len(items), WINDOW_SLICE):  # windows are built a slice at a time: a long text has many
            lps = self._score_windows(group, items[lo:lo + WINDOW_SLICE], bar)
            for ((g, _, _), (_, chunks)), lp in zip(items[lo:lo + WINDOW_SLICE], lps):
                at = 0
                for j, i, a, b in chunks:
                    per_doc[(g, j, i)] = lp[at:at + b - a]
                    at += b - a
        self.scorer.clear_cache()
        per_chunk = self._mix(plans, chosen, per_doc)
        for g, ((t, stream), (spans, _)) in enumerate(zip(group, plans)):
            lp = np.concatenate([per_chunk[(g, j)] for j in range(len(spans))])
            doc_ids = [None if (g, j) not in chosen
                       else (chosen[(g, j)][0][0].id if cfg.ensemble is None else [p.id for p in chosen[(g, j)][0]])
                       for j in range(len(spans))]
            yield TextScore(t.id, lp, np.asarray(stream[1:], dtype=np.int64), len(t.text.split()), len(t.text.encode("utf-8")),
                            doc_ids)

    def _score_windows(self, group, items, bar) -> list[np.ndarray]:
        """Log-probabilities of the windows ``doc ∘ stream[c:b]`` of `items` (``((g, doc key, c), (doc, chunks))``) at
        their chunks' positions. Windows after a document share its keys and values
        (:func:`~rag.models.ralm.prefix_scoring.score_after_documents`: a document retrieved for several texts or cuts runs
        through the LM once per block); windows without one (the first chunk) are scored whole."""
        out: list = [None] * len(items)
        plain, after, doc_index, docs = [], [], {}, []
        for n, ((g, key, c), (doc, chunks)) in enumerate(items):
            suffix = list(group[g][1][c:max(b for *_, b in chunks)])
            positions = [len(doc) + t - c for _, _, a, b in chunks for t in range(a, b)]
            if key is None:
                plain.append((n, suffix, positions))
                continue
            if key not in doc_index:
                doc_index[key] = len(docs)
                docs.append(list(doc))
            after.append((n, (doc_index[key], suffix, positions)))
        if plain:
            for (n, _, _), lp in zip(plain,
                                     self.scorer.score_positions([w for _, w, _ in plain], [p for *_, p in plain], progress=bar)):
                out[n] = lp
        if after and getattr(self.scorer, "whole_windows", False):  # a black-box LM shares no keys/values: doc ∘ suffix each
            windows = [(docs[d] + list(suffix), positions) for _, (d, suffix, positions) in after]
            for (n, _), lp in zip(after,
                                  self.scorer.score_positions([w for w, _ in windows], [p for _, p in windows], progress=bar)):
                out[n] = lp
        elif after:
            for (n, _), lp in zip(after, score_after_documents(self.scorer, docs, [w for _, w in after], progress=bar)):
                out[n] = lp
        return out

    def _mix(self, plans, chosen, per_doc) -> dict[tuple[int, int], np.ndarray]:
        """Per chunk, the log-probabilities of its tokens: its one window's, or (REPLUG) the per-token mixture
        log Σ_d λ(d, x) p(y | d ∘ x) of its documents' windows
        (:func:`~rag.generation.marginalize.token_marginal_target_logprobs`), all chunks of the group in one call."""
        out: dict[tuple[int, int], np.ndarray] = {}
        mixed = []
        for g, (spans, _) in enumerate(plans):
            for j in range(len(spans)):
                if self.config.ensemble is None or (g, j) not in chosen:
                    out[(g, j)] = per_doc[(g, j, 0)]  # one window (chunk 0 has no retrieval)
                else:
                    mixed.append((g, j))
        if mixed:
            k = self.config.ensemble
            width = max(len(per_doc[(g, j, 0)]) for g, j in mixed)
            lp = torch.zeros(len(mixed), k, width, dtype=torch.float64)
            mask = torch.zeros(len(mixed), width, dtype=torch.bool)
            scores = torch.zeros(len(mixed), k, dtype=torch.float64)
            for r, (g, j) in enumerate(mixed):
                for i in range(k):
                    row = per_doc[(g, j, i)]
                    lp[r, i, :len(row)] = torch.from_numpy(row)
                mask[r, :len(per_doc[(g, j, 0)])] = True
                s = chosen[(g, j)][1]
                if s is not None:
                    scores[r] = torch.from_numpy(s)
            prior = doc_log_prior(scores, temperature=self.config.retrieval_temperature)  # (chunks, K) log λ(d, x)
            mix = token_marginal_target_logprobs(lp, prior, mask=mask).numpy()
            for r, (g, j) in enumerate(mixed):
                out[(g, j)] = mix[r, :mask[r].sum()]
        return out
