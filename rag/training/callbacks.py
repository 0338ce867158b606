"""Lightning callbacks for retrieval-augmented training.

:class:`IndexRefresh` keeps the index in step with a document encoder that is being trained
(``rag.train_doc_encoder``): on a schedule it snapshots the document encoder, re-encodes the corpus
and rebuilds the index *in a separate process* while training continues, then hot-swaps the new
knowledge base in between two training steps. This is the asynchronous index update of REALM and
REPLUG (Shi et al. 2023, §4.4: "we recompute the document embeddings and rebuild the efficient
search index using the new embeddings every T training steps"); RAG itself keeps the document
encoder fixed to avoid exactly this cost (Lewis et al. 2020, §2.4).

Timeline of one refresh (step s)::

    main process   step s: save doc-encoder snapshot ──► spawn worker ──► step s+1 ──► … ──► step s+j: swap (one reference)
    worker                                               re-encode all passages, build index, write KB atomically
    waiter thread                                        wait for the worker, open + verify the new KB (SHA-256)

Training never waits for the build: the trainer only polls (``Popen.poll``-cheap) after each
step. Retrieval keeps using the old index until the swap; with ``train_doc_encoder`` the doc scores
always come from fresh embeddings of the retrieved passages, so only *which* passages are found is
stale. A build that crashes or is killed is logged and training goes on with the old index; the
worker writes its knowledge base into a hidden temporary directory that is renamed into place only
when complete, and the callback swaps only after a zero exit status *and* a full verification, so
no half-built index is ever swapped in.

Under DDP (``--trainer.strategy ddp --trainer.devices N``) only rank 0 snapshots, builds and verifies; after
each step rank 0 broadcasts the directory it swapped in (or nothing), and every other rank swaps the same
directory in before its next step, so all ranks retrieve from one version at every step (checked before each
step by :func:`rag.training.distributed.check_same_knowledge_base`, which refuses to step on a disagreement).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import pytorch_lightning as pl

import rag
from rag.knowledge.hotswap import KnowledgeBaseSlot
from rag.knowledge.ray_pool import check_reachable
from rag.utils.errors import ConfigError, RagError
from rag.utils.validate import check_number, is_integer

logger = logging.getLogger(__name__)

__all__ = ["RefreshSchedule", "parse_schedule", "IndexRefresh", "RefreshFailed"]

WORKER_MODULE = "rag.knowledge.refresh"
_RANGE = re.compile(r"^\s*(\d+)\s*-\s*(\d*)\s*:\s*(\d+)\s*$")
_INT = re.compile(r"^\s*(\d+)\s*$")


class RefreshFailed(RagError):
    """A background index build failed (non-zero exit, killed, or wrote no valid knowledge base)."""


# ---------------------------------------------------------------------------- schedule


@dataclass(frozen=True)
class RefreshSchedule:
    """When to refresh: a tuple of ``(start, end, every)`` step ranges (``end`` None = open-ended).

    Inside ``[start, end)`` a refresh is due at steps ``start, start + every, start + 2·every, …``;
    never at step 0 (the initial index is fresh). Steps are optimizer steps (``trainer.global_step``).
    """

    ranges: tuple[tuple[int, Optional[int], int], ...]
    spec: str = ""

    def interval_at(self, step: int) -> Optional[int]:
        """The refresh interval in force at `step`, or None where no range covers it."""
        for start, end, every in self.ranges:
            if start <= step and (end is None or step < end):
                return every
        return None

    def due(self, step: int) -> bool:
        """True when a refresh should start at optimizer step `step`."""
        if step <= 0:
            return False
        for start, end, every in self.ranges:
            if start <= step and (end is None or step < end):
                return (step - start) % every == 0
        return False

    def next_after(self, step: int) -> Optional[int]:
        """The first step > `step` at which a refresh is due (None if there is none)."""
        best = None
        for start, end, every in self.ranges:
            s = max(step + 1, start, 1)
            s = start + -(-(s - start) // every) * every  # round up onto the range's grid
            if end is not None and s >= end:
                continue
            best = s if best is None else min(best, s)
        return best

    def __str__(self) -> str:
        return self.spec


def parse_schedule(spec: Union[int, str]) -> RefreshSchedule:
    """Parse a refresh schedule: an int ``N`` (or ``"N"``) = every N steps, or piecewise ranges
    ``"0-1000:500,1000-:2000"`` (steps 0-1000 every 500, then every 2000).

    Ranges are ``START-END:EVERY`` with END exclusive, or ``START-:EVERY`` open-ended (last only);
    they must ascend without overlapping (gaps mean no refreshes there).

    Raises:
        ConfigError: naming the bad part and the expected syntax.
    """
    hint = "expected an integer N (refresh every N steps) or ranges like '0-1000:500,1000-:2000'"
    if not (is_integer(spec) or isinstance(spec, str)):
        raise ConfigError(f"IndexRefresh.every={spec!r} is a {type(spec).__name__}; {hint}")
    if is_integer(spec):
        if spec < 1:
            raise ConfigError(f"IndexRefresh.every={spec} must be a positive number of steps; {hint}")
        return RefreshSchedule(((0, None, spec),), str(spec))
    m = _INT.match(spec)
    if m:
        return parse_schedule(int(m.group(1)))
    if not spec.strip():
        raise ConfigError(f"IndexRefresh.every is empty; {hint}")
    ranges: list[tuple[int, Optional[int], int]] = []
    for part in spec.split(","):
        where = f"IndexRefresh.every={spec!r}: part {part.strip()!r}"
        m = _RANGE.match(part)
        if not m:
            raise ConfigError(f"{where} is not START-END:EVERY or START-:EVERY; {hint}")
        start, end, every = int(m.group(1)), (int(m.group(2)) if m.group(2) else None), int(m.group(3))
        if every < 1:
            raise ConfigError(f"{where}: the interval must be a positive number of steps; {hint}")
        if end is not None and end <= start:
            raise ConfigError(f"{where}: the range ends at or before it starts ({end} <= {start}); {hint}")
        if ranges:
            p_start, p_end, _ = ranges[-1]
            if p_end is None:
                raise ConfigError(f"{where} follows the open-ended range starting at {p_start}; only the last range may omit END")
            if start < p_end:
                raise ConfigError(f"{where} starts at {start}, inside or before the previous range (which ends at {p_end}); "
                                  f"ranges must ascend without overlap")
        ranges.append((start, end, every))
    return RefreshSchedule(tuple(ranges), spec.strip())


# ---------------------------------------------------------------------------- the callback


@dataclass
class _Job:
    """One background refresh: its directory, worker process and the waiter's future."""

    step: int
    dir: Path
    kb_dir: Path
    encoder_dir: Path
    log_path: Path
    proc: subprocess.Popen
    parent_version: str
    started: float
    future: Optional[concurrent.futures.Future] = None
    cancelled: bool = False
    summary: dict = field(default_factory=dict)


