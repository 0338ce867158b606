"""Training the predictive reranker of In-Context RALM (Ram et al. 2023, §6.2) with ``rag fit``.

:class:`RerankerDataModule` collects examples from the LM's own signal: for a prefix ``x_{≤s·j}`` of a training text
it retrieves the top-k BM25 (or dense) documents for the query of the last ``ℓ`` tokens (leakage guard on) and
scores the next stride ``y`` under each, ``log p_θ(y | [d_i; x_{≤s·j}])`` (Eq. 4), with the frozen LM.
:class:`PredictiveRerankerModule` trains the cross-encoder :class:`~rag.models.ralm.rerank.PredictiveReranker` on them
with Eq. 9, ``-log Σ_i p_rank(d_i | x) p_θ(y | [d_i; x])`` (or a soft-label cross-entropy against
``softmax(log p_θ / τ)``), the LM frozen; ``export_dir`` receives the trained reranker for
``rag lm-eval --rerank trained --rerank-model DIR``.

Special LM value ``tiny:gpt2``: a random tiny GPT-2 with a tokenizer trained on the training texts (no hub), cached
under ``$RAG_CACHE/tiny``. Special text / knowledge-base value ``demo``: the bundled Elements passages (BM25).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Literal, Optional

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

from rag.demo import load_demo_corpus
from rag.eval.perplexity import read_eval_texts
from rag.generation.marginalize import doc_log_prior, rag_sequence_log_likelihood
from rag.generators import tiny
from rag.generators.load import load_generator
from rag.knowledge.bm25 import BM25Retriever
from rag.knowledge.encoders import weights_fingerprint
from rag.models.ralm.model import (
    EvalText,
    InContextRALM,
    RalmConfig,
    doc_text,
    open_retriever,
    own_document_filter,
    retrieve_excluding,
    window_ids,
)
from rag.models.ralm.rerank import PredictiveReranker
from rag.training.distributed import check_same_knowledge_base
from rag.training.settings import RerankerOptimizer, decay_split, settings_dict
from rag.utils.devices import without_cudnn_attention
from rag.utils.errors import ConfigError
from rag.utils.files import read_json
from rag.utils.io import atomic_directory, atomic_write_json, cache_dir
from rag.utils.validate import check_positive_int

logger = logging.getLogger(__name__)

DEMO = "demo"
TINY_GPT2 = "tiny:gpt2"


@dataclass
class RerankExample:
    """One prefix, its k retrieved documents (retriever order) and the LM's log-likelihood of the next stride under each."""

    prefix: str
    docs: list[str]
    lm_loglik: list[float]


def _demo_texts() -> list[EvalText]:
    return [EvalText(p.text, p.id, p.title) for p in load_demo_corpus()]


def read_training_texts(source: str) -> list[EvalText]:
    """``demo`` (the Elements passages) or anything :func:`rag.eval.perplexity.read_eval_texts` reads."""
    if source == DEMO:
        return _demo_texts()

    return read_eval_texts(source)


def ensure_tiny_gpt2(texts: list[str], *, d_model: int = 64, layers: int = 2, vocab_size: int = 1000, max_positions: int = 256,
                     seed: int = 0) -> str:
    """Directory of a random tiny GPT-2 whose BPE tokenizer is trained on `texts`; built once, then reused."""
    key = json.dumps({"d": d_model, "l": layers, "v": vocab_size, "p": max_positions, "s": seed,
                      "texts": hashlib.sha256("\x00".join(texts).encode()).hexdigest(), "format": 1}, sort_keys=True)
    out = cache_dir() / "tiny" / f"gpt2-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if (out / "config.json").is_file():
        return str(out)
    tok = tiny.train_bpe_tokenizer(texts, vocab_size=vocab_size)
    model = tiny.tiny_gpt2(tok, d_model=d_model, layers=layers, max_positions=max_positions, seed=seed)
    try:
        with atomic_directory(out) as tmp:
            tiny.save(model, tok, tmp)
    except FileExistsError:  # built concurrently by another process
        pass
    return str(out)


