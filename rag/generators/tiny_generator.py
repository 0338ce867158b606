"""The ``tiny:bart`` / ``tiny:t5`` generators of training configs: their size spec and a cached build per knowledge base.

A random small seq2seq generator (:mod:`rag.generators.tiny`) whose tokenizer is trained on the knowledge base's
own passages, so a training run needs no model hub. Built once under ``$RAG_CACHE/tiny`` (default
``~/.cache/rag/tiny``), keyed by the spec and the knowledge-base version, so a resumed run reuses the exact
same tokenizer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional, Union

from rag.generators import tiny
from rag.generators.warm_start import build_warm_start_generator, save_generator
from rag.knowledge.knowledge_base import KnowledgeBase
from rag.utils.errors import ConfigError
from rag.utils.io import atomic_directory
from rag.utils.io import cache_dir as rag_cache_dir
from rag.utils.validate import check_bool, check_choice, check_number, check_positive_int

logger = logging.getLogger(__name__)

__all__ = ["TINY_PREFIX", "TINY_KINDS", "WARM_PREFIX", "TinyGenerator", "WarmStartGenerator", "check_tiny_name",
           "ensure_tiny_generator", "ensure_warm_start_generator", "resolve_generator"]

TINY_PREFIX = "tiny:"
TINY_KINDS = ("bart", "t5")
TINY_TOKENIZER_TEXTS = 20_000  # passages used to train a tiny tokenizer on a large knowledge base


@dataclass
class TinyGenerator:
    """Size of the random generator built for ``generator: tiny:bart`` / ``tiny:t5``."""

    d_model: int = 128
    """Hidden size."""
    layers: int = 2
    """Encoder and decoder layers (each)."""
    heads: int = 4
    """Attention heads."""
    ffn: int = 256
    """Feed-forward size."""
    vocab_size: int = 1500
    """Tokenizer vocabulary, trained on the knowledge base's passages."""
    seed: int = 0
    """Initialisation seed."""

    def __post_init__(self) -> None:
        for name in ("d_model", "layers", "heads", "ffn", "vocab_size"):
            check_positive_int(getattr(self, name), f"model.tiny.{name}", error=ConfigError)
        check_number(self.seed, "model.tiny.seed", integer=True, low=0, error=ConfigError)
        if self.d_model % self.heads:
            raise ConfigError(f"model.tiny.d_model ({self.d_model}) must be a multiple of model.tiny.heads ({self.heads})")


def check_tiny_name(generator: str, where: str) -> None:
    """ConfigError (naming `where`) if `generator` is a ``tiny:`` name of an unknown kind."""
    if generator.startswith(TINY_PREFIX) and generator[len(TINY_PREFIX):] not in TINY_KINDS:
        raise ConfigError(f"{where}={generator!r}; tiny generators are {', '.join(TINY_PREFIX + k for k in TINY_KINDS)}")


WARM_PREFIX = "warm:"


@dataclass
class WarmStartGenerator:
    """The generator built for ``generator: warm:<encoder>`` (:func:`rag.generators.warm_start.build_warm_start_generator`):
    the pretrained `<encoder>` (e.g. ``minilm``, the bundled all-MiniLM-L6-v2) frozen, a fresh BERT decoder sharing its
    word embeddings, and a copy head: a generator that learns to read on a CPU."""

    decoder_layers: int = 2
    """Layers of the fresh decoder."""
    pointer: bool = True
    """A copy head (pointer-generator): the generator can emit a passage token by attending to it."""
    continuation: Union[bool, Literal["bigram"]] = "bigram"
    """The copy head's continuation bias (needs `pointer`): having copied a passage token it tends to copy the next
    one, so it copies long answers (a sentence) in order (``true``). ``bigram`` (the default) adds a bigram term, the
    next token after the last two copied ones, so a copy does not jump to the token after another occurrence of a
    frequent word (FOLDOC, 8 CPU-min, validation F1 44.5 -> 58.7); ``false``: no bias."""
    seed: int = 0
    """Seed of the decoder's initial weights."""

    def __post_init__(self) -> None:
        check_positive_int(self.decoder_layers, "model.warm_start.decoder_layers", error=ConfigError)
        check_bool(self.pointer, "model.warm_start.pointer", error=ConfigError)
        check_choice(self.continuation, "model.warm_start.continuation", (True, False, "bigram"), error=ConfigError)
        check_number(self.seed, "model.warm_start.seed", integer=True, low=0, error=ConfigError)


