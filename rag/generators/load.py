"""Generator loading: one entry point for every reader, seq2seq (BART, T5, warm-start) or causal (GPT-2, Llama, OPT).

``load_generator(path) -> (model, tokenizer, kind)`` reads the checkpoint's config, decides its kind and
loads it with the matching ``transformers`` auto class, so the seq2seq RAG model and the decoder-only
readers (In-Context RALM, REPLUG) share one loader, and a checkpoint of the wrong kind is refused with
a message that names the option to change instead of failing deep inside a forward pass.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Literal, Optional, Union

from rag.generators.base import Generator
from rag.generators.causal import CausalGenerator
from rag.generators.demo_lm import DEMO_LM_NAMES, prepare_demo_lm
from rag.generators.seq2seq import Seq2SeqGenerator
from rag.generators.warm_start import WARM_START_KEY, load_seq2seq
from rag.knowledge.encoders import resolve_name_or_path
from rag.utils.errors import ConfigError, IntegrityError, RagError
from rag.utils.files import check_json_files, read_json, readable_model_files

__all__ = ["GeneratorKind", "GENERATOR_KINDS", "generator_kind", "checkpoint_generator_kind", "load_generator",
           "check_generator_kind",
           "as_generator", "is_causal_lm_checkpoint", "is_seq2seq_checkpoint"]

GeneratorKind = Literal["seq2seq", "causal"]
GENERATOR_KINDS: tuple[str, ...] = ("seq2seq", "causal")

_WHAT = {"seq2seq": "a seq2seq (encoder-decoder) generator such as BART or T5",
         "causal": "a decoder-only (causal) LM such as GPT-2 or Llama"}


def generator_kind(model_or_config: Any) -> GeneratorKind:
    """``"seq2seq"`` for an encoder-decoder model or config, else ``"causal"``."""
    cfg = getattr(model_or_config, "config", model_or_config)
    return "seq2seq" if getattr(cfg, "is_encoder_decoder", False) else "causal"


_FAMILIES = {"seq2seq": Seq2SeqGenerator, "causal": CausalGenerator}


def as_generator(model: Any, tokenizer: Any) -> Generator:
    """`model` and its `tokenizer` as the :class:`~rag.generators.base.Generator` of its family (seq2seq or causal)."""
    return _FAMILIES[generator_kind(model)](model, tokenizer)


def check_generator_kind(model: Any, expected: GeneratorKind, where: str) -> None:
    """ConfigError unless ``model`` is of kind ``expected``; the message says what was given and what to pass."""
    if expected not in GENERATOR_KINDS:
        raise ConfigError(f"generator kind {expected!r}; choose one of {GENERATOR_KINDS}")
    found = generator_kind(model)
    if found != expected:
        name = getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__
        hint = ("use rag.models.ralm.model for decoder-only readers (In-Context RALM, REPLUG)" if found == "causal"
                else "use RagModel for seq2seq generators")
        raise ConfigError(f"{where} needs {_WHAT[expected]}, got {_WHAT[found]} ({name}); {hint}")


_FIX = "restore the generator directory"


def _read_config(path: Path) -> Optional[dict]:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        return None
    cfg = read_json(cfg_file, fix=_FIX)
    if not isinstance(cfg, dict):
        raise IntegrityError(f"{cfg_file}: is not a JSON object; restore the generator directory")
    return cfg


def checkpoint_generator_kind(path: Union[str, os.PathLike]) -> Optional[GeneratorKind]:
    """The kind of a plain generator checkpoint — a demo LM alias (causal), or a directory with a transformers
    ``config.json`` or a warm-start generator — without loading weights; None for anything else (a RagModel or
    transformers RAG checkpoint, a hub id, a missing path)."""
    name = os.fspath(path)
    if name in DEMO_LM_NAMES and not os.path.isdir(name):
        return "causal"
    local = Path(name)
    if not local.is_dir() or (local / "rag_config.json").is_file():
        return None
    raw = _read_config(local)
    if raw is None or raw.get("model_type") == "rag":
        return None
    if WARM_START_KEY in raw:
        return "seq2seq"
    if "is_encoder_decoder" in raw:
        return "seq2seq" if raw["is_encoder_decoder"] else "causal"
    from transformers import AutoConfig

    try:
        return generator_kind(AutoConfig.from_pretrained(name))
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read the model config in {name!r}: {e}; pass a directory written by save_pretrained") from e


def is_causal_lm_checkpoint(path: Union[str, os.PathLike]) -> bool:
    """Whether `path` is a plain causal LM checkpoint or a demo LM alias (what In-Context RALM and REPLUG read)."""
    return checkpoint_generator_kind(path) == "causal"


def is_seq2seq_checkpoint(path: Union[str, os.PathLike]) -> bool:
    """Whether `path` is a plain seq2seq generator checkpoint (BART, T5, warm-start), not a RAG model around one."""
    return checkpoint_generator_kind(path) == "seq2seq"


def _one_line(error: BaseException) -> str:
    """An exception's message on one line (transformers' messages span several), cut to a readable length."""
    text = " ".join(str(error).split())
    return text if len(text) <= 300 else text[:297] + "..."


def _ensure_pad_token(tokenizer, model, where: str) -> None:
    """Causal LMs often ship without a pad token: pad with EOS (padding is always masked); neither is an error."""
    if getattr(tokenizer, "pad_token_id", None) is not None:
        return
    eos = getattr(tokenizer, "eos_token", None)
    if eos is None:
        raise ConfigError(
            f"{where}: the tokenizer has neither a pad nor an EOS token; set one (tokenizer.pad_token = ...) "
            "and save the tokenizer again"
        )
    tokenizer.pad_token = eos
    gen_cfg = getattr(model, "generation_config", None)
    if gen_cfg is not None and getattr(gen_cfg, "pad_token_id", None) is None:
        gen_cfg.pad_token_id = tokenizer.pad_token_id


def load_generator(path: Union[str, os.PathLike], *, kind: Optional[GeneratorKind] = None, **from_pretrained_kw):
    """Load a generator directory (or hub id, where a hub is reachable) as ``(model, tokenizer, kind)``.

    Args:
        path: a ``save_pretrained`` directory, a warm-start generator directory
            (:func:`rag.generators.warm_start.save_generator`), a hub id, or a demo LM alias
            (:data:`rag.generators.demo_lm.DEMO_LM_NAMES`, e.g. ``"smollm2"``: converted on first use, then cached).
        kind: the kind the caller needs; a checkpoint of the other kind is refused (ConfigError).
        from_pretrained_kw: passed to ``from_pretrained`` (e.g. ``torch_dtype``).

    Returns:
        ``(model, tokenizer, kind)``, the model in eval mode; a causal LM's tokenizer pads with EOS
        when it has no pad token.

    Raises:
        ConfigError: the checkpoint cannot be loaded, or is not of ``kind``, or its tokenizer has
            neither pad nor EOS token.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

    if kind is not None and kind not in GENERATOR_KINDS:
        raise ConfigError(f"kind={kind!r}; choose one of {GENERATOR_KINDS}")
    original = path
    if os.fspath(path) in DEMO_LM_NAMES and not os.path.isdir(os.fspath(path)):
        path = prepare_demo_lm()  # converted once, then reused from the cache after its checksums are checked
    src = resolve_name_or_path(os.fspath(path))
    local = Path(src)
    raw = _read_config(local) if local.is_dir() else None
    check_json_files(local, fix=_FIX)  # transformers and tokenizers parse them without bounds
    if raw is not None and WARM_START_KEY in raw:
        found: GeneratorKind = "seq2seq"
    else:
        try:
            config = AutoConfig.from_pretrained(src)
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot load a generator config from {os.fspath(path)!r}: {_one_line(e)}; pass a "
                              f"directory written "
                              "by save_pretrained") from e
        found = generator_kind(config)
    if kind is not None and found != kind:
        raise ConfigError(
            f"{os.fspath(path)}: is {_WHAT[found]}, but {_WHAT[kind]} is needed here; "
            + ("pass it to the decoder-only reader (rag.models.ralm.model / `rag lm-eval --model`) instead" if found == "causal"
               else "pass it as a RagModel generator (`--model.generator`) instead")
        )
    if found == "seq2seq" and from_pretrained_kw and raw is not None and WARM_START_KEY in raw:
        raise ConfigError(f"{os.fspath(path)}: a warm-start generator takes no from_pretrained options, got "
                          f"{sorted(from_pretrained_kw)}")
    try:
        # A damaged weights or tokenizer file (``SafetensorError: header too large``) is named, as for RAG checkpoints.
        with readable_model_files(local, f"the generator ({_WHAT[found]})", _FIX) if local.is_dir() else contextlib.nullcontext():
            if found == "seq2seq":
                if from_pretrained_kw:
                    model, tok = AutoModelForSeq2SeqLM.from_pretrained(src,
                                                                       **from_pretrained_kw), AutoTokenizer.from_pretrained(src)
                else:
                    model, tok = load_seq2seq(src)
            else:
                model, tok = AutoModelForCausalLM.from_pretrained(src, **from_pretrained_kw), AutoTokenizer.from_pretrained(src)
    except (OSError, ValueError) as e:
        if isinstance(e, RagError):
            raise
        raise ConfigError(f"cannot load the generator {os.fspath(path)!r} ({_WHAT[found]}): {_one_line(e)}") from e
    if found == "causal":
        _ensure_pad_token(tok, model, os.fspath(path))
    model._rag_source = os.fspath(original)  # what an adapter trained on it names as its base (rag.generators.lora)
    return model.eval(), tok, found
