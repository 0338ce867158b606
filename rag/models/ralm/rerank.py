"""Rerankers for In-Context RALM (Ram et al. 2023, §6): choose which of the top-k retrieved documents the LM reads.

* :class:`LMReranker` (§6.1, Eq. 6): zero-shot — the document under which an LM (the reader itself or a smaller one,
  possibly with another tokenizer) best predicts the last ``s'`` tokens of the prefix.
* :class:`PredictiveReranker` (§6.2, Eqs. 7–8): a BERT-family cross-encoder ``f(prefix, doc)`` trained on the LM's own
  signal (:mod:`rag.training.reranker`); saved and loaded as a directory.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch
from torch import nn

from rag.knowledge.encoders import resolve_name_or_path
from rag.knowledge.passages import Passage
from rag.models.ralm.model import CausalScorer, InContextRALM, doc_text, window_ids
from rag.utils.errors import ConfigError, IntegrityError
from rag.utils.files import check_json_files, read_json, readable_model_files
from rag.utils.io import atomic_directory, atomic_write_json
from rag.utils.validate import check_positive_int

__all__ = ["LMReranker", "PredictiveReranker", "best_documents", "RERANKER_FILE"]

RERANKER_FILE = "rag_reranker.json"
HEAD_FILE = "head.safetensors"

Request = tuple[list[int], int, list[Passage]]


def best_documents(scores: np.ndarray | torch.Tensor) -> np.ndarray:
    """Eq. 6 / Eq. 8: per request the index of the best-scoring candidate; ``(n, k)`` scores -> ``(n,)`` (ties: first)."""
    s = np.asarray(scores.detach().cpu() if isinstance(scores, torch.Tensor) else scores)
    if s.ndim != 2 or s.shape[1] < 1:
        raise ConfigError(f"scores must have shape (n_requests, k>=1), got {s.shape}")
    return s.argmax(axis=1)


class LMReranker:
    """Zero-shot LM reranking (§6.1): score candidate ``d_i`` by ``log p_φ(y' | [d_i; x_{<s·j-s'}])``, y' = the last ``s'``
    prefix tokens. One batched LM pass over all (chunk, candidate) windows.

    Args:
        scorer: the reranking LM; None = the reader's own LM (its stream and document tokens are reused). A different
            LM (e.g. a smaller one) may use another tokenizer: the prefix is then decoded and re-tokenized with it.
        rerank_tokens: ``s'`` (the paper's best: 16).
    """

    def __init__(self, scorer: Optional[CausalScorer] = None, rerank_tokens: int = 16):
        if not isinstance(rerank_tokens, int) or rerank_tokens < 1:
            raise ConfigError(f"rerank_tokens (--rerank-tokens) must be an integer >= 1, got {rerank_tokens!r}")
        self.own_scorer, self.rerank_tokens = scorer, rerank_tokens

    def _streams(self, ralm: InContextRALM, requests: Sequence[Request]) -> tuple[CausalScorer, list[tuple[list[int], int]]]:
        scorer = self.own_scorer or ralm.scorer
        if scorer is ralm.scorer or scorer.tokenizer.get_vocab() == ralm.tokenizer.get_vocab():
            return scorer, [(stream, a) for stream, a, _ in requests]
        tail = scorer.max_length  # more prefix than the reranker's window can use is never needed
        texts = ralm.tokenizer.batch_decode([stream[max(1, a - tail):a] for stream, a, _ in requests])
        out = []
        for t in texts:
            s = scorer.stream(t)
            out.append((s, len(s)))
        return scorer, out

    def scores(self, ralm: InContextRALM, requests: Sequence[Request]) -> np.ndarray:
        """``(n, k)`` summed log-likelihoods of each request's last ``s'`` prefix tokens under each candidate."""
        scorer, streams = self._streams(ralm, requests)
        if scorer.doc_max_length + self.rerank_tokens + 1 > scorer.max_length:
            raise ConfigError(
                f"zero-shot reranking reads a document of up to {scorer.doc_max_length} tokens + {self.rerank_tokens} "
                f"prefix tokens "
                f"(--rerank-tokens) + 1, more than the reranking LM's window of {scorer.max_length}; lower --rerank-tokens or "
                f"--doc-max-length"
            )
        k = len(requests[0][2]) if requests else 0
        windows, n_scored = [], []
        for (stream, a), (_, _, cands) in zip(streams, requests):
            if len(cands) != k:
                raise ConfigError("every rerank request needs the same number of candidates")
            m = min(self.rerank_tokens, a - 1)  # a >= 2: at least one text token precedes a retrieval chunk
            for doc in scorer.doc_tokens(cands):
                windows.append(window_ids(stream, a - m, a, doc, scorer.max_length))
                n_scored.append(m)
        lps = scorer.score(windows, n_scored)
        return np.asarray([lp.sum() for lp in lps], dtype=np.float64).reshape(len(requests), k)


def is_reranker_dir(path: Path) -> bool:
    """True for a directory written by :meth:`PredictiveReranker.save` (the only kind its save replaces)."""
    return (Path(path) / RERANKER_FILE).is_file()


class PredictiveReranker(nn.Module):
    """Cross-encoder ``f(x_{≤s·j}, d_i)`` (§6.2): a BERT-family encoder over ``[CLS] prefix [SEP] doc [SEP]`` and a linear
    head on the ``[CLS]`` state; ``p_rank(d_i | x) = softmax_i f`` (Eq. 7).

    With ``rank_prior = k`` the score is a residual on the retriever's order, ``f = head(CLS) + b_rank`` with one
    learned bias per retriever rank and the head starting at zero: untrained, every candidate ties and Eq. 8 keeps the
    retriever's first, so training moves the choice only as far as the LM's signal carries it (an extension; the
    paper's reranker reads the pair alone).

    Args:
        encoder: name or path of the encoder (``"minilm"``: the bundled all-MiniLM-L6-v2).
        max_length: word pieces per (prefix, document) pair; the prefix keeps its end, the document its start.
        query_tokens: the prefix is the last this-many tokens of the LM's stream before the chunk.
        rank_prior: candidates per request whose retriever rank gets a bias (0: off, the paper's reranker).
    """

    def __init__(self, encoder: str = "minilm", max_length: int = 256, query_tokens: int = 32, rank_prior: int = 0):
        super().__init__()
        from transformers import AutoModel, AutoTokenizer

        check_positive_int(max_length, "max_length (the reranker's pair_max_length)", error=ConfigError)
        check_positive_int(query_tokens, "query_tokens", error=ConfigError)
        path = resolve_name_or_path(encoder)
        fix = "restore the reranker's encoder directory, or pass a BERT-family directory or 'minilm'"
        check_json_files(path, fix=fix)  # transformers and tokenizers parse them without bounds
        try:
            with readable_model_files(path, "the reranker's encoder", fix) if Path(path).is_dir() else contextlib.nullcontext():
                self.encoder = AutoModel.from_pretrained(path)
                self.tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot load the reranker encoder {encoder!r}: {e}; pass a BERT-family "
                              f"directory or 'minilm'") from e
        self.tokenizer.truncation_side = "right"
        pooler = getattr(self.encoder, "pooler", None)
        if isinstance(pooler, nn.Module):  # the head reads the [CLS] state, never the pooler: frozen (DDP needs no search)
            pooler.requires_grad_(False)
        self.head = nn.Linear(self.encoder.config.hidden_size, 1)
        if not isinstance(rank_prior, int) or isinstance(rank_prior, bool) or rank_prior < 0:
            raise ConfigError(f"rank_prior must be 0 (off) or the number of reranked candidates k, got {rank_prior!r}")
        self.rank_prior = rank_prior
        if rank_prior:
            nn.init.zeros_(self.head.weight)
            nn.init.zeros_(self.head.bias)
            self.rank_bias = nn.Parameter(torch.zeros(rank_prior))
        else:
            self.register_parameter("rank_bias", None)
        self.max_length, self.query_tokens, self.encoder_name = int(max_length), int(query_tokens), str(encoder)

    def forward(self, prefixes: Sequence[str], docs: Sequence[Sequence[str]]) -> torch.Tensor:
        """``(B,)`` prefix texts and ``B × K`` document texts -> ``(B, K)`` scores ``f``."""
        b, k = len(prefixes), len(docs[0]) if docs else 0
        if any(len(d) != k for d in docs) or len(docs) != b:
            raise ConfigError("docs must be B lists of the same K document texts")
        q = self._tail([p for p in prefixes for _ in range(k)])
        enc = self.tokenizer(q, [d for row in docs for d in row], truncation="only_second", max_length=self.max_length,
                             padding=True, return_tensors="pt").to(self.head.weight.device)
        cls = self.encoder(**enc).last_hidden_state[:, 0]
        scores = self.head(cls).squeeze(-1).view(b, k)
        if self.rank_bias is None:
            return scores
        if k != self.rank_prior:
            raise ConfigError(f"this reranker learned a bias for each of the retriever's first {self.rank_prior} documents "
                              f"(rank_prior) and was given {k}; rerank the top {self.rank_prior} (--rerank-k {self.rank_prior})")
        return scores + self.rank_bias

    def _tail(self, texts: list[str]) -> list[str]:
        """Keep the end of each prefix within half the pair's budget (the end of the prefix matters most, §3.2)."""
        budget = self.max_length // 2
        ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        return [t if len(i) <= budget else self.tokenizer.decode(i[-budget:]) for t, i in zip(texts, ids)]

    @torch.no_grad()
    def scores(self, ralm: InContextRALM, requests: Sequence[Request], batch_size: int = 8) -> np.ndarray:
        """``(n, k)`` reranker scores for In-Context RALM requests (the prefix tail decoded with the LM's tokenizer)."""
        was = self.training
        self.eval()
        prefixes = ralm.tokenizer.batch_decode([s[max(1, a - self.query_tokens):a] for s, a, _ in requests])
        out = [self(prefixes[i:i + batch_size],
                    [[doc_text(p) for p in c] for _, _, c in requests[i:i + batch_size]]).float().cpu()
               for i in range(0, len(requests), batch_size)]
        self.train(was)
        return torch.cat(out).numpy() if out else np.zeros((0, 0))

    # ------------------------------------------------------------------ persistence
    def save(self, directory: str | os.PathLike, *, overwrite: bool = False) -> None:
        """Write encoder, tokenizer and head to `directory` atomically."""
        from safetensors.torch import save_file

        with atomic_directory(directory, overwrite=overwrite, replaces=is_reranker_dir, kind="predictive reranker") as tmp:
            self.encoder.save_pretrained(tmp / "encoder")
            self.tokenizer.save_pretrained(tmp / "encoder")
            tensors = dict(self.head.state_dict())
            if self.rank_bias is not None:
                tensors["rank_bias"] = self.rank_bias
            save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp / HEAD_FILE))
            atomic_write_json(tmp / RERANKER_FILE, {"format": 1, "max_length": self.max_length, "query_tokens": self.query_tokens,
                                                    "rank_prior": self.rank_prior, "encoder": self.encoder_name})

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "PredictiveReranker":
        """Open a directory written by :meth:`save` (``--rerank-model`` of ``rag lm-eval --rerank trained``)."""
        from safetensors.torch import load_file

        d = Path(directory)
        if not (d / RERANKER_FILE).is_file():
            raise ConfigError(f"{d}: not a trained reranker ({RERANKER_FILE} missing); train one with "
                              "`rag fit --config lightning_configs/ralm_reranker_tiny.yaml` and pass its export_dir")
        fix = "the reranker directory is damaged — restore it, or train it again"
        settings_file = d / RERANKER_FILE
        settings = read_json(settings_file, fix=fix)
        if not isinstance(settings, dict):
            raise IntegrityError(f"{settings_file}: holds a JSON {type(settings).__name__}, not an object; {fix}")
        for key in ("max_length", "query_tokens"):  # each named, as a RAG checkpoint's fields are
            if key not in settings:
                raise IntegrityError(f"{settings_file}: field {key!r} is missing; {fix}")
            check_positive_int(settings[key], f"{settings_file}: field {key!r}", error=IntegrityError)
        if not isinstance(settings.get("encoder", ""), str):
            raise IntegrityError(f"{settings_file}: field 'encoder' must be a string; {fix}")
        rank_prior = settings.get("rank_prior", 0)  # absent in directories written before the option
        if not isinstance(rank_prior, int) or isinstance(rank_prior, bool) or rank_prior < 0:
            raise IntegrityError(f"{settings_file}: field 'rank_prior' must be an integer >= 0, got {rank_prior!r}; {fix}")
        model = cls(str(d / "encoder"), max_length=settings["max_length"], query_tokens=settings["query_tokens"],
                    rank_prior=rank_prior)
        with readable_model_files(d, "the reranker's head", fix):
            tensors = load_file(str(d / HEAD_FILE))
            bias = tensors.pop("rank_bias", None)
            model.head.load_state_dict(tensors)
            if (bias is None) != (model.rank_bias is None) or (bias is not None and tuple(bias.shape) != (rank_prior,)):
                raise IntegrityError(f"{d / HEAD_FILE}: its rank biases do not match field 'rank_prior' = {rank_prior} of "
                                     f"{settings_file}; {fix}")
            if bias is not None:
                model.rank_bias.data.copy_(bias)
        model.encoder_name = settings.get("encoder", model.encoder_name)
        return model.eval()
