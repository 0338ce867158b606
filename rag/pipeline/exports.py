"""One export format for every reader: a model directory holding ``reader.json``, which names the reader's method and
its settings, beside the generator's files.

* ``"method": "rag"`` — a :meth:`RagModel.save_pretrained <rag.models.rag.model.RagModel.save_pretrained>` directory
  (``rag_config.json``, ``generator/``, …; seq2seq or causal generator). Settings: none (the RAG config is the model's).
* ``"method": "ralm"`` — a causal LM's ``save_pretrained`` files (weights, ``config.json``, tokenizer) and its
  In-Context RALM settings: the :class:`~rag.models.ralm.model.RalmConfig` fields (``ensemble`` set: a REPLUG
  ensemble) and the default ``retrieval``.

:func:`export_reader` writes any reader; :func:`load_reader` reads any export back (``rag.load`` probes for it first),
so a causal RAG model, an In-Context RALM reader and a REPLUG ensemble go through one loader. A RAG directory without
``reader.json`` (written before it existed) still loads as a RAG model.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Union

from rag.models.rag.checkpoint import save_model_directory
from rag.models.rag.model import RagModel
from rag.models.ralm.model import RalmConfig
from rag.pipeline.readers import RagReader, RalmReader
from rag.utils.errors import ConfigError
from rag.utils.files import read_json
from rag.utils.io import atomic_directory, atomic_write_text, to_json

__all__ = ["READER_MANIFEST", "READER_FORMAT", "is_reader_export", "export_reader", "export_causal_reader", "write_rag_export",
           "load_reader"]

READER_MANIFEST = "reader.json"
READER_FORMAT = "rag-reader/1"
_FIX = "restore the model directory, or export it again (rag export CKPT DIR)"


def is_reader_export(path: Union[str, os.PathLike]) -> bool:
    """Whether `path` is a model directory with a reader manifest."""
    return (Path(path) / READER_MANIFEST).is_file()


def _manifest(method: str, settings: dict) -> str:
    return to_json({"format": READER_FORMAT, "method": method, "settings": settings}, indent=2) + "\n"


def write_rag_export(model: RagModel, directory: Union[str, os.PathLike], *, overwrite: bool = False) -> Path:
    """A RAG model's directory (:func:`~rag.models.rag.checkpoint.save_model_directory`), then its manifest."""
    out = save_model_directory(model, directory, overwrite=overwrite)
    atomic_write_text(out / READER_MANIFEST, _manifest("rag", {}))
    return out


def export_causal_reader(generator, config: RalmConfig, retrieval, directory: Union[str, os.PathLike], *,
                         overwrite: bool = False) -> Path:
    """Write a causal `generator` (its LM and tokenizer) with its In-Context RALM `config` and default `retrieval`
    (``bm25`` | ``dense`` | None) as a ``"ralm"`` export; with `overwrite`, only a saved model is replaced."""
    config.check()
    settings = {**dataclasses.asdict(config), "retrieval": retrieval}
    with atomic_directory(directory, overwrite=overwrite, replaces=lambda p: (p / "config.json").is_file(),
                          kind="causal reader") as tmp:
        generator.model.save_pretrained(tmp)
        generator.tokenizer.save_pretrained(tmp)
        (tmp / READER_MANIFEST).write_text(_manifest("ralm", settings), encoding="utf-8")
    return Path(directory)


def export_reader(reader, directory: Union[str, os.PathLike], *, overwrite: bool = False) -> Path:
    """Write `reader` (a :class:`RagReader` or a :class:`RalmReader`, In-Context RALM or REPLUG) as a model directory
    that :func:`load_reader` (and ``rag.load``, ``rag generate --model DIR``) reads back. With `overwrite`, only an
    earlier export is replaced."""
    if isinstance(reader, RagReader):
        return write_rag_export(reader.model, directory, overwrite=overwrite)
    if not isinstance(reader, RalmReader):
        raise ConfigError(f"cannot export a {type(reader).__name__}: a RagReader or a RalmReader is exported")
    if reader.reranker is not None:
        raise ConfigError("a reader with a reranker (--rerank) is exported without it: export the LM's reader, and pass "
                          "the reranker again when loading")
    return export_causal_reader(reader.generator, reader.config, reader.retriever.default, directory, overwrite=overwrite)


def _load_rag(path: Path, settings: dict, knowledge_base, device, overrides: dict) -> RagReader:
    model = RagModel.from_pretrained(path, knowledge_base=knowledge_base, **overrides)
    return RagReader(model.to(device) if device is not None else model)


def _load_ralm(path: Path, settings: dict, knowledge_base, device, overrides: dict) -> RalmReader:
    known = {f.name for f in dataclasses.fields(RalmConfig)} | {"retrieval"}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise ConfigError(f"{path / READER_MANIFEST}: settings {unknown} are not In-Context RALM's ({sorted(known)}); {_FIX}")
    return RalmReader.load(path, knowledge_base, device=device, **{**settings, **overrides})


READER_LOADERS = {"rag": _load_rag, "ralm": _load_ralm}
"""Per method of a manifest, how its directory becomes a reader."""


def load_reader(path: Union[str, os.PathLike], knowledge_base=None, *, device=None, **overrides):
    """The reader exported at `path` (:func:`export_reader`); `overrides` replace its settings (RAG: RagModelConfig
    fields; In-Context RALM: RalmConfig fields and ``retrieval``), `knowledge_base` the one it reads."""
    path = Path(path)
    where = path / READER_MANIFEST
    meta = read_json(where, fix=_FIX)
    if not isinstance(meta, dict) or meta.get("format") != READER_FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ConfigError(f"{where}: unknown reader format {found!r} (expected {READER_FORMAT!r}); {_FIX}")
    method, settings = meta.get("method"), meta.get("settings", {})
    if method not in READER_LOADERS or not isinstance(settings, dict):
        raise ConfigError(f"{where}: method {method!r} with settings of type {type(settings).__name__}; expected one of "
                          f"{sorted(READER_LOADERS)} and an object; {_FIX}")
    return READER_LOADERS[method](path, settings, knowledge_base, device, overrides)
