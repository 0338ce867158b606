"""RagModel checkpoint directories: save and load, with per-file SHA-256 checksums and weights-fingerprint checks.

Layout (written atomically by :func:`save_rag_model`)::

    rag_config.json     RagModelConfig, component identities, the knowledge base's path and
                        version (referenced, not copied) and SHA-256 of every component file
    question_encoder/   TextEncoder.save_pretrained (safetensors + tokenizer + pooling settings),
                        absent when the encoder is referenced by name and fingerprint
    generator/          generator.save_pretrained (safetensors) + its tokenizer; for a LoRA-adapted causal generator
                        only peft's adapter files, ``rag_config.json`` naming the base (name + SHA-256 of its files,
                        :mod:`rag.generators.lora`), whose own files and tokenizer are loaded from there and checked
    doc_encoder/        the trained document encoder (only with ``train_doc_encoder``)

:meth:`RagModel.save_pretrained <rag.models.rag.model.RagModel.save_pretrained>` and
:meth:`~rag.models.rag.model.RagModel.from_pretrained` are thin calls into this module; the transformers
importer (:mod:`rag.models.rag.hf_compat`) uses its directory and knowledge-base helpers.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Literal, TypeVar, Union

from torch import nn

from rag.demo.kb import KNOWLEDGE_BASE_NAMES, demo_kb_path, resolve_knowledge_base
from rag.generators.load import load_generator
from rag.generators.lora import ADAPTER_FILES, base_identity, base_model_of, is_adapter, load_adapter
from rag.generators.warm_start import is_warm_start, save_generator
from rag.knowledge.encoders import TextEncoder, check_fingerprint, resolve_name_or_path
from rag.knowledge.retriever import check_compatible
from rag.models.rag.config import RagModelConfig, check_overrides
from rag.utils.checksums import confined_path, file_checksums, verify_files
from rag.utils.errors import ConfigError, IntegrityError, RagError
from rag.utils.files import read_json, readable_model_files
from rag.utils.hub import resolve_recorded_name
from rag.utils.io import atomic_directory, atomic_write_json, check_output_dir

_Model = TypeVar("_Model", bound=nn.Module)
"""A RagModel (or a subclass): written and rebuilt here by what it holds, not by importing its module, which imports this."""

logger = logging.getLogger(__name__)

__all__ = [
    "CHECKPOINT_CONFIG", "CHECKPOINT_FORMAT", "save_rag_model", "load_rag_model", "resolve_checkpoint_dir",
    "open_knowledge_base", "check_overrides", "is_hf_rag_checkpoint", "knowledge_base_reference", "referenced_knowledge_base",
    "readable_weights", "save_model_directory",
]

CHECKPOINT_CONFIG = "rag_config.json"
CHECKPOINT_FORMAT = 1
QUESTION_ENCODER_DIR = "question_encoder"
GENERATOR_DIR = "generator"
DOC_ENCODER_DIR = "doc_encoder"

_INCOMPLETE = "the checkpoint is incomplete — save it again"


def resolve_checkpoint_dir(path: Union[str, os.PathLike], what: str) -> Path:
    """A local directory as is; otherwise try it as a hub repository id (works only where a hub is reachable)."""
    p = Path(os.fspath(path))
    if p.is_dir():
        return p
    if p.exists():
        raise ConfigError(f"{p}: is a file; {what} must be a checkpoint directory or a hub repository id")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id=os.fspath(path)))
    except Exception as e:  # offline, unknown repo, bad id — all the same to the user
        raise ConfigError(
            f"{path!s}: no such {what} directory, and it could not be fetched as a hub repository id ({type(e).__name__}: {e}); "
            "pass a local directory written by save_pretrained"
        ) from e


def is_hf_rag_checkpoint(path: Union[str, os.PathLike]) -> bool:
    """True if `path` is a local directory whose ``config.json`` has ``model_type == "rag"``."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return False
    try:
        data = read_json(cfg, fix="")
    except RagError:
        return False
    return isinstance(data, dict) and data.get("model_type") == "rag"


open_knowledge_base = resolve_knowledge_base
"""`kb` if it is a KnowledgeBase, "demo", else the knowledge-base directory it names, opened and verified (the one
resolver, :func:`rag.demo.kb.resolve_knowledge_base`)."""


# --------------------------------------------------------------------------- saving


def is_checkpoint_dir(path: Path) -> bool:
    """True for a directory holding a RagModel checkpoint (its ``rag_config.json``): the only kind a save replaces."""
    return (Path(path) / CHECKPOINT_CONFIG).is_file()


