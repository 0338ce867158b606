"""From training to answers: a Lightning checkpoint of ``rag fit`` (or a module at the end of ``fit``) written as the
model directory that ``rag generate --model DIR`` and ``rag.load(DIR)`` read.

* :class:`~rag.training.modules.RagModule` -> a :meth:`RagModel.save_pretrained <rag.models.rag.model.RagModel.save_pretrained>`
  directory; a query encoder that training left unchanged (e.g. the bundled MiniLM of a RAG-Frozen run) is referenced by
  name and weights fingerprint instead of copied.
* :class:`~rag.training.causal_reader.CausalReaderModule` -> the fine-tuned LM's ``save_pretrained`` directory with
  its In-Context RALM settings (``rag generate --model DIR --kb KB``).

Both are reader exports (:mod:`rag.pipeline.exports`: ``reader.json`` names the method), read by one loader.

Checkpoints are read with ``torch.load(weights_only=True)``: tensors and plain containers only, never pickled code. An
existing non-empty target is refused unless it holds an earlier export of the same kind and ``overwrite`` is set.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

import torch

from rag.training.causal_reader import CausalReaderModule
from rag.training.modules import RagModule
from rag.training.settings import upgrade_arguments
from rag.utils.errors import ConfigError
from rag.utils.io import check_output_dir

__all__ = ["export_checkpoint"]

RAG_MODULE = "rag.training.modules.RagModule"
CAUSAL_READER = "rag.training.causal_reader.CausalReaderModule"



def _module_arguments(ckpt: dict, where: Path) -> tuple[str, dict]:
    """The module class and constructor arguments a checkpoint records: LightningCLI writes ``_class_path``; a plain
    ``Trainer`` run does not, so the class is then recognised by its arguments."""
    hp = ckpt.get("hyper_parameters")
    if not isinstance(hp, dict) or not isinstance(ckpt.get("state_dict"), dict):
        raise ConfigError(f"{where}: not a Lightning checkpoint of a rag module (no hyper_parameters / state_dict); "
                          "export the .ckpt files `rag fit` writes")
    class_path = hp.get("_class_path")
    if not isinstance(class_path, str):
        class_path = RAG_MODULE if {"generator", "rag"} <= set(hp) else CAUSAL_READER if {"lm", "prompt"} <= set(hp) else "?"
    return class_path, {k: v for k, v in hp.items() if not k.startswith("_")}


def export_checkpoint(checkpoint: Union[str, os.PathLike], directory: Union[str, os.PathLike], *,
                      knowledge_base: Optional[Union[str, os.PathLike]] = None, overwrite: bool = False) -> Path:
    """Write the model of a ``rag fit`` checkpoint to `directory` (``rag export CKPT DIR``).

    `knowledge_base` replaces the one the run used (its recorded path is relative to where ``rag fit`` ran).

    Raises:
        ConfigError: not a ``rag fit`` checkpoint of a module that exports, or its knowledge base is not found.
        OutputExistsError: `directory` exists, is not empty and is not an earlier export (or `overwrite` is off).
    """
    src = Path(checkpoint)
    check_output_dir(directory, overwrite, replaces=lambda p: (p / "config.json").is_file() or (p / "rag_config.json").is_file(),
                     kind="model directory", option="DIR")
    if not src.is_file():
        raise ConfigError(f"{src}: no such checkpoint file; `rag fit` writes them under trainer.default_root_dir (e.g. "
                          "runs/NAME/checkpoints/last.ckpt)")
    try:
        ckpt = torch.load(src, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable / unsafe file is the user's to fix
        raise ConfigError(f"{src}: cannot be read as a checkpoint of tensors and plain values ({type(e).__name__}: {e}); "
                          "give a .ckpt file `rag fit` wrote") from None
    if not isinstance(ckpt, dict):
        raise ConfigError(f"{src}: not a Lightning checkpoint (a {type(ckpt).__name__}, not a dict)")
    class_path, args = _module_arguments(ckpt, src)
    if class_path == RAG_MODULE:
        if knowledge_base is not None:
            args["knowledge_base"] = os.fspath(knowledge_base)
        args = upgrade_arguments(class_path, args)  # a checkpoint of an earlier release: its flat options, grouped
        args["build_knowledge_base"] = None  # export reads the knowledge base the run used; it never builds one
        kb = Path(args["knowledge_base"])
        if not (kb / "manifest.json").is_file():
            raise ConfigError(f"{src}: the run's knowledge base {kb} is not here (paths in a checkpoint are relative to where "
                              "`rag fit` ran); pass --kb DIR (the knowledge base it trained with)")
        module = RagModule(**args)
        module.configure_model()
        module.load_state_dict(ckpt["state_dict"])
        return module.export(directory, overwrite=overwrite)
    if class_path == CAUSAL_READER:
        args = upgrade_arguments(class_path, args)
        if knowledge_base is not None:
            args["knowledge_base"] = os.fspath(knowledge_base)
        module = CausalReaderModule(**args)
        module.configure_model()
        module.load_state_dict(ckpt["state_dict"])
        return module.export(directory, overwrite=overwrite)
    raise ConfigError(f"{src}: a checkpoint of {class_path if class_path != '?' else 'an unknown module'}; `rag export` writes "
                      f"RagModule and CausalReaderModule models "
                      "(REPLUG LSR writes its query encoder with model.export_dir, the NLI module with its own config)")
