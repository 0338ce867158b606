"""Checking a user-given device ("cpu", "cuda", "cuda:1", "mps") before any model is loaded or moved."""

from __future__ import annotations

from typing import Optional

import torch

from rag.errors import ConfigError


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
