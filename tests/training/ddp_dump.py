"""A Lightning callback for the DDP tests: each rank writes its trainable parameters (safetensors) before and after fit."""

from __future__ import annotations

from pathlib import Path

import pytorch_lightning as pl


class DumpParameters(pl.Callback):
    """Write ``out_dir/{start,end}-rank{R}.safetensors`` (the model's trainable parameters on rank R) and
    ``out_dir/batches-rank{R}.txt`` (the questions of each training batch, one Python list literal a line) and
    ``out_dir/versions-rank{R}.txt`` (the knowledge-base version each step retrieved from, and the one serving at the end)."""

    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self.out_dir = out_dir

    def _dump(self, trainer, pl_module, when: str) -> None:
        from safetensors.torch import save_file

        params = {n: p.detach().cpu().clone().contiguous() for n, p in pl_module.named_parameters() if p.requires_grad}
        Path(self.out_dir).mkdir(parents=True, exist_ok=True)
        save_file(params, str(Path(self.out_dir) / f"{when}-rank{trainer.global_rank}.safetensors"))

    def on_train_start(self, trainer, pl_module) -> None:
        self._dump(trainer, pl_module, "start")

    def on_train_end(self, trainer, pl_module) -> None:
        self._dump(trainer, pl_module, "end")
        self._version(trainer, pl_module, "end")

    def _version(self, trainer, pl_module, when: str) -> None:
        with open(Path(self.out_dir) / f"versions-rank{trainer.global_rank}.txt", "a") as f:
            f.write(f"{when} {pl_module.model.knowledge_base.version}\n")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        Path(self.out_dir).mkdir(parents=True, exist_ok=True)
        with open(Path(self.out_dir) / f"batches-rank{trainer.global_rank}.txt", "a") as f:
            f.write(repr(batch["questions"]) + "\n")
        self._version(trainer, pl_module, f"step{trainer.global_step}")
