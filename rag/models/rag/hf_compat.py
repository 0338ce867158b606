"""Import checkpoints written by transformers' RAG classes into a :class:`~rag.models.rag.model.RagModel`.

A directory saved by ``RagSequenceForGeneration`` / ``RagTokenForGeneration`` (the layout of
``facebook/rag-sequence-nq`` and ``facebook/rag-token-nq``)::

    config.json                    model_type "rag": RagConfig with `question_encoder` and `generator` sub-configs
    model.safetensors              one weight file (or sharded + index, or a legacy pytorch_model.bin) holding
                                   ``rag.question_encoder.*`` and ``rag.generator.*``
    question_encoder_tokenizer/    the DPR question tokenizer (RagTokenizer.save_pretrained)
    generator_tokenizer/           the generator (BART) tokenizer

is split into a DPR question encoder and a seq2seq generator, each loaded through its own
``from_pretrained`` (so tied weights and legacy key names are handled by transformers), and
assembled with a knowledge base into a RagModel with ``hf_compat=True``: contexts are built exactly
as ``RagRetriever`` builds them (including the question's round trip through the question
tokenizer and right truncation at ``max_combined_length``), answer strings are scored as transformers
scores ``labels=tokenizer(text_target=answer).input_ids`` (fed ``<s> …``, scored from the second token:
:func:`rag.generation.marginalize.hf_label_convention`), and the loss is transformers' ``get_nll``, quirks
included (see :mod:`rag.generation.marginalize`). RAG-Sequence's per-passage search runs as transformers runs it
(``mask_padded_contexts=False``: contexts padded to ``max_combined_length``, no attention mask, so padded contexts
attend to their pads; pass ``mask_padded_contexts=True`` as an override to mask them). The decoding settings stored with the
checkpoint (:func:`stored_generation_settings`) become the pipeline's defaults. Weight shard names read from
``model.safetensors.index.json`` must stay inside the checkpoint directory.

Separate DPR and BART checkpoints need no importer: use ``RagModel.from_components``.

transformers' RAG checkpoints do not contain our knowledge base (theirs is ``wiki_dpr``), so one
must be given: a knowledge base built with the matching DPR context encoder.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Optional, Union

from rag.knowledge.encoders import TextEncoder
from rag.models.rag.checkpoint import is_hf_rag_checkpoint, open_knowledge_base, resolve_checkpoint_dir
from rag.models.rag.config import RagModelConfig, check_overrides
from rag.models.rag.model import RagModel
from rag.utils.checksums import confined_path
from rag.utils.errors import ConfigError, IntegrityError, RagError
from rag.utils.files import check_json_files, read_json

__all__ = ["is_hf_rag_checkpoint", "rag_config_from_hf", "stored_generation_settings", "split_hf_rag", "load_hf_rag",
           "convert_hf_rag"]

_ARCHITECTURES = {"RagSequenceForGeneration": "sequence", "RagTokenForGeneration": "token"}
_QUESTION_TOKENIZER_DIR = "question_encoder_tokenizer"
_GENERATOR_TOKENIZER_DIR = "generator_tokenizer"


def rag_config_from_hf(hf_config, marginalization: Optional[str] = None, generation: Optional[dict] = None, **overrides):
    """The :class:`RagModelConfig` that reproduces a transformers ``RagConfig``.

    `marginalization` defaults to the one the config's ``architectures`` imply
    (RagSequenceForGeneration -> "sequence", RagTokenForGeneration -> "token").
    ``reduce_loss`` is a per-call choice in transformers (its fine-tuning script passes
    ``reduce_loss=True``), so imports default to a scalar loss (summed, as transformers sums);
    pass ``reduce_loss=False`` for per-example losses. `generation`: the checkpoint's decoding options
    (:func:`stored_generation_settings`), kept as the pipeline's defaults.
    """
    if marginalization is None:
        archs = [a for a in (getattr(hf_config, "architectures", None) or []) if a in _ARCHITECTURES]
        if not archs:
            raise ConfigError(
                f"the RAG config names architectures {getattr(hf_config, 'architectures', None)}, neither "
                "RagSequenceForGeneration nor RagTokenForGeneration; pass marginalization='sequence' or 'token'"
            )
        marginalization = _ARCHITECTURES[archs[0]]
    qcfg = hf_config.question_encoder
    fields = dict(
        n_docs=int(hf_config.n_docs),
        marginalization=marginalization,
        label_smoothing=float(hf_config.label_smoothing or 0.0),
        exclude_bos_score=bool(hf_config.exclude_bos_score),
        reduce_loss=True,
        freeze_query_encoder=False,
        retrieval="dense",
        max_context_length=int(hf_config.max_combined_length),
        # transformers' RagTokenizer does not truncate questions; the encoder's positions are the limit.
        max_question_length=int(getattr(qcfg, "max_position_embeddings", 512) or 512),
        truncation="hf",
        hf_compat=True,
        # transformers' per-passage RAG-Sequence search passes attention_mask=None: padded contexts attend to pads.
        mask_padded_contexts=False,
        title_sep=hf_config.title_sep,
        doc_sep=hf_config.doc_sep,
    )
    if generation:
        fields["generation"] = generation
    fields.update(check_overrides(overrides))
    return RagModelConfig(**fields)


# Decoding options a transformers checkpoint stores (generation_config.json / config.json) that GenerationConfig
# reproduces; the released BART-based RAG checkpoints set several of them.
GENERATION_KEYS = ("num_beams", "max_length", "min_length", "no_repeat_ngram_size", "length_penalty", "early_stopping",
                   "forced_bos_token_id", "forced_eos_token_id")


def stored_generation_settings(root: Union[str, os.PathLike]) -> dict:
    """The decoding options stored with a transformers RAG checkpoint at `root` (the subset of
    :data:`GENERATION_KEYS` it sets), for :attr:`RagModelConfig.generation`. Each is taken from the first of:
    ``generation_config.json`` (what transformers' ``generate`` reads first), the RAG ``config.json``, its
    ``generator`` sub-config (where checkpoints saved by older transformers keep BART's ``forced_bos_token_id``,
    ``no_repeat_ngram_size``, ``num_beams``, ``max_length``...). Unreadable files are skipped; the import of
    ``config.json`` itself reports those."""
    root = Path(root)
    sources = []
    for name in ("generation_config.json", "config.json"):
        try:
            data = read_json(root / name, fix="")
        except RagError:
            continue
        if isinstance(data, dict):
            sources.append(data)
            if name == "config.json" and isinstance(data.get("generator"), dict):
                sources.append(data["generator"])
    out = {}
    for key in GENERATION_KEYS:
        for src in sources:
            value = src.get(key)
            if value is not None:
                out[key] = value
                break
    if out.get("early_stopping") not in (None, True, False, "never"):
        out.pop("early_stopping")
    if isinstance(out.get("max_length"), int) and out["max_length"] < 2:
        out.pop("max_length")
    return out


def _load_state_dict(root: Path) -> dict:
    """All tensors of a transformers checkpoint directory (safetensors, sharded safetensors, or .bin)."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    single = root / "model.safetensors"
    index = root / "model.safetensors.index.json"
    legacy = root / "pytorch_model.bin"
    try:
        if single.is_file():
            return load_file(single)
        if index.is_file():
            weight_map = read_json(index, fix="download the checkpoint again")["weight_map"]
            if not isinstance(weight_map, dict):
                raise IntegrityError(f"{index}: 'weight_map' is not an object; download the checkpoint again")
            # Shard names come from a file: each must stay inside the checkpoint directory.
            shards = sorted({confined_path(root, name, index) for name in weight_map.values()})
            out: dict = {}
            for shard in shards:
                out.update(load_file(shard))
            return out
        if legacy.is_file():
            try:
                return torch.load(legacy, map_location="cpu", weights_only=True)
            except Exception as e:  # torch raises its unpickler's own error types for damaged or disallowed content
                raise RuntimeError(f"{legacy.name}: {e}") from e
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, EOFError, UnicodeDecodeError, SafetensorError) as e:
        raise IntegrityError(f"{root}: cannot read the RAG weights ({type(e).__name__}: {e}); download the "
                             f"checkpoint again") from e
    raise IntegrityError(f"{root}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin; the "
                         f"checkpoint is incomplete")


