"""Black-box language models for REPLUG (Shi et al. 2023, §3, §4.2): "log-probs of given continuation tokens given a prompt".

An :class:`LMScorer` returns, for each (prompt, continuation) pair, the log-probability of every continuation token given
the prompt and the tokens before it — nothing else of the LM is needed (no logits, no parameters). Two implementations:

* :class:`LocalLMScorer`: a transformers causal LM on this machine (batched, one forward pass per batch);
* :class:`CompletionsLMScorer`: any OpenAI-compatible ``/v1/completions`` endpoint that returns prompt log-probs
  (``echo=True, logprobs=1, max_tokens=0``, as vLLM and ``rag serve`` serve them), over httpx with a timeout, bounded
  retries and clear errors when the endpoint fails, times out or returns no log-probs.

:class:`RemoteCausalScorer` puts such an endpoint under In-Context RALM's evaluation (``rag lm-eval --lm-endpoint``,
REPLUG's ensemble included): windows of token ids are sent as token-id prompts and scored by the endpoint; only the
tokenizer is loaded here.

:class:`ScoreCache` memoises scores by (LM identity, document, input, continuation), so REPLUG LSR never asks the LM
for the same pair twice (:func:`document_logprobs`).
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from typing import Optional, Protocol, Sequence, runtime_checkable

import numpy as np
import torch

from rag.generation.causal import continuation_logprobs
from rag.generators.causal import CausalGenerator
from rag.generators.demo_lm import DEMO_LM_NAMES, prepare_demo_lm
from rag.generators.load import check_generator_kind
from rag.knowledge.encoders import resolve_name_or_path
from rag.models.ralm.model import DEFAULT_MAX_LENGTH, CausalScorer
from rag.utils.errors import ConfigError, RagError
from rag.utils.validate import check_number, check_positive_int

logger = logging.getLogger(__name__)

__all__ = ["LMScorer", "LocalLMScorer", "CompletionsLMScorer", "RemoteCausalScorer", "LMEndpointError", "ScoreCache",
           "replug_prompt",
           "document_logprobs", "check_text"]

PROMPT_SEP = "\n\n"


class LMEndpointError(RagError):
    """An LM endpoint failed: an HTTP error, a timeout after the retries, or a reply without the log-probs asked for."""


@runtime_checkable
class LMScorer(Protocol):
    """A (possibly black-box) LM that scores given continuations."""

    @property
    def identity(self) -> str:
        """A string naming the LM and its weights: cached scores are keyed by it."""
        ...

    def continuation_logprobs(self, prompts: Sequence[str], continuations: Sequence[str]) -> list[np.ndarray]:
        """Per pair, ``(n_tokens,)`` float64 log p(c_t | prompt, c_<t) of the continuation's tokens."""
        ...


def check_text(value: str, what: str) -> str:
    """`value` unless it is not a string or is empty / whitespace only (ConfigError naming `what`)."""
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{what} is empty or whitespace only; give a non-empty text")
    return value


def replug_prompt(document: str, text: str) -> str:
    """REPLUG's input reformulation (§3.2): the document prepended to the input, ``d ∘ x``."""
    return f"{document}{PROMPT_SEP}{text}" if document else text


# ---------------------------------------------------------------------------- a local transformers LM