def check_knowledge_base_version(root: Path, kb, kb_ref: dict) -> None:
    """Warn when `kb` is not the knowledge base the model at `root` was saved with. A rebuild of the same passages with
    the same encoder and index spec (its embeddings, hence its version, differ by float rounding: another machine,
    thread count or torch) holds the same knowledge: that is logged at INFO, not warned about."""
    if not kb_ref.get("version") or kb.version == kb_ref["version"]:
        return
    same = (kb_ref.get("passages_digest") is not None and kb_ref.get("passages_digest") == kb.manifest.passages_digest
            and (kb_ref.get("encoder") or {}).get("fingerprint") == kb.encoder.get("fingerprint"))
    if same:
        logger.info("%s: knowledge base %s (%s) is a rebuild of the one the model was saved with (%s): same passages and "
                    "encoder", root, kb.path, kb.version, kb_ref["version"])
    else:
        logger.warning("%s: knowledge base %s is version %s; the model was saved with %s", root, kb.path, kb.version,
                       kb_ref["version"])


def save_rag_model(model: nn.Module, path: Union[str, os.PathLike], overwrite: bool = False, *,
                   reference_query_encoder: bool = False) -> None:
    """Write `model` as a checkpoint directory (see :meth:`RagModel.save_pretrained
    <rag.models.rag.model.RagModel.save_pretrained>` for the options and errors)."""
    path = Path(path)
    if path.exists():
        if not path.is_dir():
            raise RagError(f"{path} exists and is not a directory; choose another path")
        if any(path.iterdir()) and not is_checkpoint_dir(path):
            raise RagError(f"{path} holds files that are not a RagModel checkpoint, so it is never replaced (not even with "
                           "overwrite=True); choose another path")
    kb = model.knowledge_base
    kb_ref = None
    if kb is not None:
        kb_ref = {
            **knowledge_base_reference(Path(kb.path), path),
            "version": kb.version,
            "passages_digest": kb.manifest.passages_digest,
            "dim": kb.dim,
            "encoder": kb.encoder,
            "space": getattr(model.retriever, "space", kb.encoder.get("fingerprint")),
        }
    qenc_meta = referenced_query_encoder(model.question_encoder) if reference_query_encoder else None
    with atomic_directory(path, overwrite=True, replaces=is_checkpoint_dir, kind="RagModel checkpoint") as tmp:
        if qenc_meta is None:
            model.question_encoder.save_pretrained(tmp / QUESTION_ENCODER_DIR)
            qenc_meta = {"dir": QUESTION_ENCODER_DIR, **model.question_encoder.identity()}
        gdir = tmp / GENERATOR_DIR
        adapter = None
        if is_adapter(model.generator):  # the adapter only; the base is named, with its checksums
            adapter = {"base": base_identity(model.generator)}
            model.generator.save_pretrained(gdir, safe_serialization=True)
            (gdir / "README.md").unlink(missing_ok=True)  # peft's model-card stub: nothing loading needs
            _sort_adapter_modules(gdir / "adapter_config.json")
        elif is_warm_start(model.generator):  # trained weights only; the frozen encoder is referenced
            save_generator(model.generator, model.generator_tokenizer, gdir)
        else:
            model.generator.save_pretrained(gdir, safe_serialization=True)
            model.generator_tokenizer.save_pretrained(gdir)
        saved_dirs = [GENERATOR_DIR] if "dir" not in qenc_meta else [QUESTION_ENCODER_DIR, GENERATOR_DIR]
        denc_meta = None
        if model.doc_encoder is not None and model.config.train_doc_encoder:  # trained weights: keep them
            model.doc_encoder.save_pretrained(tmp / DOC_ENCODER_DIR)
            denc_meta = {"dir": DOC_ENCODER_DIR, **model.doc_encoder.identity()}
            saved_dirs.append(DOC_ENCODER_DIR)
        meta = {
            "format": CHECKPOINT_FORMAT,
            # a learned retrieval temperature is saved as the value it reached
            "config": {**model.config.to_dict(), "retrieval_temperature": model.retrieval_temperature},
            "question_encoder": qenc_meta,
            "generator": {
                "dir": GENERATOR_DIR,
                "class": type(base_model_of(model.generator)).__name__,
                "kind": model.generator_kind,
                "model_type": getattr(model.generator.config, "model_type", None),
                # an adapter's base by the name it was loaded by ("smollm2"), never this machine's path to it
                "name": adapter["base"]["name"] if adapter is not None
                else getattr(model.generator.config, "_name_or_path", None) or None,
                **({"adapter": adapter} if adapter is not None else {}),
            },
            "knowledge_base": kb_ref,
            "doc_encoder": denc_meta,
            "files": file_checksums(tmp, (f for sub in saved_dirs for f in (tmp / sub).rglob("*") if f.is_file())),
        }
        atomic_write_json(tmp / CHECKPOINT_CONFIG, meta)