def resolve_generator(generator: str, spec: TinyGenerator, knowledge_base: str | os.PathLike,
                      warm: Optional[WarmStartGenerator] = None) -> str:
    """`generator` unchanged, or for ``tiny:<kind>`` the directory of that tiny generator for `knowledge_base`, or for
    ``warm:<encoder>`` the directory of that warm-started generator (built once, then reused)."""
    if generator.startswith(TINY_PREFIX):
        return ensure_tiny_generator(generator[len(TINY_PREFIX):], spec, knowledge_base)
    if generator.startswith(WARM_PREFIX):
        return ensure_warm_start_generator(generator[len(WARM_PREFIX):], warm or WarmStartGenerator())
    return generator


def ensure_warm_start_generator(encoder: str, spec: WarmStartGenerator, cache_dir: Optional[str | os.PathLike] = None) -> str:
    """Directory of the fresh warm-started generator over `encoder` with `spec` (saved with
    :func:`~rag.generators.warm_start.save_generator`: the trained part only, the encoder referenced by name)."""
    if not encoder:
        raise ConfigError("model.generator='warm:' needs an encoder name, e.g. warm:minilm (the bundled all-MiniLM-L6-v2)")
    key = json.dumps({"encoder": encoder, "spec": dataclasses.asdict(spec), "format": 1}, sort_keys=True)
    out = Path(cache_dir) if cache_dir is not None else rag_cache_dir() / "warm" / hashlib.sha256(key.encode()).hexdigest()[:16]
    if (out / "config.json").is_file():
        return str(out)
    gen, tok = build_warm_start_generator(encoder, decoder_layers=spec.decoder_layers, pointer=spec.pointer,
                                          continuation=spec.continuation, seed=spec.seed)
    try:
        with atomic_directory(out) as tmp:
            save_generator(gen, tok, tmp)
    except FileExistsError:  # built concurrently by another process
        pass
    return str(out)


def ensure_tiny_generator(kind: str, spec: TinyGenerator, knowledge_base: str | os.PathLike,
                          cache_dir: Optional[str | os.PathLike] = None) -> str:
    """Directory of a random tiny `kind` (``bart``/``t5``) generator whose tokenizer is trained
    on the passages of `knowledge_base`; built once, then reused (keyed by spec + KB version)."""
    import numpy as np

    check_tiny_name(TINY_PREFIX + str(kind), "generator")
    kb = KnowledgeBase.open(knowledge_base, verify="none")
    key = json.dumps({"kind": kind, "spec": dataclasses.asdict(spec), "kb": kb.version, "format": 1}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    out = Path(cache_dir) if cache_dir is not None else rag_cache_dir() / "tiny" / f"{kind}-{digest}"
    if (out / "config.json").is_file():
        return str(out)
    passages = kb.get_passages(np.arange(min(len(kb), TINY_TOKENIZER_TEXTS)).reshape(1, -1))[0]
    texts = [f"{p.title} {p.text}" for p in passages]
    if kind == "bart":
        tok = tiny.train_bpe_tokenizer(texts, vocab_size=spec.vocab_size)
        model = tiny.tiny_bart(tok, d_model=spec.d_model, layers=spec.layers, heads=spec.heads, ffn=spec.ffn, seed=spec.seed)
    else:
        tok = tiny.train_sentencepiece_tokenizer(texts, vocab_size=spec.vocab_size)
        model = tiny.tiny_t5(tok, d_model=spec.d_model, layers=spec.layers, heads=spec.heads, ffn=spec.ffn, seed=spec.seed)
    logger.info("built tiny %s generator (%d parameters) at %s", kind, sum(p.numel() for p in model.parameters()), out)
    try:
        with atomic_directory(out) as tmp:
            tiny.save(model, tok, tmp)
    except FileExistsError:  # built concurrently by another process: use theirs
        pass
    return str(out)