class LocalLMScorer:
    """A transformers causal LM scoring continuations in batches (:func:`rag.generation.causal.continuation_logprobs`).

    The prompt starts with the tokenizer's BOS (else EOS) token, so the first continuation token of an empty prompt has a
    context too; prompts longer than the window lose tokens on the left, never the continuation.
    """

    def __init__(self, model, tokenizer, *, batch_size: int = 8, max_length: Optional[int] = None, name: Optional[str] = None):
        check_generator_kind(model, "causal", "LocalLMScorer")
        self.model, self.tokenizer = model.eval(), tokenizer
        ctx = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if ctx is None or pad is None:
            raise ConfigError("the LM's tokenizer has neither a BOS nor an EOS token; set tokenizer.eos_token and save it again")
        self.ctx_id, self.pad_id = int(ctx), int(pad)
        cfg = model.config
        positions = getattr(cfg, "n_positions", None) or getattr(cfg, "max_position_embeddings", None) or 1024
        self.max_length = int(max_length or positions)
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        self.batch_size = batch_size
        n_params = sum(p.numel() for p in model.parameters())
        probe = next(iter(model.parameters())).detach().flatten()[:64].float().cpu().numpy().tobytes()
        self._identity = f"local:{name or getattr(cfg, '_name_or_path', '') or type(model).__name__}:{n_params}:" \
                         f"{hashlib.sha256(probe).hexdigest()[:12]}"

    @property
    def identity(self) -> str:
        return self._identity

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _tokens(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(ids) for ids in self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]]

    @torch.no_grad()
    def continuation_logprobs(self, prompts: Sequence[str], continuations: Sequence[str]) -> list[np.ndarray]:
        if len(prompts) != len(continuations):
            raise RagError(f"{len(prompts)} prompts but {len(continuations)} continuations; give one continuation per prompt")
        ps, cs = self._tokens(prompts), self._tokens(continuations)
        out: list[np.ndarray] = []
        for lo in range(0, len(ps), self.batch_size):
            p_chunk, c_chunk = ps[lo:lo + self.batch_size], cs[lo:lo + self.batch_size]
            for i, c in enumerate(c_chunk):
                if not c:
                    raise ConfigError(f"continuation {lo + i} tokenizes to no token; give a non-empty continuation")
                if len(c) + 1 >= self.max_length:
                    raise ConfigError(f"continuation {lo + i} has {len(c)} tokens and cannot fit the LM's window of "
                                      f"{self.max_length}; shorten it")
            p_chunk = [([self.ctx_id] + p)[-(self.max_length - len(c)):] for p, c in zip(p_chunk, c_chunk)]
            width, cwidth = max(map(len, p_chunk)), max(map(len, c_chunk))
            ids = torch.full((len(p_chunk), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            cont = torch.full((len(p_chunk), cwidth), self.pad_id, dtype=torch.long)
            cmask = torch.zeros_like(cont)
            for r, (p, c) in enumerate(zip(p_chunk, c_chunk)):
                ids[r, width - len(p):], mask[r, width - len(p):] = torch.tensor(p), 1  # left-padded prompt
                cont[r, :len(c)], cmask[r, :len(c)] = torch.tensor(c), 1  # right-padded continuation
            dev = self.device
            lp = continuation_logprobs(self.model, ids.to(dev), mask.to(dev), cont.to(dev), cmask.to(dev)).double().cpu().numpy()
            out += [lp[r, :len(c)] for r, c in enumerate(c_chunk)]
        return out


# ---------------------------------------------------------------------------- an OpenAI-compatible completions endpoint


class CompletionsLMScorer:
    """Prompt log-probs from an OpenAI-compatible completions endpoint (vLLM, llama.cpp server, ...).

    One request scores up to `batch_size` pairs: ``prompt = prompt + continuation`` with ``echo=True, logprobs=1,
    max_tokens=0, temperature=0``; the continuation's tokens are those whose ``text_offset`` lies in the continuation
    (so the endpoint's tokenizer must start a token where the continuation starts — true for byte-level BPE when
    the continuation starts with a space or the prompt ends with a newline; otherwise the pair is refused, not guessed).
    Tokens after the continuation (a server that generates although ``max_tokens`` is 0 or 1) are not read.

    Args:
        base_url: the server's API root, e.g. ``http://localhost:8000/v1`` (``/completions`` is appended).
        model: the model name the server expects.
        api_key: sent as ``Authorization: Bearer ...`` when given.
        timeout: seconds per request.
        max_retries: retries after a timeout, a connection error or a 5xx / 429 status (then :class:`LMEndpointError`).
        backoff: seconds before the first retry, doubled each time.
        batch_size: pairs per request.
        max_tokens: the ``max_tokens`` sent (0; llama.cpp's server reads 0 as "no limit": send 1 there).
    """

    def __init__(self, base_url: str, model: str, *, api_key: Optional[str] = None, timeout: float = 30.0, max_retries: int = 3,
                 backoff: float = 0.5, batch_size: int = 16, transport=None, max_tokens: int = 0):
        try:
            import httpx
        except ImportError as e:  # pragma: no cover - httpx ships with the dev and remote-lm extras
            raise ConfigError("CompletionsLMScorer needs httpx; install it with `pip install rag[remote-lm]`") from e
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ConfigError(f"base_url={base_url!r} must be an http(s) URL such as http://localhost:8000/v1")
        check_text(model, "model (the endpoint's model name)")
        check_number(timeout, "timeout", above=0, error=ConfigError)
        check_number(backoff, "backoff", low=0, error=ConfigError)
        check_number(max_retries, "max_retries", integer=True, low=0, error=ConfigError)
        check_positive_int(batch_size, "batch_size", error=ConfigError)
        check_number(max_tokens, "max_tokens", integer=True, low=0, error=ConfigError)
        self.url = base_url.rstrip("/") + "/completions"
        self.model, self.timeout, self.max_retries = model, float(timeout), max_retries
        self.backoff, self.batch_size = float(backoff), batch_size
        self.max_tokens = max_tokens
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(timeout=self.timeout, headers=headers, transport=transport)
        self._httpx = httpx
        self.requests = 0
        """Requests sent (retries included)."""

    @property
    def identity(self) -> str:
        return f"completions:{self.url}:{self.model}"

    def close(self) -> None:
        self._client.close()

    def _post(self, payload: dict) -> dict:
        httpx = self._httpx
        delay, last = self.backoff, None
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(delay)
                delay *= 2
            self.requests += 1
            try:
                r = self._client.post(self.url, json=payload)
            except httpx.TimeoutException as e:
                last = f"timed out after {self.timeout:g} s ({type(e).__name__})"
                continue
            except httpx.TransportError as e:
                last = f"could not be reached ({type(e).__name__}: {e})"
                continue
            if r.status_code == 429 or r.status_code >= 500:
                last = f"answered HTTP {r.status_code}: {r.text[:200]!r}"
                continue
            if r.status_code >= 400:
                raise LMEndpointError(f"the LM endpoint {self.url} refused the request with HTTP {r.status_code}: "
                                      f"{r.text[:300]!r}; "
                                      f"check the model name {self.model!r} and that it accepts echo=True with logprobs")
            try:
                return r.json()
            except ValueError as e:
                raise LMEndpointError(f"the LM endpoint {self.url} answered HTTP {r.status_code} with a body that is not JSON: "
                                      f"{r.text[:200]!r}") from e
        raise LMEndpointError(f"the LM endpoint {self.url} {last}, {self.max_retries + 1} attempt(s); no scores were computed. "
                              "Check the server, or raise timeout / max_retries")

    def continuation_logprobs(self, prompts: Sequence[str], continuations: Sequence[str]) -> list[np.ndarray]:
        if len(prompts) != len(continuations):
            raise RagError(f"{len(prompts)} prompts but {len(continuations)} continuations; give one continuation per prompt")
        out: list[np.ndarray] = []
        for lo in range(0, len(prompts), self.batch_size):
            ps, cs = list(prompts[lo:lo + self.batch_size]), list(continuations[lo:lo + self.batch_size])
            choices = self._choices([p + c for p, c in zip(ps, cs)])
            for i, (choice, p, c) in enumerate(zip(choices, ps, cs)):
                out.append(self._continuation(choice, p, c, lo + i))
        return out

    def _choices(self, prompts: list) -> list[dict]:
        """The endpoint's choices for `prompts` (texts or token-id lists), one per prompt, in order."""
        reply = self._post({"model": self.model, "prompt": prompts, "max_tokens": self.max_tokens, "echo": True,
                            "logprobs": 1, "temperature": 0})
        choices = reply.get("choices") if isinstance(reply, dict) else None
        if not isinstance(choices, list) or len(choices) != len(prompts) or not all(isinstance(c, dict) for c in choices):
            raise LMEndpointError(f"the LM endpoint {self.url} returned {len(choices) if isinstance(choices, list) else 'no'} "
                                  f"choices for {len(prompts)} prompts")
        return sorted(choices, key=lambda c: c.get("index", 0)) if all("index" in c for c in choices) else choices

    def token_logprobs(self, windows: Sequence[Sequence[int]], positions: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """log p(window[t] | window[:t]) at each ``t >= 1`` of ``positions[i]``, the windows sent as token-id prompts
        (the OpenAI API's ``prompt: [[ids]]``): the endpoint reads exactly these tokens (no BOS added, no re-tokenizing),
        so its LM must share the tokenizer they came from."""
        out: list[np.ndarray] = []
        for lo in range(0, len(windows), self.batch_size):
            ws = [list(map(int, w)) for w in windows[lo:lo + self.batch_size]]
            for i, (choice, w, pos) in enumerate(zip(self._choices(ws), ws, positions[lo:lo + self.batch_size])):
                lp = choice.get("logprobs")
                values = lp.get("token_logprobs") if isinstance(lp, dict) else None
                if not isinstance(values, list) or len(values) < len(w):
                    raise LMEndpointError(f"the LM endpoint {self.url} returned "
                                          f"{len(values) if isinstance(values, list) else 'no'} "
                                          f"token log-probs for window {lo + i} of {len(w)} tokens; it must support token-id "
                                          "prompts with echo=True and logprobs")
                picked = [values[t] for t in pos]
                if any(v is None or not isinstance(v, (int, float)) or not math.isfinite(v) for v in picked):
                    raise LMEndpointError(f"the LM endpoint {self.url} returned a missing or non-finite log-prob in "
                                          f"window {lo + i}")
                out.append(np.asarray(picked, dtype=np.float64))
        return out

    def _continuation(self, choice: dict, prompt: str, cont: str, i: int) -> np.ndarray:
        lp = choice.get("logprobs") if isinstance(choice, dict) else None
        if not isinstance(lp, dict) or not isinstance(lp.get("token_logprobs"),
                                                      list) or not isinstance(lp.get("text_offset"), list):
            raise LMEndpointError(f"the LM endpoint {self.url} returned no prompt log-probs (choice {i} has no "
                                  f"logprobs.token_logprobs / "
                                  "text_offset); it must support echo=True with logprobs=1 (vLLM's completions API does, "
                                  "chat APIs do not)")
        offsets, values = lp["text_offset"], lp["token_logprobs"]
        if len(offsets) != len(values):
            raise LMEndpointError(f"the LM endpoint {self.url} returned {len(values)} token log-probs but {len(offsets)} offsets")
        start = len(prompt)
        if start not in offsets:
            raise LMEndpointError(f"pair {i}: the endpoint's tokenizer merged the end of the prompt with the start of "
                                  f"the continuation "
                                  f"{cont[:30]!r} into one token, so the continuation's log-prob cannot be separated; start the "
                                  "continuation with a space or end the prompt with a newline")
        picked = [v for o, v in zip(offsets, values) if start <= o < start + len(cont)]
        if not picked or any(v is None or not isinstance(v, (int, float)) or math.isnan(v) for v in picked):
            raise LMEndpointError(f"the LM endpoint {self.url} returned a missing log-prob for a continuation token of pair {i}; "
                                  "an empty prompt has no context for its first token — give a non-empty prompt")
        return np.asarray(picked, dtype=np.float64)


# ---------------------------------------------------------------------------- In-Context RALM's scorer over an endpoint


class RemoteCausalScorer(CausalScorer):
    """In-Context RALM's :class:`~rag.models.ralm.model.CausalScorer` with a black-box LM: the tokenizer is local, every
    window is scored by an OpenAI-compatible endpoint (:meth:`CompletionsLMScorer.token_logprobs`).

    Same windows, documents and positions as the local scorer; windows after a document are sent whole
    (``whole_windows``: a remote LM shares no keys/values between requests), so the evaluation's numbers agree with the
    local run up to float rounding of different batch shapes.

    Args:
        tokenizer: the endpoint LM's tokenizer. positions: its window (``n_positions``); max_length: the window used
            (default: min(positions, 1024), as the local scorer). doc_max_length, batch_size: as the local scorer's
            (``batch_size`` windows per request). lm: the endpoint.
    """

    whole_windows = True

    def __init__(self, tokenizer, lm: "CompletionsLMScorer", *, positions: int, max_length: Optional[int] = None,
                 doc_max_length: int = 256, batch_size: int = 8):  # no super().__init__: there is no local model
        self.generator = CausalGenerator(None, tokenizer)  # the layout's tokenization; the endpoint holds the weights
        self.generator.check_layout_tokens()
        self.lm = lm
        self.max_length = int(max_length) if max_length is not None else min(int(positions), DEFAULT_MAX_LENGTH)
        if self.max_length > positions:
            raise ConfigError(f"--max-length {self.max_length} exceeds the LM's {positions} positions; lower it")
        self.doc_max_length, self.batch_size = int(doc_max_length), int(batch_size)

    @classmethod
    def from_pretrained(cls, path, lm: "CompletionsLMScorer", **kw) -> "RemoteCausalScorer":
        """The tokenizer and window of the causal LM at `path` (a directory, or a demo LM name such as ``"smollm2"``);
        its weights are not loaded."""
        import os

        from transformers import AutoConfig, AutoTokenizer

        if os.fspath(path) in DEMO_LM_NAMES and not os.path.isdir(os.fspath(path)):
            path = prepare_demo_lm()
        src = resolve_name_or_path(os.fspath(path))
        try:
            config, tok = AutoConfig.from_pretrained(src), AutoTokenizer.from_pretrained(src)
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot load the tokenizer of {os.fspath(path)!r} ({e}); --model names the endpoint LM's "
                              "tokenizer directory") from e
        positions = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None) or 1024
        return cls(tok, lm, positions=int(positions), **kw)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    head_split = None

    def score_positions(self, windows: Sequence[Sequence[int]], positions: Sequence[Sequence[int]], *,
                        progress=None) -> list[np.ndarray]:
        """log p(window[t] | window[:t]) at each ``t`` of ``positions[i]``, from the endpoint."""
        for i, (w, pos) in enumerate(zip(windows, positions)):
            pos = list(pos)
            if pos and (min(pos) < 1 or max(pos) >= len(w)):
                raise RagError(f"window {i}: scored positions must lie in [1, {len(w)}), got {min(pos)}..{max(pos)}")
        out = self.lm.token_logprobs(windows, [list(p) for p in positions])
        if progress is not None:
            progress.update(sum(len(p) for p in out))
        return out


# ---------------------------------------------------------------------------- the score cache


class ScoreCache:
    """Per-token continuation log-probs by (LM identity, document, input, continuation), in memory (thread-safe).

    ``hits`` / ``misses`` count look-ups; :func:`document_logprobs` asks the LM only for the misses.
    """

    def __init__(self, max_entries: Optional[int] = None):
        if max_entries is not None and (not isinstance(max_entries, int) or max_entries < 1):
            raise ConfigError(f"max_entries={max_entries!r} must be None or an integer >= 1")
        self.max_entries = max_entries
        self._store: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @staticmethod
    def key(identity: str, document: str, text: str, continuation: str) -> str:
        h = hashlib.sha256()
        for part in (identity, document, text, continuation):
            b = part.encode("utf-8")
            h.update(len(b).to_bytes(8, "little"))
            h.update(b)
        return h.hexdigest()

    def __len__(self) -> int:
        return len(self._store)

    def get(self, key: str) -> Optional[np.ndarray]:
        with self._lock:
            v = self._store.get(key)
            if v is None:
                self.misses += 1
            else:
                self.hits += 1
            return v

    def put(self, key: str, value: np.ndarray) -> None:
        with self._lock:
            if self.max_entries is not None and len(self._store) >= self.max_entries:
                self._store.pop(next(iter(self._store)))  # oldest first
            self._store[key] = value


def document_logprobs(lm: LMScorer, documents: Sequence[str], texts: Sequence[str], continuations: Sequence[str], *,
                      cache: Optional[ScoreCache] = None) -> list[np.ndarray]:
    """log p(y_t | d ∘ x, y_<t) per (document, input, continuation) triple (REPLUG §3.2 / LSR §4.2), asking `lm` only for the
    triples `cache` does not hold. Raises (never returns a partial or made-up score) when the LM fails."""
    if not (len(documents) == len(texts) == len(continuations)):
        raise RagError(f"{len(documents)} documents, {len(texts)} inputs and {len(continuations)} continuations; give one "
                       f"of each per pair")
    for x in texts:
        check_text(x, "an input text")
    for y in continuations:
        check_text(y, "a continuation")
    out: list[Optional[np.ndarray]] = [None] * len(documents)
    todo: list[int] = []
    keys: list[Optional[str]] = [None] * len(documents)
    for i, (d, x, y) in enumerate(zip(documents, texts, continuations)):
        if cache is not None:
            keys[i] = cache.key(lm.identity, d, x, y)
            out[i] = cache.get(keys[i])
        if out[i] is None:
            todo.append(i)
    if todo:
        scored = lm.continuation_logprobs([replug_prompt(documents[i], texts[i]) for i in todo], [continuations[i] for i in todo])
        if len(scored) != len(todo):
            raise LMEndpointError(f"the LM returned {len(scored)} scores for {len(todo)} pairs")
        for i, lp in zip(todo, scored):
            lp = np.asarray(lp, dtype=np.float64)
            if lp.ndim != 1 or lp.size == 0 or not np.all(np.isfinite(lp)):
                raise LMEndpointError(f"the LM returned an empty or non-finite score for pair {i}; refusing to use it")
            out[i] = lp
            if cache is not None:
                cache.put(keys[i], lp)
    return out  # type: ignore[return-value]