def collect_examples(ralm: InContextRALM, texts: list[EvalText], *, chunks_per_text: int, prefix_tokens: int,
                     seed: int = 0, desc: Optional[str] = None) -> list[RerankExample]:
    """§6.2 "Collecting Training Examples": per text up to `chunks_per_text` random chunks ``j ≥ 1``; their top-k documents
    in one retrieval call; ``log p_θ(y | [d_i; x])`` for all (chunk, document) windows in batched LM passes (a progress
    bar named `desc` counts the scored tokens; None: no bar)."""
    from tqdm.auto import tqdm

    rng = random.Random(seed)
    cfg, scorer = ralm.config, ralm.scorer
    picks = []  # (text, stream, a, b, query)
    for t in texts:
        stream = scorer.stream(t.text)
        spans, queries = ralm.plan(stream)
        js = [j for j in range(1, len(spans)) if queries[j] is not None]
        for j in sorted(rng.sample(js, min(chunks_per_text, len(js)))):
            picks.append((t, stream, spans[j][0], spans[j][1], queries[j]))
    if not picks:
        raise ConfigError("no training chunk: every text is at most one stride long; give longer texts or a smaller stride")
    guards = [own_document_filter(t) if cfg.exclude_own else None for t, *_ in picks]
    cands = retrieve_excluding(ralm.retriever, [q for *_, q in picks], cfg.k, guards)
    windows, n_scored = [], []
    for (_, stream, a, b, _), c in zip(picks, cands):
        for doc in scorer.doc_tokens([p for p, _ in c]):
            windows.append(window_ids(stream, a, b, doc, scorer.max_length))
            n_scored.append(b - a)
    with tqdm(total=sum(n_scored), desc=desc, unit="tok", disable=desc is None, dynamic_ncols=True) as bar:
        lps = scorer.score(windows, n_scored, progress=bar)
    prefixes = ralm.tokenizer.batch_decode([stream[max(1, a - prefix_tokens):a] for _, stream, a, _, _ in picks])
    k = cfg.k
    return [RerankExample(prefix, [doc_text(p) for p, _ in c], [float(lp.sum()) for lp in lps[i * k:(i + 1) * k]])
            for i, (prefix, c) in enumerate(zip(prefixes, cands))]


EXAMPLES_FORMAT = 1
COLLECTION_SETTINGS = ("retrieval", "k", "stride", "query_length", "prefix_tokens", "max_length", "doc_max_length",
                       "chunks_per_text", "val_fraction", "seed")
"""The data options that change which examples are collected (``batch_size`` does not)."""


def examples_key(texts: list[EvalText], model: torch.nn.Module, tokenizer, kb_version: str, settings: dict) -> dict:
    """What a set of collected examples depends on: digests of the texts, of the LM's weights and of its tokenizer,
    the knowledge base's version, and the collection settings."""
    text_digest = hashlib.sha256()
    for t in texts:
        text_digest.update(json.dumps([t.id, t.title, t.text]).encode("utf-8"))
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
    return {"format": EXAMPLES_FORMAT, "texts": text_digest.hexdigest(), "lm_weights": weights_fingerprint(model),
            "tokenizer": hashlib.sha256(vocab.encode("utf-8")).hexdigest(), "knowledge_base": kb_version,
            "settings": settings}


def _parse_examples(rows, k: int, where: str) -> list[RerankExample]:
    out = []
    for i, row in enumerate(rows if isinstance(rows, list) else [None]):
        ok = (isinstance(row, dict) and isinstance(row.get("prefix"), str) and isinstance(row.get("docs"), list)
              and isinstance(row.get("lm_loglik"), list) and len(row["docs"]) == len(row["lm_loglik"]) == k
              and all(isinstance(d, str) for d in row["docs"])
              and all(isinstance(x, (int, float)) and math.isfinite(x) for x in row["lm_loglik"]))
        if not ok:
            raise ConfigError(f"{where}[{i}]: not a reranker example of k={k} documents (prefix, docs, lm_loglik); delete "
                              "the file or point data.examples_file elsewhere to collect the examples again")
        out.append(RerankExample(row["prefix"], list(row["docs"]), [float(x) for x in row["lm_loglik"]]))
    return out


def read_examples(path: str | os.PathLike, key: dict, k: int) -> Optional[tuple[list[RerankExample], list[RerankExample]]]:
    """The (train, val) examples kept in `path` when they were collected under `key`; None when the file is absent or
    was made under another key (it is then collected again and rewritten). A file that is not such a file is refused."""
    path = Path(path)
    if not path.exists():
        return None
    data = read_json(path, fix="delete it or choose another data.examples_file", error=ConfigError)
    if not isinstance(data, dict) or data.get("kind") != "rag reranker examples":
        raise ConfigError(f"{path}: data.examples_file holds something else than reranker examples; it is left alone: "
                          "choose another path")
    if data.get("key") != key:
        kept = data["key"] if isinstance(data.get("key"), dict) else {}
        changed = [f for f in key if kept.get(f) != key[f]]
        logger.warning("%s: examples made with other %s; collecting them again", path, ", ".join(changed) or "key")
        return None
    return (_parse_examples(data.get("train"), k, f"{path}: train"), _parse_examples(data.get("val"), k, f"{path}: val"))