def split_hf_rag(src: Union[str, os.PathLike], out_dir: Union[str, os.PathLike]) -> tuple[Path, Path]:
    """Split a transformers RAG directory into ``out_dir/question_encoder`` and ``out_dir/generator``,
    ordinary ``save_pretrained`` checkpoints (config + safetensors + tokenizer) of a
    ``DPRQuestionEncoder`` and an ``AutoModelForSeq2SeqLM``. Returns the two paths.
    """
    from safetensors.torch import save_file
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, DPRQuestionEncoder, RagConfig

    root = Path(src)
    if not is_hf_rag_checkpoint(root):
        raise ConfigError(f"{root}: not a transformers RAG checkpoint (needs config.json with model_type 'rag')")
    for d in (root, root / _QUESTION_TOKENIZER_DIR, root / _GENERATOR_TOKENIZER_DIR):  # transformers parses them unbounded
        check_json_files(d, fix="download the checkpoint again")
    hf_config = RagConfig.from_pretrained(root)
    if getattr(hf_config.question_encoder, "model_type", None) != "dpr":
        raise ConfigError(
            f"{root}: the question encoder is a {hf_config.question_encoder.model_type!r} model; only DPR question encoders "
            "are supported (transformers uses their pooler output as the query vector)"
        )
    state = _load_state_dict(root)
    out = Path(out_dir)
    paths = {}
    for part, tok_dir in (("question_encoder", _QUESTION_TOKENIZER_DIR), ("generator", _GENERATOR_TOKENIZER_DIR)):
        sub = {}
        for key, tensor in state.items():
            name = key.removeprefix("rag.")
            if name.startswith(part + "."):
                # clone: legacy .bin files share storage between tied weights, which safetensors refuses
                sub[name[len(part) + 1:]] = tensor.detach().clone().contiguous()
        if not sub:
            raise IntegrityError(f"{root}: the weights hold no '{part}.*' tensors; the checkpoint is incomplete or "
                                 f"not a RAG model")
        tmp = out / f"{part}.raw"
        tmp.mkdir(parents=True, exist_ok=True)
        getattr(hf_config, part).save_pretrained(tmp)
        save_file(sub, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        loader = DPRQuestionEncoder if part == "question_encoder" else AutoModelForSeq2SeqLM
        model, info = loader.from_pretrained(tmp, output_loading_info=True)
        problems = {k: sorted(v) for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
        if problems:
            raise IntegrityError(f"{root}: the {part} weights do not fit its config: {problems}")
        if (root / tok_dir).is_dir():
            tokenizer = AutoTokenizer.from_pretrained(root / tok_dir)
        else:
            raise ConfigError(
                f"{root / tok_dir}: missing; save the tokenizers with RagTokenizer.save_pretrained({str(root)!r}) "
                "(question_encoder_tokenizer/ and generator_tokenizer/)"
            )
        final = out / part
        model.save_pretrained(final, safe_serialization=True)
        tokenizer.save_pretrained(final)
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
        paths[part] = final
    return paths["question_encoder"], paths["generator"]


def _assemble(src: Path, work: Path, knowledge_base, marginalization: Optional[str], overrides: dict):
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, RagConfig

    check_json_files(src, fix="download the checkpoint again")  # transformers parses them without bounds
    hf_config = RagConfig.from_pretrained(src)
    config = rag_config_from_hf(hf_config, marginalization, stored_generation_settings(src), **overrides)
    qdir, gdir = split_hf_rag(src, work)
    kb = open_knowledge_base(knowledge_base)
    qenc = TextEncoder(str(qdir), role="question")
    qenc.name_or_path = f"{src}:question_encoder"
    gen = AutoModelForSeq2SeqLM.from_pretrained(gdir)
    gen.config._name_or_path = f"{src}:generator"
    tok = AutoTokenizer.from_pretrained(gdir)
    return RagModel(qenc, gen, tok, kb, config)


def load_hf_rag(src: Union[str, os.PathLike], knowledge_base, *, marginalization: Optional[str] = None, **config_overrides):
    """Load a transformers RAG checkpoint (local directory, or hub id where a hub is reachable) as a
    RagModel with ``hf_compat=True`` over `knowledge_base` (a directory or KnowledgeBase).

    `config_overrides` replace RagModelConfig fields (e.g. ``n_docs=10``; unknown names are refused with the
    valid list). The decoding options stored with the checkpoint (``generation_config.json``, the generator
    config: ``num_beams``, ``max_length``, ``no_repeat_ngram_size``, ``forced_bos_token_id``...) become
    ``config.generation``, the defaults of :meth:`RagPipeline.generate <rag.pipeline.api.RagPipeline.generate>`.
    Returns the model in eval mode.
    """
    root = resolve_checkpoint_dir(src, "transformers RAG checkpoint")
    with tempfile.TemporaryDirectory(prefix="rag-hf-import-") as work:
        model = _assemble(root, Path(work), knowledge_base, marginalization, config_overrides)
    return model.eval()


def convert_hf_rag(
    src: Union[str, os.PathLike],
    dst: Union[str, os.PathLike],
    knowledge_base,
    *,
    marginalization: Optional[str] = None,
    overwrite: bool = False,
    **config_overrides,
) -> Path:
    """Convert a transformers RAG checkpoint into a RagModel checkpoint directory `dst`
    (``RagModel.save_pretrained`` layout, checksummed), referencing `knowledge_base`."""
    model = load_hf_rag(src, knowledge_base, marginalization=marginalization, **config_overrides)
    dst = Path(dst)
    if dst.exists() and any(dst.iterdir()) and not overwrite:
        raise FileExistsError(f"{dst} exists and is not empty; choose another directory or pass overwrite=True")
    model.save_pretrained(dst, overwrite=overwrite)
    return dst
