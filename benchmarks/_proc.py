"""Process plumbing shared by the side-by-side benchmarks: persistent spawned workers, per-call
peak-memory measurement from /proc, and the machine description written into result files."""

from __future__ import annotations

import ctypes
import gc
import multiprocessing as mp
import os
import platform
from datetime import datetime, timezone


def status_kib(field: str) -> int:
    """A field of /proc/self/status (VmRSS, VmHWM, ...) in KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_rss() -> bool:
    """Return freed heap to the OS and reset VmHWM to the current RSS; False where the kernel refuses."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def machine_info(threads: int) -> dict:
    import torch
    import transformers

    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return dict(date=datetime.now(timezone.utc).isoformat(timespec="seconds"), cpu=cpu, cores=os.cpu_count(),
                threads=threads, nice=os.nice(0), python=platform.python_version(), torch=torch.__version__,
                transformers=transformers.__version__, load_average=load)


class Worker:
    """A persistent spawned process: `target(conn, *args)` answers each message with ("ok", value) or
    ("error", traceback) and stops on None."""

    def __init__(self, name: str, target, args: tuple):
        ctx = mp.get_context("spawn")
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.proc.start()

    def answer(self):
        if not self.conn.poll(3 * 3600):
            raise RuntimeError(f"{self.name} worker did not answer within three hours")
        tag, value = self.conn.recv()
        if tag == "error":
            raise RuntimeError(f"{self.name} worker failed:\n{value}")
        return value

    def request(self, message):
        self.conn.send(message)
        return self.answer()

    def close(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.terminate()