# --------------------------------------------------------------------------- knowledge-base references

WELL_KNOWN_KBS = tuple(KNOWLEDGE_BASE_NAMES)
"""Knowledge bases a checkpoint may name instead of a path (:data:`rag.demo.kb.KNOWLEDGE_BASE_NAMES`): "demo" is
:func:`rag.demo.kb.ensure_demo_kb`'s (``$RAG_CACHE/demo_kb``, built from the bundled corpus on first use)."""

_MAX_UP = 2  # a knowledge base at most this many directories above the checkpoint is referenced relatively


def knowledge_base_reference(kb_path: Path, checkpoint: Path) -> dict:
    """How ``rag_config.json`` refers to the knowledge base at `kb_path`, portably: ``{"name": "demo"}`` for the
    demo knowledge base; else ``path``, relative to the `checkpoint` directory when the knowledge base lies inside
    it or near it (sharing an ancestor at most two levels up), otherwise absolute, and ``saved_at``, its absolute
    path when saved (tried second, so that a checkpoint copied alone still finds it on the same machine)."""
    kb_abs = Path(kb_path).resolve()
    if kb_abs == demo_kb_path().resolve():
        return {"name": "demo", "path": None}
    rel = Path(os.path.relpath(kb_abs, Path(checkpoint).resolve()))
    if rel.parts.count("..") <= _MAX_UP and not rel.is_absolute():
        return {"path": rel.as_posix(), "saved_at": str(kb_abs)}
    return {"path": str(kb_abs)}


def referenced_knowledge_base(root: Path, kb_ref: dict):
    """The knowledge base the checkpoint at `root` references (``kb_ref``: its ``knowledge_base`` entry): the
    well-known demo knowledge base (opened, or built on first use), or a directory — relative paths are taken
    relative to the checkpoint. It is an external artefact, opened and verified against its own manifest.
    ConfigError when it is not here, saying to pass ``--kb`` (CLI) / ``knowledge_base=`` (Python)."""
    cfg_file = root / CHECKPOINT_CONFIG
    how = ("pass one with `--kb <directory>` (rag generate / rag serve) or knowledge_base=<directory> (rag.load, "
           "RagModel.from_pretrained)")
    name = kb_ref.get("name")
    if name is not None:
        if name not in WELL_KNOWN_KBS:
            raise ConfigError(f"{cfg_file}: names knowledge base {name!r}, not one of {list(WELL_KNOWN_KBS)}; {how}")
        return resolve_knowledge_base(name)
    path = kb_ref.get("path")
    if not path:
        raise ConfigError(f"{cfg_file}: records no knowledge base; {how}")
    if not isinstance(path, str):
        raise ConfigError(f"{cfg_file}: knowledge_base.path must be a string, got {type(path).__name__}; {how}")
    tried = [Path(path) if Path(path).is_absolute() else root / path]
    if isinstance(kb_ref.get("saved_at"), str) and Path(kb_ref["saved_at"]).is_absolute():
        tried.append(Path(kb_ref["saved_at"]))
    for kb_dir in tried:
        if kb_dir.is_dir():
            return kb_dir
    raise ConfigError(f"{cfg_file}: references knowledge base {path!r}, which is not on this machine "
                      f"(looked in {' and '.join(map(str, tried))}); {how}")


def _sort_adapter_modules(config_file: Path) -> None:
    """peft writes ``target_modules`` from a set, in an order that changes with the process's hash seed; sorted, the
    same adapter exports to the same bytes (and checksum)."""
    config = read_json(config_file, fix="re-export the model")
    if isinstance(config.get("target_modules"), list):
        config["target_modules"] = sorted(config["target_modules"])
        atomic_write_json(config_file, config)