def write_examples(path: str | os.PathLike, key: dict, train: list[RerankExample], val: list[RerankExample]) -> None:
    """Keep collected examples in `path` (JSON, written atomically) under their `key`."""
    def rows(examples: list[RerankExample]) -> list[dict]:
        return [{"prefix": e.prefix, "docs": e.docs, "lm_loglik": e.lm_loglik} for e in examples]

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, {"kind": "rag reranker examples", "key": key, "train": rows(train), "val": rows(val)})


def collate(batch: list[RerankExample]) -> dict:
    return {"prefixes": [e.prefix for e in batch], "docs": [e.docs for e in batch],
            "lm_loglik": torch.tensor([e.lm_loglik for e in batch], dtype=torch.float32)}


class ExamplesDataModule(pl.LightningDataModule):
    """Batches of :class:`RerankExample` from ``train_examples`` / ``val_examples`` (``hparams.batch_size``)."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_examples, batch_size=self.hparams.batch_size, shuffle=True, collate_fn=collate)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_examples, batch_size=self.hparams.batch_size, collate_fn=collate)


class RerankerDataModule(ExamplesDataModule):
    """Examples for the predictive reranker, made by the frozen LM (§6.2).

    Args:
        texts: training texts — ``demo`` or a .jsonl / text file / datasets directory (``id``/``title`` for the leakage guard).
        lm: the causal LM whose signal trains the reranker: a directory, ``smollm2``, or ``tiny:gpt2`` (random, no hub).
        knowledge_base: ``demo`` (BM25 over the Elements passages) or a knowledge-base directory.
        retrieval: ``bm25`` (the paper's) or ``dense``.
        k: documents per prefix (the paper: 16).
        stride: ``s``; the scored continuation ``y`` is the next stride.
        query_length: ``ℓ``, the retrieval query.
        prefix_tokens: prefix tokens the reranker reads (keep equal to the module's ``query_tokens``).
        max_length: the LM's window.
        doc_max_length: document tokens.
        chunks_per_text: prefixes sampled per text.
        val_fraction: share of texts held out for validation (whole texts, so no prefix leaks into training).
        batch_size: prefixes per batch.
        lm_batch_size: windows per LM pass while collecting (the examples run on the trainer's device: a GPU with
            ``trainer.accelerator: gpu``).
        seed: sampling seed.
        examples_file: a JSON file keeping the collected examples (the LM's scoring is most of a run's cost): read
            when it was made from the same texts, LM weights and tokenizer, knowledge-base version and collection
            settings, else the examples are collected and the file is (re)written, atomically. ``None``: not kept.
    """

    def __init__(self, texts: str = DEMO, lm: str = TINY_GPT2, knowledge_base: str = DEMO,
                 retrieval: Literal["bm25", "dense"] = "bm25",
                 k: int = 16, stride: int = 4, query_length: int = 32, prefix_tokens: int = 32, max_length: Optional[int] = None,
                 doc_max_length: int = 256, chunks_per_text: int = 4, val_fraction: float = 0.2, batch_size: int = 8,
                 lm_batch_size: int = 8, seed: int = 0, examples_file: Optional[str] = None):
        super().__init__()
        if not 0.0 <= val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction must be in [0, 1), got {val_fraction}")
        check_positive_int(lm_batch_size, "data.lm_batch_size", error=ConfigError)
        self.save_hyperparameters()
        self.train_examples: list[RerankExample] = []
        self.val_examples: list[RerankExample] = []
        self.knowledge_base: Optional[SimpleNamespace] = None  # version and path of what the examples were retrieved from

    def _retriever(self):
        h = self.hparams
        if h.knowledge_base == DEMO:
            if h.retrieval != "bm25":
                raise ConfigError("data.knowledge_base 'demo' is served by BM25; set data.retrieval: bm25 or give a "
                                  "knowledge-base directory")
            self.knowledge_base = SimpleNamespace(version="demo-elements-bm25", path=DEMO)
            return BM25Retriever.from_passages(load_demo_corpus(), show_progress=False)
        retriever = open_retriever(h.retrieval, h.knowledge_base)
        self.knowledge_base = SimpleNamespace(version=retriever.kb_version, path=h.knowledge_base)
        return retriever

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_examples:
            return

        h = self.hparams
        texts = read_training_texts(h.texts)
        lm = ensure_tiny_gpt2([t.text for t in texts]) if h.lm == TINY_GPT2 else h.lm
        model, tok, _ = load_generator(lm, kind="causal")
        ralm = InContextRALM(model, tok, self._retriever(), RalmConfig(stride=h.stride, query_length=h.query_length, k=h.k,
                                                                       max_length=h.max_length, doc_max_length=h.doc_max_length,
                                                                       batch_size=h.lm_batch_size))
        key = kept = None
        if h.examples_file:  # the key fingerprints the LM's weights: only worth it when examples are kept
            key = examples_key(texts, model, tok, self.knowledge_base.version,
                               {name: h[name] for name in COLLECTION_SETTINGS})
            kept = read_examples(h.examples_file, key, h.k)
        if kept is not None:
            self.train_examples, self.val_examples = kept
            logger.info("reranker examples: %d train, %d val read from %s", len(kept[0]), len(kept[1]), h.examples_file)
            return
        if self.trainer is not None:  # the LM's scoring is most of the cost: run it where the reranker trains
            model.to(self.trainer.strategy.root_device)
        order = list(range(len(texts)))
        random.Random(h.seed).shuffle(order)
        n_val = int(round(h.val_fraction * len(texts)))
        val, train = [texts[i] for i in order[:n_val]], [texts[i] for i in order[n_val:]]
        kw = dict(chunks_per_text=h.chunks_per_text, prefix_tokens=h.prefix_tokens, seed=h.seed)
        self.train_examples = collect_examples(ralm, train, desc=f"reranker examples ({len(train)} texts)", **kw)
        self.val_examples = collect_examples(ralm, val, desc=f"validation examples ({len(val)} texts)", **kw) if val else []
        logger.info("reranker examples: %d train, %d val (k=%d)", len(self.train_examples), len(self.val_examples), h.k)
        if h.examples_file:
            write_examples(h.examples_file, key, self.train_examples, self.val_examples)



def reranker_loss(scores: torch.Tensor, lm_loglik: torch.Tensor, kind: str = "marginal",
                  temperature: float = 1.0) -> torch.Tensor:
    """Mean over the batch of Eq. 9, ``-log Σ_i p_rank(d_i|x) p_θ(y|[d_i; x])`` (``marginal``), or of the soft-label
    cross-entropy ``-Σ_i softmax(log p_θ / τ)_i log p_rank(d_i|x)`` (``soft_label``). ``scores``, ``lm_loglik``: ``(B, K)``."""
    log_rank = doc_log_prior(scores)
    if kind == "marginal":
        return -rag_sequence_log_likelihood(lm_loglik.unsqueeze(-1), log_rank).mean()
    if kind == "soft_label":
        return -(torch.softmax(lm_loglik / temperature, dim=-1) * log_rank).sum(-1).mean()
    raise ConfigError(f"model.loss={kind!r}; choose 'marginal' (Eq. 9) or 'soft_label'")


_DEFAULT_OPTIMIZER = RerankerOptimizer()


class PredictiveRerankerModule(pl.LightningModule):
    """Trains :class:`~rag.models.ralm.rerank.PredictiveReranker` (§6.2) on :class:`RerankerDataModule` examples.

    Args:
        encoder: BERT-family encoder to start from (``minilm``: the bundled all-MiniLM-L6-v2; the paper: RoBERTa-base).
        pair_max_length: word pieces per (prefix, document) pair.
        query_tokens: prefix tokens read at evaluation time (keep equal to ``data.prefix_tokens``).
        loss: ``marginal`` (Eq. 9) or ``soft_label``.
        temperature: ``τ`` of the soft labels.
        rank_prior: 0 (the paper's reranker), or ``data.k`` to score a residual on the retriever's order (a bias per
            rank, the head starting at zero, so the untrained reranker keeps the retriever's first document).
        optimizer: AdamW and its schedule (:class:`~rag.training.settings.RerankerOptimizer`: ``lr`` the encoder's peak
            learning rate, warm-up then linear decay; ``rank_prior_lr`` the per-rank biases': k numbers that must move by
            nats, where the encoder's ``lr`` would move them by hundredths).
        export_dir: where the trained reranker is written at the end of ``fit`` (None: only checkpoints).
        export_weights: ``best``: the weights of the epoch with the lowest validation loss (the last epoch's when
            nothing is validated); ``last``: the last epoch's.
    """

    def __init__(self, encoder: str = "minilm", pair_max_length: int = 256, query_tokens: int = 32,
                 loss: Literal["marginal", "soft_label"] = "marginal",
                 temperature: float = 1.0, rank_prior: int = 0, optimizer: RerankerOptimizer = _DEFAULT_OPTIMIZER,
                 export_dir: Optional[str] = None, export_weights: Literal["best", "last"] = "best"):
        super().__init__()
        from torchmetrics import MeanMetric

        if loss not in ("marginal", "soft_label"):
            raise ConfigError(f"model.loss={loss!r}; choose 'marginal' (Eq. 9) or 'soft_label'")
        optimizer = settings_dict(optimizer, RerankerOptimizer, "optimizer")  # a plain dict in the hyperparameters
        self.optimizer_settings = RerankerOptimizer(**optimizer)
        if export_weights not in ("best", "last"):
            raise ConfigError(f"model.export_weights={export_weights!r}; choose 'best' (lowest validation loss) or 'last'")
        self.save_hyperparameters()
        self.reranker = PredictiveReranker(encoder, max_length=pair_max_length, query_tokens=query_tokens,
                                           rank_prior=rank_prior).train()  # dropout on
        self.val_loss = MeanMetric()  # synced across ranks: every rank keeps the same best epoch
        self.best: Optional[tuple[float, int, dict]] = None  # (validation loss, epoch, the reranker's weights on the CPU)

    def _step(self, batch: dict, stage: str) -> torch.Tensor:
        scores = self.reranker(batch["prefixes"], batch["docs"])
        ll = batch["lm_loglik"].to(scores.device)
        loss = reranker_loss(scores, ll, self.hparams.loss, self.hparams.temperature)
        b = ll.shape[0]
        self.log(f"{stage}/loss", loss, prog_bar=True, batch_size=b)
        if stage != "train":
            self.val_loss.update(loss.detach(), weight=b)
            pick = scores.argmax(-1)
            self.log(f"{stage}/top1", (pick == ll.argmax(-1)).float().mean(), batch_size=b)
            # log-likelihood of the next stride gained over the retriever's first document (the paper's "BM25 top-1")
            self.log(f"{stage}/loglik_gain", (ll.gather(1, pick[:, None]).squeeze(1) - ll[:, 0]).mean(), batch_size=b)
            # the loss above its floor, reached by putting all mass on the best document (the top-k oracle)
            self.log(f"{stage}/excess_loss", loss + ll.max(-1).values.mean(), batch_size=b)
        return loss

    def on_fit_start(self) -> None:
        """Under DDP, refuse to train unless every rank retrieved its examples from the same knowledge-base version."""
        check_same_knowledge_base(self.trainer, getattr(self.trainer.datamodule, "knowledge_base", None))
        k = getattr(getattr(self.trainer.datamodule, "hparams", None), "k", None)
        if self.hparams.rank_prior and k is not None and k != self.hparams.rank_prior:
            raise ConfigError(f"model.rank_prior={self.hparams.rank_prior} but data.k={k}: the reranker learns a bias per "
                              f"retrieved rank; set model.rank_prior to {k} (or 0 for none)")
        self.best = None

    def on_validation_epoch_end(self) -> None:
        """Keep the weights of the epoch with the lowest validation loss (``export_weights: best``)."""
        if self.trainer.sanity_checking or self.val_loss.update_count == 0:
            self.val_loss.reset()
            return
        loss = float(self.val_loss.compute())
        self.val_loss.reset()
        if self.hparams.export_weights == "best" and (self.best is None or loss < self.best[0]):
            self.best = (loss, self.current_epoch, {k: v.detach().cpu().clone() for k, v in self.reranker.state_dict().items()})

    @without_cudnn_attention
    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    @without_cudnn_attention
    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self._step(batch, "val")

    def configure_optimizers(self) -> dict:
        o = self.optimizer_settings
        prior = self.reranker.rank_bias
        groups = decay_split([p for p in self.parameters() if p.requires_grad and p is not prior], o.weight_decay)
        if prior is not None:
            groups.append({"params": [prior], "weight_decay": 0.0, "lr": o.rank_prior_lr})
        return o.build(self, groups)

    def on_train_end(self) -> None:
        if self.best is not None:  # every rank kept the same epoch (the loss is synced): the module ends on its weights
            self.reranker.load_state_dict(self.best[2])
            logger.info("the reranker takes the weights of epoch %d (validation loss %.4f, the lowest)", self.best[1],
                        self.best[0])
        if self.hparams.export_dir and self.trainer.is_global_zero:
            self.reranker.save(self.hparams.export_dir, overwrite=True)
            logger.info("trained reranker written to %s", self.hparams.export_dir)

    def export(self, directory: str | os.PathLike) -> Path:
        """Write the reranker for ``rag lm-eval --rerank trained --rerank-model DIR``."""
        self.reranker.save(directory, overwrite=True)
        return Path(directory)