def _rag_model(pl_module):
    """The RagModel inside a LightningModule (``.model``), or the module itself."""
    inner = getattr(pl_module, "model", None)
    return inner if inner is not None and hasattr(inner, "retriever") else pl_module


def _tail(path: Path, n: int = 2000) -> str:
    try:
        data = path.read_bytes()[-n:]
    except OSError:
        return "(no log)"
    return data.decode("utf-8", errors="replace").strip() or "(empty log)"


def _describe_exit(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit status {rc}"


class IndexRefresh(pl.Callback):
    """Re-encode the corpus with the current document encoder on a schedule, rebuild the index in a
    background process while training continues, and hot-swap the result in (REPLUG §4.4).

    Needs a model with a document encoder (``model.rag.train_doc_encoder: true``). Each refresh
    writes ``output_dir/step-XXXXXXXX/`` holding the encoder snapshot (``doc_encoder/``, which the
    new knowledge base's manifest names as its encoder), the new knowledge base (``kb/``, manifest
    ``parent`` = the version it replaces) and the worker's ``refresh.log``.

    Args:
        every: schedule: ``N`` (every N optimizer steps) or piecewise ranges ``"0-1000:500,1000-:2000"``.
            A refresh that falls due while the previous build still runs starts when it finishes.
        output_dir: where refreshed knowledge bases go (default: ``<default_root_dir>/index_refresh``).
        index: FAISS index spec of the rebuilt index (default: the serving knowledge base's).
        device: device of the build: ``auto`` (CUDA when the worker sees one, else CPU), ``cpu``, ``cuda:N``.
        batch_size: passages per encoder batch in the build.
        worker_threads: CPU threads of the build process (0: library default). Keep it low on a
            CPU-only machine so the build does not steal the trainer's cores.
        worker_nice: CPU priority decrease of the build process (0-19); training keeps precedence.
        worker_command: command prefix that runs the build (default: ``[python, -m, rag.knowledge.refresh]``);
            the build arguments are appended. Use it to launch the build elsewhere (a wrapper script,
            ``taskset``, a job launcher).
        verify: how the new knowledge base is checked before the swap: ``full`` (SHA-256 of every file,
            on a background thread), ``size`` or ``none``.
        at_train_end: a build still running when training ends: ``wait`` for it and swap it in (the
            final model then matches its index) or ``cancel`` it.
        keep: refreshed knowledge bases kept on disk (the serving one always is); older ones are deleted.
        ray_address: re-encode on Ray workers (``rag.knowledge.refresh --ray``): the cluster's address
            (``host:port``, ``ray://host:port``, ``auto``), or ``""`` for a local Ray the build starts. A
            ``host:port`` that does not answer fails at fit start, naming it. None: encode in the build process.
        ray_workers: Ray tasks the re-encoding is split over (one contiguous slice of the passages each).
    """

    def __init__(
        self,
        every: Union[int, str] = 1000,
        output_dir: Optional[str] = None,
        index: Optional[str] = None,
        device: str = "auto",
        batch_size: int = 64,
        worker_threads: int = 1,
        worker_nice: int = 10,
        worker_command: Optional[list[str]] = None,
        verify: Literal["full", "size", "none"] = "full",
        at_train_end: Literal["wait", "cancel"] = "wait",
        keep: int = 2,
        ray_address: Optional[str] = None,
        ray_workers: int = 2,
    ) -> None:
        super().__init__()
        self.schedule = parse_schedule(every)
        for name, v, lo in (("batch_size", batch_size, 1), ("worker_threads", worker_threads, 0), ("keep", keep, 1),
                            ("ray_workers", ray_workers, 1)):
            check_number(v, f"IndexRefresh.{name}", integer=True, low=lo, error=ConfigError)
        check_number(worker_nice, "IndexRefresh.worker_nice", integer=True, low=0, high=19, error=ConfigError)
        if verify not in ("full", "size", "none"):
            raise ConfigError(f"IndexRefresh.verify={verify!r}; choose 'full', 'size' or 'none'")
        if at_train_end not in ("wait", "cancel"):
            raise ConfigError(f"IndexRefresh.at_train_end={at_train_end!r}; choose 'wait' or 'cancel'")
        if worker_command is not None and (
            isinstance(worker_command, str) or not worker_command or not all(isinstance(a, str) for a in worker_command)
        ):
            raise ConfigError(f"IndexRefresh.worker_command must be a non-empty list of strings, got {worker_command!r}")
        if not isinstance(device, str) or not re.match(r"^(auto|cpu|cuda(:\d+)?)$", device):
            raise ConfigError(f"IndexRefresh.device={device!r}; choose 'auto', 'cpu', 'cuda' or 'cuda:N'")
        self.output_dir = output_dir
        self.index = index
        self.device = device
        self.batch_size = batch_size
        self.worker_threads = worker_threads
        self.worker_nice = worker_nice
        self.worker_command = list(worker_command) if worker_command is not None else None
        self.verify = verify
        self.at_train_end = at_train_end
        self.keep = keep
        if ray_address is not None and not isinstance(ray_address, str):
            raise ConfigError(f"IndexRefresh.ray_address={ray_address!r}; give host:port, ray://host:port, auto, or '' "
                              f"for a local Ray")
        self.ray_address = ray_address
        self.ray_workers = ray_workers

        self.started = 0
        """Refresh builds started (this session)."""
        self.swaps = 0
        """Refreshed knowledge bases swapped in."""
        self.failures = 0
        """Refreshes that failed (crashed, killed, invalid output, refused swap)."""
        self.history: list[dict] = []
        """One record per finished refresh: step, ok, version/error, seconds, and the swap result."""
        self._job: Optional[_Job] = None
        self._pending_step: Optional[int] = None
        self._last_step = -1
        self._serving_step = 0
        self._slot = None
        self._root: Optional[Path] = None
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._restored: Optional[dict] = None

    # ------------------------------------------------------------------ public state
    @property
    def in_flight(self) -> bool:
        """True while a background build (or its verification) is running."""
        return self._job is not None

    @property
    def worker_pid(self) -> Optional[int]:
        """Process id of the running build, if any."""
        return self._job.proc.pid if self._job is not None else None

    # ------------------------------------------------------------------ lifecycle hooks
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.ray_address:  # an address that does not answer fails now, not at the first refresh
            check_reachable(self.ray_address, 5.0, ConfigError, "IndexRefresh.ray_address")
        model = _rag_model(pl_module)
        if getattr(model, "doc_encoder", None) is None:
            raise ConfigError(
                "IndexRefresh needs a model with a document encoder to re-encode the corpus with; set "
                "model.rag.train_doc_encoder: true (the document encoder is then trained and the index refreshed)"
            )
        if not getattr(model.config, "train_doc_encoder", False):
            logger.warning("IndexRefresh: rag.train_doc_encoder is false, so the document encoder does not change and "
                           "every refresh rebuilds the same index")
        self._slot = KnowledgeBaseSlot.for_model(model, history=max(1, self.keep), keep_loaded=0)
        # absolute: the new manifest names the snapshot directory as its encoder, loadable from any cwd
        self._root = (Path(self.output_dir) if self.output_dir else Path(trainer.default_root_dir) / "index_refresh").resolve()
        self._root.mkdir(parents=True, exist_ok=True)
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="index-refresh")
        self._last_step = trainer.global_step
        if self._restored:
            self._restore_serving(model)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == self._last_step:
            return  # mid gradient accumulation: the micro-batches of one optimizer step share one index
        self._last_step = step
        self._poll(pl_module, trainer)
        if self.schedule.due(step) and trainer.is_global_zero:  # under DDP rank 0 builds; every rank swaps (_poll)
            if self._job is not None and self._pending_step is None:
                logger.info("index refresh due at step %d deferred: the build started at step %d is still running",
                            step, self._job.step)
            self._pending_step = step
        if self._pending_step is not None and self._job is None:
            self._pending_step = None
            self._start(pl_module, step)
        pl_module.log_dict(
            {"refresh/swaps": float(self.swaps), "refresh/failures": float(self.failures),
             "refresh/in_flight": float(self._job is not None), "refresh/index_age": float(step - self._serving_step)},
            on_step=True, on_epoch=False, batch_size=1,
        )

    def on_train_end(self, trainer, pl_module) -> None:
        job = self._job
        wait = job is not None and self.at_train_end == "wait"
        if trainer.world_size > 1:  # every rank must reach the same broadcasts: rank 0 says whether a build is awaited
            wait = bool(trainer.strategy.broadcast(wait, src=0))
        if job is None and not wait:
            return
        if wait:
            if job is not None:
                logger.info("training ended with the index refresh from step %d still running; waiting for it", job.step)
                concurrent.futures.wait([job.future])
            self._poll(pl_module, trainer)
        else:
            logger.info("training ended; cancelling the index refresh from step %d", job.step)
            self._cancel(job)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if self._job is not None:
            self._cancel(self._job)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if self._job is not None:
            self._cancel(self._job)
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict[str, Any]:
        kb = self._slot.current if self._slot is not None else None
        return {
            "serving_path": None if kb is None else str(kb.path),
            "serving_version": None if kb is None else kb.version,
            "serving_step": self._serving_step,
            "swaps": self.swaps,
            "failures": self.failures,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = dict(state_dict)
        self.swaps = int(state_dict.get("swaps", 0))
        self.failures = int(state_dict.get("failures", 0))
        self._serving_step = int(state_dict.get("serving_step", 0))

    def _restore_serving(self, model) -> None:
        """On resume, serve the refreshed knowledge base the checkpoint was trained against."""
        path, version = self._restored.get("serving_path"), self._restored.get("serving_version")
        if not path or (self._slot.current is not None and self._slot.current.version == version):
            return
        try:
            self._slot.swap(path, allow_encoder_change=True, verify=self.verify)
            model.retriever.space = self._slot.current.encoder.get("fingerprint")
            logger.info("resumed on the refreshed knowledge base %s (%s)", path, self._slot.version)
        except RagError as e:
            logger.warning("could not resume on the refreshed knowledge base %s (%s); continuing with %s until the next refresh",
                           path, e, self._slot.version)

    # ------------------------------------------------------------------ refresh machinery
    def _worker_argv(self, job_kb: Path, encoder_dir: Path, kb_path: str, step: int) -> list[str]:
        prefix = self.worker_command or [sys.executable, "-m", WORKER_MODULE]
        argv = prefix + [
            "--knowledge-base", kb_path, "--encoder", str(encoder_dir), "--out", str(job_kb),
            "--device", self.device, "--batch-size", str(self.batch_size),
            "--threads", str(self.worker_threads), "--nice", str(self.worker_nice), "--step", str(step),
        ]
        if self.index:
            argv += ["--index", self.index]
        if self.ray_address is not None:
            argv += ["--ray", *([self.ray_address] if self.ray_address else []), "--workers", str(self.ray_workers)]
        return argv

    def _worker_env(self) -> dict[str, str]:
        env = dict(os.environ)
        root = str(Path(rag.__file__).resolve().parent.parent)  # so `-m rag...` works without `pip install`
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        if self.worker_threads:
            for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
                env[var] = str(self.worker_threads)
        return env

    def _start(self, pl_module, step: int) -> None:
        """Snapshot the document encoder (main thread: the weights must not move while saved), then
        launch the build process and a waiter thread. Returns at once."""
        model = _rag_model(pl_module)
        kb = self._slot.current
        job_dir = self._root / f"step-{step:08d}"
        n = 1
        while job_dir.exists():  # a resumed run reaching the same step again
            job_dir = self._root / f"step-{step:08d}-{n}"
            n += 1
        job_dir.mkdir(parents=True)
        encoder_dir = job_dir / "doc_encoder"
        t0 = time.perf_counter()
        try:
            model.doc_encoder.save_pretrained(encoder_dir)
        except Exception as e:  # noqa: BLE001 - a full disk must not stop training
            self._record_failure(step, f"could not save the document-encoder snapshot to {encoder_dir}: {e}",
                                 time.perf_counter() - t0)
            return
        log_path = job_dir / "refresh.log"
        argv = self._worker_argv(job_dir / "kb", encoder_dir, str(Path(kb.path).resolve()), step)
        try:
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        env=self._worker_env(), cwd=os.getcwd())
        except OSError as e:
            self._record_failure(step, f"could not start the refresh worker {argv[0]!r}: {e}", time.perf_counter() - t0)
            return
        job = _Job(step=step, dir=job_dir, kb_dir=job_dir / "kb", encoder_dir=encoder_dir, log_path=log_path,
                   proc=proc, parent_version=kb.version, started=t0)
        job.future = self._executor.submit(self._await_build, job)
        self._job = job
        self.started += 1
        logger.info("index refresh started at step %d (worker pid %d, snapshot saved in %.2f s): %s",
                    step, proc.pid, time.perf_counter() - t0, job_dir)

    def _await_build(self, job: _Job):
        """Waiter thread: wait for the worker, then open and verify what it wrote. Returns the opened
        knowledge base; raises RefreshFailed for anything that must not be swapped in."""
        rc = job.proc.wait()
        if job.cancelled:
            raise RefreshFailed(f"cancelled ({_describe_exit(rc)})")
        if rc != 0:
            raise RefreshFailed(f"the build process failed ({_describe_exit(rc)}); last log lines:\n{_tail(job.log_path)}")
        if not (job.kb_dir / "manifest.json").is_file():
            raise RefreshFailed(f"the build process exited 0 but wrote no complete knowledge base at {job.kb_dir}")
        try:
            kb = self._slot.check(job.kb_dir, allow_encoder_change=True, verify=self.verify)
        except RagError as e:
            raise RefreshFailed(f"the new knowledge base failed verification: {e}") from e
        if kb.manifest.parent != job.parent_version:
            raise RefreshFailed(f"{job.kb_dir}: records parent {kb.manifest.parent}, expected {job.parent_version}")
        if Path(str(kb.encoder.get("name", ""))).resolve() != job.encoder_dir.resolve():
            raise RefreshFailed(f"{job.kb_dir}: was encoded by {kb.encoder.get('name')!r}, not by the snapshot {job.encoder_dir}")
        return kb

    def _poll(self, pl_module, trainer: Optional["pl.Trainer"] = None) -> None:
        """If the running build has finished: swap its knowledge base in, or log its failure.

        Under DDP (``trainer.world_size > 1``) a collective: only rank 0 builds; it broadcasts the knowledge base it
        swapped in (or None), and every other rank swaps the same directory in before its next step. A rank whose swap
        fails keeps its old version, and the version check before the next step (:mod:`rag.training.distributed`)
        stops every rank with an error naming the disagreement."""
        swapped = self._poll_own(pl_module)
        if trainer is None or trainer.world_size <= 1:
            return
        msg = trainer.strategy.broadcast((str(swapped[0].path), swapped[1]) if swapped else None, src=0)
        if msg is None or trainer.is_global_zero:
            return
        path, step = msg
        t0 = time.perf_counter()
        try:
            # rank 0 has just verified every file's SHA-256 (self.verify); the others check sizes and finiteness
            result = self._slot.swap(path, allow_encoder_change=True, verify="size" if self.verify == "full" else self.verify)
        except RagError as e:
            self._record_failure(step,
                                 f"rank {trainer.global_rank}: swap of rank 0's refreshed knowledge base {path} refused: {e}",
                                 time.perf_counter() - t0)
            return
        self._swapped(pl_module, self._slot.current, step, result, path, time.perf_counter() - t0)

    def _poll_own(self, pl_module):
        """This process's build, if finished: swap it in and return ``(kb, step)``, or log its failure and return None."""
        job = self._job
        if job is None or not job.future.done():
            return None
        self._job = None
        seconds = time.perf_counter() - job.started
        try:
            kb = job.future.result()
        except Exception as e:  # noqa: BLE001 - RefreshFailed, or anything unexpected in the waiter
            self._record_failure(job.step, str(e), seconds, job)
            return None
        try:
            result = self._slot.swap(kb, allow_encoder_change=True, verify="none")  # verified by the waiter
        except RagError as e:
            self._record_failure(job.step, f"swap refused: {e}", seconds, job)
            return None
        self._swapped(pl_module, kb, job.step, result, job.kb_dir, seconds)
        self._prune()
        return kb, job.step

    def _swapped(self, pl_module, kb, step: int, result, path, seconds: float) -> None:
        # The retriever now lives in the refreshed encoder's space: later swaps are checked against it.
        _rag_model(pl_module).retriever.space = kb.encoder.get("fingerprint")
        swapped = getattr(pl_module, "on_knowledge_base_swapped", None)
        if swapped is not None:  # e.g. RagModule moves its retrieval actors to the new version
            swapped(kb)
        self.swaps += 1
        self._serving_step = step
        self.history.append({"step": step, "ok": True, "version": kb.version, "parent": result.old_version,
                             "path": str(path), "seconds": round(seconds, 3), "swap": result.to_dict()})
        logger.info("index refresh from step %d swapped in: %s -> %s after %.1f s (lock held %.6f s)",
                    step, result.old_version, kb.version, seconds, result.commit_seconds)

    def _record_failure(self, step: int, message: str, seconds: float, job: Optional[_Job] = None) -> None:
        self.failures += 1
        serving = self._slot.version if self._slot is not None else None
        self.history.append({"step": step, "ok": False, "error": message, "seconds": round(seconds, 3)})
        logger.error("index refresh from step %d failed after %.1f s; training continues on %s. %s", step, seconds, serving,
                     message)
        if job is not None:  # keep the log for diagnosis; drop the snapshot and whatever the build left
            self._discard(job)

    def _cancel(self, job: _Job) -> None:
        job.cancelled = True
        if job.proc.poll() is None:
            job.proc.kill()
        job.proc.wait()
        if job.future is not None:
            concurrent.futures.wait([job.future])
        if self._job is job:
            self._job = None
        self._discard(job)
        logger.info("index refresh from step %d cancelled", job.step)

    @staticmethod
    def _discard(job: _Job) -> None:
        """Delete a failed or cancelled build's outputs (never swapped in), keeping its log."""
        shutil.rmtree(job.encoder_dir, ignore_errors=True)
        shutil.rmtree(job.kb_dir, ignore_errors=True)
        for partial in job.dir.glob(".kb.tmp-*"):
            shutil.rmtree(partial, ignore_errors=True)

    def _prune(self) -> None:
        """Delete refreshed knowledge bases beyond the newest `keep` (never the serving one)."""
        serving = Path(self._slot.current.path).resolve()
        done = sorted(d for d in self._root.glob("step-*") if (d / "kb" / "manifest.json").is_file())
        for d in done[:-self.keep]:
            if (d / "kb").resolve() != serving:
                shutil.rmtree(d, ignore_errors=True)

    def __repr__(self) -> str:
        return f"IndexRefresh(every={self.schedule}, swaps={self.swaps}, failures={self.failures}, in_flight={self.in_flight})"