def save_model_directory(model: nn.Module, directory: Union[str, os.PathLike], *, overwrite: bool = False) -> Path:
    """Write a trained :class:`~rag.models.rag.model.RagModel` as a model directory, its query encoder referenced by name
    when its weights are still those the name loads (else copied)."""
    check_output_dir(directory, overwrite, replaces=lambda p: (p / "rag_config.json").is_file(), kind="RAG model directory",
                     option="DIR")
    try:
        referenced_query_encoder(model.question_encoder)  # loads the encoder by its name and compares the weights
        reference = True
    except RagError:
        reference = False
        logger.info("the query encoder changed in training: its weights are copied into %s", directory)
    model.save_pretrained(directory, overwrite=overwrite, reference_query_encoder=reference)
    return Path(directory)


def referenced_query_encoder(qenc) -> dict:
    """The ``rag_config.json`` entry that references the query encoder `qenc` by name instead of
    copying it; RagError unless loading that name reproduces the current weights exactly."""
    identity = qenc.identity()
    try:
        fresh = TextEncoder(qenc.name_or_path, pooling=qenc.pooling, normalize=qenc.normalize, max_length=qenc.max_length)
    except RagError as e:
        raise RagError(
            f"reference_query_encoder=True, but the query encoder's name {qenc.name_or_path!r} cannot be loaded ({e}); "
            "save its weights instead (reference_query_encoder=False)"
        ) from e
    check_fingerprint(fresh, identity["fingerprint"], lambda found: (
        f"reference_query_encoder=True, but the query encoder's weights differ from those {qenc.name_or_path!r} loads "
        f"(fingerprint {identity['fingerprint'][:12]}… vs {found[:12]}…), e.g. after end-to-end training; "
        "save its weights instead (reference_query_encoder=False), or train with freeze_query_encoder=True"))
    return {"reference": True, **identity}


# --------------------------------------------------------------------------- loading


def load_rag_model(
    cls: type[_Model],
    path: Union[str, os.PathLike],
    knowledge_base=None,
    *,
    verify: Literal["full", "size", "none"] = "full",
    allow_encoder_change: bool = False,
    **config_overrides,
) -> _Model:
    """Load a checkpoint directory as a `cls` (a RagModel class); see :meth:`RagModel.from_pretrained
    <rag.models.rag.model.RagModel.from_pretrained>` for the options and errors. Returned in eval mode."""
    root = resolve_checkpoint_dir(path, "RagModel checkpoint")
    cfg_file = root / CHECKPOINT_CONFIG
    if not cfg_file.is_file():
        hint = (" It looks like a transformers RAG checkpoint: load it with rag.models.rag.hf_compat.load_hf_rag"
                if is_hf_rag_checkpoint(root) else "")
        raise ConfigError(f"{cfg_file}: missing; {root} is not a RagModel checkpoint (save one with "
                          f"RagModel.save_pretrained).{hint}")
    meta = read_json(cfg_file, fix="restore the checkpoint")
    if not isinstance(meta, dict) or meta.get("format") != CHECKPOINT_FORMAT:
        raise ConfigError(f"{cfg_file}: unknown checkpoint format {meta.get('format') if isinstance(meta, dict) else meta!r} "
                          f"(expected {CHECKPOINT_FORMAT})")
    gen_meta, qenc_meta, denc_meta = (_entry(meta, k, cfg_file) for k in ("generator", "question_encoder", "doc_encoder"))
    if gen_meta is None:
        raise ConfigError(f"{cfg_file}: has no 'generator' entry (e.g. {{\"dir\": \"{GENERATOR_DIR}\"}}); the file was edited or "
                          "written by something else — restore it or save the model again with RagModel.save_pretrained")
    # Component directories read from the file stay inside the checkpoint; every file in them is checksummed.
    gen_dir = confined_path(root, gen_meta.get("dir", GENERATOR_DIR), cfg_file)
    qenc_dir = None if (qenc_meta or {}).get("reference") else confined_path(root,
                                                                             (qenc_meta or {}).get("dir", QUESTION_ENCODER_DIR),
                                                                             cfg_file)
    denc_dir = confined_path(root, denc_meta.get("dir", DOC_ENCODER_DIR), cfg_file) if denc_meta else None
    loaded = [d.relative_to(root).as_posix() for d in (gen_dir, qenc_dir, denc_dir) if d is not None]
    adapter = _entry(gen_meta, "adapter", cfg_file)
    gen_rel = gen_dir.relative_to(root).as_posix()
    required = [f"{d}/config.json" for d in loaded if d != gen_rel or adapter is None]
    required += [f"{gen_rel}/{n}" for n in ADAPTER_FILES] if adapter is not None else []
    verify_files(root, meta.get("files"), verify, record=cfg_file, incomplete=_INCOMPLETE, fix="restore the checkpoint",
                 required=required, dirs=loaded)
    config = RagModelConfig.from_dict(meta.get("config", {}), str(cfg_file))
    if config_overrides:
        config = dataclasses.replace(config, **check_overrides(config_overrides))

    kb_ref = _entry(meta, "knowledge_base", cfg_file) or {}
    kb = open_knowledge_base(knowledge_base if knowledge_base is not None else referenced_knowledge_base(root, kb_ref))
    check_knowledge_base_version(root, kb, kb_ref)

    with readable_weights(cfg_file):
        qenc = _load_query_encoder(root, qenc_meta or {}, verify, qenc_dir)
    if config.retrieval == "dense":
        check_compatible(kb, qenc.dim, kb_ref.get("space"), allow_encoder_change=allow_encoder_change)
    with readable_weights(cfg_file):
        if adapter is not None:  # the base by its recorded name, checked against its recorded checksums
            gen, tok = load_adapter(gen_dir, _entry(adapter, "base", cfg_file) or {}, where=cfg_file)
        else:
            gen, tok, _ = load_generator(gen_dir)
        denc = TextEncoder.from_pretrained(denc_dir) if denc_dir is not None and config.uses_doc_encoder else None
    model = cls(qenc, gen, tok, kb, config, doc_encoder=denc)
    if config.retrieval == "dense":
        model.retriever.allow_encoder_change = allow_encoder_change
    return model.eval()


