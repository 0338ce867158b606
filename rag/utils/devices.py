"""Checking a user-given device ("cpu", "cuda", "cuda:1", "mps") before any model is loaded or moved."""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from rag.utils.errors import ConfigError


def check_device(device: "str | torch.device | None", option: str = "--device") -> Optional[torch.device]:
    """`device` as a torch.device (None stays None), or ConfigError naming `option` when this machine lacks it.

    torch itself reports a missing GPU only when a tensor is first moved (an AssertionError deep in a
    model load or after a corpus was read); this says so up front, with the devices that do exist.
    """
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(f"{option} {device!r} is not a device; use cpu, cuda, cuda:N or mps") from None
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise ConfigError(f"{option} {device}: this machine (or this torch build, {torch.__version__}) has no CUDA GPU; "
                              f"use {option} cpu")
        if dev.index is not None and dev.index >= n:
            raise ConfigError(f"{option} {device}: there is no GPU {dev.index}; this machine has {n} (cuda:0"
                              f"{f' … cuda:{n - 1}' if n > 1 else ''})")
    elif dev.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise ConfigError(f"{option} {device}: MPS is not available on this machine; use {option} cpu")
    elif dev.type != "cpu":
        raise ConfigError(f"{option} {device}: unsupported device type {dev.type!r}; use cpu, cuda, cuda:N or mps")
    return dev


def _requested_gpus(devices) -> Optional[list[int]]:
    """The GPU indices a Lightning ``devices`` value names (None: "auto" / -1, all there are); a count N is 0..N-1."""
    if isinstance(devices, str):
        d = devices.strip()
        if d in ("auto", "-1"):
            return None
        if "," in d:
            return [int(x) for x in d.split(",") if x.strip()]
        devices = int(d)
    if isinstance(devices, int):
        return None if devices == -1 else list(range(devices))
    return [int(x) for x in devices]


def check_trainer_devices(accelerator, devices) -> None:
    """ConfigError naming ``--trainer.accelerator`` / ``--trainer.devices`` when they ask for GPUs this machine lacks
    (Lightning reports it as a traceback ending in "No supported gpu backend found!" or a device-index error)."""
    if str(accelerator).lower() not in ("gpu", "cuda"):
        return
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        raise ConfigError(f"--trainer.accelerator {accelerator}: this machine (or this torch build, {torch.__version__}) has "
                          "no CUDA GPU; use --trainer.accelerator cpu (several CPU processes: --trainer.strategy ddp "
                          "--trainer.devices N)")
    try:
        wanted = _requested_gpus(devices)
    except (TypeError, ValueError):
        raise ConfigError(f"--trainer.devices {devices!r}: give a count, a list of GPU indices, -1 or auto") from None
    if wanted and (len(wanted) > n or max(wanted) >= n):
        raise ConfigError(f"--trainer.devices {devices}: this machine has {n} GPU{'s' if n > 1 else ''} (indices 0..{n - 1}); "
                          f"ask for at most {n}, or -1 for all of them")


def without_cudnn_attention(fn: Callable) -> Callable:
    """Run `fn` with scaled-dot-product attention restricted to the flash, memory-efficient and math kernels.

    In float16/bfloat16 on Hopper GPUs PyTorch prefers cuDNN's attention, which builds an execution plan for every new
    input shape, and RAG's inputs change shape at every step (retrieved passages and answers of varying length;
    docs/benchmarks.md, "GPU (H200)", has the cost). float32 and CPU runs never use cuDNN attention, so there it
    changes nothing. Used on the steps of every LightningModule, on passage encoding
    and on the pipeline's generate/retrieve.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            return fn(*args, **kwargs)

    return wrapper
