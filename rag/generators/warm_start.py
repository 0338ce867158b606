"""A warm-started seq2seq generator that learns to read on a CPU budget.

A reader for a few hundred QA pairs without a pretrained BART (docs/training.md, "The Elements recipe and the demo
checkpoint", says why a BART from scratch does not do): a transformers ``EncoderDecoderModel`` whose

* encoder is a pretrained BERT-family model (by default the bundled all-MiniLM-L6-v2), **frozen**;
* decoder is a fresh ``BertLMHeadModel`` (cross-attention, a few layers) whose word embeddings are the
  encoder's, **frozen and tied to its output layer**: "emit the token I attend to" then generalises to
  tokens never seen as training targets.

With ``pointer=True`` it also gets a copy head (:mod:`rag.generators.pointer`, a pointer-generator): it can
emit a passage token by pointing at it.

It is an ordinary ``AutoModelForSeq2SeqLM`` for everything downstream (:class:`~rag.models.rag.model.RagModel`,
:mod:`rag.generation.decoding`). Checkpoints stay small: :func:`save_generator` writes only the trained
weights (the decoder minus its word embeddings) and records the
encoder by name and weights fingerprint; :func:`load_warm_start` rebuilds the rest and checks the
fingerprint. :func:`load_seq2seq` loads either kind of generator directory.

Because the encoder is frozen, its output is a pure function of the input ids: :func:`cache_encoder_outputs`
memoises it per context during training (each (question, passage) pair is then encoded once per run).
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Iterator, Optional, Union

import torch
from torch import nn

from rag.generators.pointer import pointer_encoder_class, pointer_model_class
from rag.knowledge.encoders import check_fingerprint, resolve_name_or_path, weights_fingerprint
from rag.utils.errors import ConfigError, IntegrityError
from rag.utils.files import read_json

logger = logging.getLogger(__name__)

WARM_START_KEY = "rag_warm_start"
"""The generator-config attribute (saved in ``config.json``) that marks a warm-started generator."""
WEIGHTS_FILE = "model.safetensors"
CONTINUATIONS = (False, True, "bigram")
"""Values of the ``continuation`` option: none, the unigram copy-continuation bias, unigram + bigram."""
_EMBEDDINGS = "decoder.bert.embeddings.word_embeddings.weight"
_OUTPUT = "decoder.cls.predictions.decoder.weight"
_OUTPUT_BIAS = "decoder.cls.predictions.decoder.bias"  # the same tensor as decoder.cls.predictions.bias


def build_warm_start_generator(
    encoder: str = "minilm",
    *,
    decoder_layers: int = 3,
    decoder_heads: Optional[int] = None,
    decoder_ffn: Optional[int] = None,
    dropout: float = 0.0,
    pointer: bool = False,
    continuation: Union[bool, str] = False,
    seed: Optional[int] = None,
):
    """A fresh generator: pretrained frozen `encoder` + a `decoder_layers`-layer BERT decoder sharing
    (frozen, tied) its word embeddings. Returns ``(EncoderDecoderModel, tokenizer)``.

    `pointer` adds a copy head (:mod:`rag.generators.pointer`): the generator can emit a context token by
    pointing at it, which a small generator learns far sooner than regenerating the token. `continuation` (needs
    `pointer`) adds the copy-continuation bias (:meth:`~rag.generators.pointer.pointer_model_class`'s ``add_continuation``):
    the head copies spans in order, which long answers (a definition's sentence) need. ``continuation="bigram"`` also
    adds the bigram term (the copy continues the last *two* output tokens), so a copy does not jump to the token after
    another occurrence of a frequent word; the generator then records ``continuation: "bigram"``.

    Decoding starts at ``[CLS]`` and ends at ``[SEP]`` (targets are tokenised as ``[CLS] answer [SEP]``,
    as :meth:`RagModel.tokenize_targets` does). `decoder_heads` / `decoder_ffn` default to the encoder's.
    """
    from transformers import AutoTokenizer, BertConfig, BertLMHeadModel

    if not isinstance(decoder_layers, int) or decoder_layers < 1:
        raise ConfigError(f"decoder_layers must be a positive integer, got {decoder_layers!r}")
    if continuation not in CONTINUATIONS:
        raise ConfigError(f"warm_start.continuation must be true, false or 'bigram', got {continuation!r}")
    if continuation and not pointer:
        raise ConfigError("warm_start.continuation needs warm_start.pointer: true (it biases the copy head)")
    path = resolve_name_or_path(encoder)
    try:
        enc = _frozen_encoder(path, pointer)
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot load {encoder!r} as a BERT-family encoder and tokenizer for the warm-started "
                          f"generator: {e}") from e
    ec = enc.config
    if seed is not None:
        torch.manual_seed(seed)
    dcfg = BertConfig(
        vocab_size=ec.vocab_size, hidden_size=ec.hidden_size, num_hidden_layers=decoder_layers,
        num_attention_heads=decoder_heads or ec.num_attention_heads, intermediate_size=decoder_ffn or ec.intermediate_size,
        max_position_embeddings=ec.max_position_embeddings, pad_token_id=tok.pad_token_id,
        is_decoder=True, add_cross_attention=True, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
        tie_word_embeddings=True,
    )
    dec = BertLMHeadModel(dcfg)
    with torch.no_grad():
        dec.bert.embeddings.word_embeddings.weight.copy_(enc.embeddings.word_embeddings.weight)
    gen = _model_class(pointer)(encoder=enc, decoder=dec)
    record = {"encoder": encoder, "fingerprint": weights_fingerprint(enc)}
    if pointer:
        record["pointer"] = True
    if continuation:
        record["continuation"] = continuation
        gen.add_continuation(bigram=continuation == "bigram")
    _configure(gen, tok, record)
    return gen, tok


def _frozen_encoder(path: str, pointer: bool = False):
    """The pretrained BERT-family encoder without its pooler (a seq2seq encoder only needs token states);
    for a `pointer` generator, one whose outputs carry the token ids."""
    from transformers import BertModel

    enc = (pointer_encoder_class(BertModel) if pointer else BertModel).from_pretrained(path)
    enc.pooler = None
    return enc


def _model_class(pointer: bool) -> type:
    from transformers import EncoderDecoderModel

    return pointer_model_class() if pointer else EncoderDecoderModel


def _configure(gen, tok, record: dict) -> None:
    """Special tokens, the warm-start record, frozen encoder + embeddings, tied output layer."""
    cfg = gen.config
    cfg.decoder_start_token_id = tok.cls_token_id
    cfg.bos_token_id = tok.cls_token_id
    cfg.eos_token_id = tok.sep_token_id
    cfg.pad_token_id = tok.pad_token_id
    cfg.vocab_size = cfg.decoder.vocab_size
    setattr(cfg, WARM_START_KEY, dict(record))
    gen.generation_config.decoder_start_token_id = tok.cls_token_id
    gen.generation_config.bos_token_id = tok.cls_token_id
    gen.generation_config.eos_token_id = tok.sep_token_id
    gen.generation_config.pad_token_id = tok.pad_token_id
    dec = gen.decoder
    dec.cls.predictions.decoder.weight = dec.bert.embeddings.word_embeddings.weight  # tied (one Parameter)
    gen.encoder.requires_grad_(False)
    gen.encoder.eval()
    dec.bert.embeddings.word_embeddings.weight.requires_grad_(False)


def is_warm_start(generator) -> bool:
    """True for a generator made by :func:`build_warm_start_generator` (or loaded from one)."""
    return isinstance(getattr(getattr(generator, "config", None), WARM_START_KEY, None), dict)


def _trained_state(gen) -> dict[str, torch.Tensor]:
    """What training changes: every weight except the frozen encoder and the (shared) word embeddings."""
    return {
        name: t.detach().contiguous() for name, t in gen.state_dict().items()
        if not name.startswith("encoder.") and name not in (_EMBEDDINGS, _OUTPUT, _OUTPUT_BIAS)
    }


def save_generator(generator, tokenizer, path: Union[str, os.PathLike]) -> None:
    """Write a warm-started generator to `path` (an existing, empty or scratch directory): ``config.json``
    (with the encoder's name and fingerprint), ``generation_config.json``, the tokenizer, and
    ``model.safetensors`` holding only the trained weights."""
    from safetensors.torch import save_file

    if not is_warm_start(generator):
        raise ConfigError(f"{type(generator).__name__} is not a warm-started generator; use its save_pretrained")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    generator.config.save_pretrained(path)
    generator.generation_config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    save_file(_trained_state(generator), str(path / WEIGHTS_FILE), metadata={"format": "pt", WARM_START_KEY: "1"})


def load_warm_start(path: Union[str, os.PathLike]):
    """Load a directory written by :func:`save_generator`: rebuild the frozen encoder by its recorded
    name, check its weights fingerprint, and load the trained weights. Returns ``(generator, tokenizer)``.

    Raises:
        IntegrityError: the encoder loads with other weights than the generator was trained on, or
            the weights file lacks or has extra tensors.
    """
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, BertLMHeadModel, EncoderDecoderConfig

    path = Path(path)
    cfg = EncoderDecoderConfig.from_pretrained(path)
    record = getattr(cfg, WARM_START_KEY, None)
    if not isinstance(record, dict) or not isinstance(record.get("encoder"),
                                                      str) or not isinstance(record.get("fingerprint"), str):
        raise IntegrityError(f"{path / 'config.json'}: field {WARM_START_KEY!r} is missing or incomplete (it needs the strings "
                             "'encoder' and 'fingerprint'); save the generator again")
    name = record["encoder"]
    pointer = bool(record.get("pointer", False))
    try:
        enc = _frozen_encoder(resolve_name_or_path(name), pointer)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path / 'config.json'}: the generator's frozen encoder {name!r} cannot be loaded here: {e}") from e
    check_fingerprint(enc, record["fingerprint"], lambda found: (
        f"{path / 'config.json'}: the generator was trained on encoder {name!r} with weights fingerprint "
        f"{record['fingerprint'][:16]}…, but {name!r} loads here with {found[:16]}…; install the version it was trained with"),
        error=IntegrityError)
    dec = BertLMHeadModel(cfg.decoder)
    with torch.no_grad():
        dec.bert.embeddings.word_embeddings.weight.copy_(enc.embeddings.word_embeddings.weight)
    gen = _model_class(pointer)(encoder=enc, decoder=dec)
    continuation = record.get("continuation", False)
    if continuation not in CONTINUATIONS:
        raise IntegrityError(f"{path / 'config.json'}: field {WARM_START_KEY}.continuation is {continuation!r}, not true, false "
                             "or 'bigram' (written by a newer rag?)")
    if continuation:
        if not pointer:
            raise IntegrityError(f"{path / 'config.json'}: field {WARM_START_KEY}.continuation needs pointer: true; save the "
                                 f"generator again")
        gen.add_continuation(bigram=continuation == "bigram")
    tok = AutoTokenizer.from_pretrained(path)
    _configure(gen, tok, record)
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise IntegrityError(f"{weights}: missing; the generator's trained weights are not there")
    state = load_file(str(weights))
    expected = _trained_state(gen)
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    whole = gen.state_dict()
    if not missing and extra and set(extra) <= set(whole):
        # transformers' save_pretrained of the whole model (frozen encoder included): every trained tensor is there, and
        # the rest are the model's own; the encoder weights saved with it are the ones it ran with.
        logger.info("%s: a save_pretrained directory of the whole generator (%d tensors); "
                    "rag.generators.warm_start.save_generator "
                    "writes only the trained ones", weights, len(state))
        expected = {k: whole[k] for k in state}
    elif missing or extra:
        raise IntegrityError(f"{weights}: tensors missing {missing[:5]} / unexpected {extra[:5]}: not a generator "
                             f"rag.generators.warm_start.save_generator (or save_pretrained) wrote for this config.json; "
                             f"restore the directory or save the generator again")
    for name, t in state.items():
        if t.shape != expected[name].shape:
            raise IntegrityError(f"{weights}: tensor {name} has shape {tuple(t.shape)}, config.json implies "
                                 f"{tuple(expected[name].shape)}")
    gen.load_state_dict(state, strict=False)
    return gen.eval(), tok


def load_seq2seq(path: Union[str, os.PathLike]):
    """``(generator, tokenizer)`` from a generator directory: a warm-started one (:func:`load_warm_start`)
    or any ``AutoModelForSeq2SeqLM`` checkpoint / hub id."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    cfg_file = Path(path) / "config.json"
    if cfg_file.is_file():
        cfg = read_json(cfg_file, fix="restore the generator directory")
        if isinstance(cfg, dict) and WARM_START_KEY in cfg:
            return load_warm_start(path)
    return AutoModelForSeq2SeqLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


class _CachedEncoder(nn.Module):
    """Wraps a frozen encoder; memoises ``last_hidden_state`` per row keyed by the row's real token ids."""

    def __init__(self, encoder: nn.Module, cache: dict):
        super().__init__()
        self.inner = encoder
        self.cache = cache
        self.config = encoder.config
        self.main_input_name = getattr(encoder, "main_input_name", "input_ids")

    def forward(self, input_ids=None, attention_mask=None, return_dict=True, **kwargs):
        from transformers.modeling_outputs import BaseModelOutput

        if input_ids is None or kwargs.get("inputs_embeds") is not None:
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, return_dict=True, **kwargs)
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        lengths = mask.sum(1).tolist()
        keys = [tuple(row[:n]) for row, n in zip(input_ids.tolist(), lengths)]
        todo = [key for key in dict.fromkeys(keys) if key not in self.cache]
        for start in range(0, len(todo), 64):
            chunk = todo[start:start + 64]
            width = max(len(key) for key in chunk)
            ids = torch.zeros(len(chunk), width, dtype=input_ids.dtype, device=input_ids.device)
            am = torch.zeros_like(ids)
            for j, key in enumerate(chunk):
                ids[j, :len(key)] = torch.tensor(key, dtype=input_ids.dtype)
                am[j, :len(key)] = 1
            with torch.no_grad():
                states = self.inner(input_ids=ids, attention_mask=am, return_dict=True).last_hidden_state
            for j, key in enumerate(chunk):
                self.cache[key] = states[j, :len(key)].clone()
        out = torch.zeros(input_ids.shape[0], input_ids.shape[1], self.cache[keys[0]].shape[-1],
                          dtype=self.cache[keys[0]].dtype, device=input_ids.device)
        for i, key in enumerate(keys):
            out[i, :len(key)] = self.cache[key]
        return BaseModelOutput(last_hidden_state=out)


@contextlib.contextmanager
def cache_encoder_outputs(generator, cache: Optional[dict] = None) -> Iterator[dict]:
    """Within the block, the frozen encoder of a warm-started `generator` runs once per distinct
    context (row of real token ids); later calls read the memoised states. Yields the cache (a dict;
    pass one back in to keep it across blocks). Padding positions get zeros, as the attention mask
    hides them. Refused for an encoder that is not frozen (its outputs would go stale)."""
    if not is_warm_start(generator):
        raise ConfigError("cache_encoder_outputs needs a warm-started generator (its encoder frozen)")
    if any(p.requires_grad for p in generator.encoder.parameters()):
        raise ConfigError("the generator's encoder is trainable; its outputs cannot be cached")
    cache = {} if cache is None else cache
    inner = generator.encoder
    generator.encoder = _CachedEncoder(inner, cache)
    try:
        yield cache
    finally:
        generator.encoder = inner