def _entry(meta: dict, key: str, cfg_file: Path):
    """``meta[key]``: None when absent or null, else it must be a JSON object."""
    value = meta.get(key)
    if value is not None and not isinstance(value, dict):
        raise ConfigError(f"{cfg_file}: field {key!r} must be an object, got {type(value).__name__}; restore the file or save "
                          f"the model again")
    return value


def readable_weights(record: Path):
    """Turn a weights or config file that cannot be parsed (garbage in ``model.safetensors``, a truncated
    ``config.json``) into an IntegrityError naming that file of the checkpoint, instead of the parser's own exception."""
    return readable_model_files(record.parent, "a component file of the RAG checkpoint",
                                "the checkpoint is damaged — restore it, or save the model again (load with verify='full' to "
                                "find the altered file)")


def _load_query_encoder(root: Path, entry: dict, verify: str, qdir: Path | None = None):
    """The checkpoint's query encoder: its saved copy (in `qdir`), or the encoder it references by name, whose
    weights fingerprint must then equal the recorded one (unless ``verify="none"``)."""
    if not entry.get("reference"):
        return TextEncoder.from_pretrained(qdir if qdir is not None else root / QUESTION_ENCODER_DIR)
    cfg_file = root / CHECKPOINT_CONFIG
    missing = [k for k in ("name", "fingerprint", "pooling", "normalize", "max_length") if k not in entry]
    if missing:
        raise IntegrityError(f"{cfg_file}: the referenced query encoder lacks field(s) {missing}; save the model again")
    name = entry["name"]
    try:
        if not (isinstance(name, str) and os.path.isdir(resolve_name_or_path(name))):  # a bundled alias loads as named
            name = resolve_recorded_name(name, "question_encoder.name", cfg_file)
        qenc = TextEncoder(name, pooling=entry["pooling"], normalize=entry["normalize"], max_length=entry["max_length"])
    except RagError as e:
        raise ConfigError(
            f"{cfg_file}: references the query encoder {name!r} by name (its weights are not in the checkpoint), "
            f"and it cannot be loaded here: {e}"
        ) from e
    if verify != "none":
        check_fingerprint(qenc, entry["fingerprint"], lambda found: (
            f"{cfg_file}: references the query encoder {name!r} with weights fingerprint {entry['fingerprint'][:16]}…, "
            f"but {name!r} loads here with fingerprint {found[:16]}… (a different version of the encoder); install the "
            "version the model was saved with, or load with verify='none' to accept it unchecked"), error=IntegrityError)
    return qenc

def is_lightning_checkpoint(path: Union[str, os.PathLike]) -> bool:
    """True for a file that looks like a Lightning / torch checkpoint (``.ckpt``, or a zip archive torch wrote)."""
    p = Path(path)
    if not p.is_file():
        return False
    if p.suffix == ".ckpt":
        return True
    try:
        with open(p, "rb") as f:
            return f.read(4) == b"PK\x03\x04"  # torch.save's zip container
    except OSError:
        return False
