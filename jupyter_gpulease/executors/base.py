"""The executor interface: where a leased cell's worker process runs, and how the kernel drives it.

An ``Executor`` (a small configurable class, chosen by the lease's placement: see ``executor_class``)
starts a ``Worker``: the kernel's handle on one worker process, wherever it runs (a child of the kernel,
a Ray actor on the GPU node, a Slurm job step). The kernel's cell run (``kernel.cellrun``) uses only the
methods below.
"""

from __future__ import annotations

import abc
import codecs
import os
import shutil
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from traitlets import Float, default
from traitlets.config import LoggingConfigurable

from gpulease_protocol.private import private_dir

from ..wire import transfer
from ..worker.env import lease_dir

if TYPE_CHECKING:
    from ..client import LeaseView

Sink = Callable[[str], None]


class WorkerCrashed(Exception):
    """The worker process ended without handing back a result."""

    def __init__(self, status: int | None, stderr_tail: str) -> None:
        self.status, self.stderr_tail = status, stderr_tail
        how = _describe_status(status)
        tail = f"\nLast lines of its stderr:\n{stderr_tail.rstrip()}" if stderr_tail.strip() else ""
        super().__init__(f"The GPU worker {how} before the cell finished.{tail}")


def _describe_status(status: int | None) -> str:
    if status is None:
        return "vanished"
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = f"signal {-status}"
        return f"was killed by {name}"
    return f"exited with status {status}"


class Worker(abc.ABC):
    """The kernel's handle on one started worker process."""

    #: a process of this host, child of the kernel: attached to the lease by pid (else the executor's engine
    #: ties it to the lease)
    local: ClassVar[bool] = False
    pid: int
    #: the worker's "ready" message once it arrived (its pid, versions, preload failures)
    ready: dict[str, Any] | None

    @abc.abstractmethod
    def submit(self, job: dict[str, Any]) -> None:
        """Send a job (a framed message, see ``wire.transfer``)."""

    @abc.abstractmethod
    def poll(self, timeout: float | None, out: Sink, err: Sink) -> dict[str, Any] | None:
        """Forward the worker's output to ``out``/``err``; return its next result message when one arrived
        within ``timeout`` seconds (None: wait one polling interval). Raises WorkerCrashed when it is gone."""

    @abc.abstractmethod
    def drain(self, out: Sink, err: Sink) -> None:
        """Forward what output already arrived, without waiting."""

    @abc.abstractmethod
    def interrupt(self) -> None:
        """SIGINT the worker (the cell sees KeyboardInterrupt)."""

    @abc.abstractmethod
    def kill(self, grace: float = 2.0) -> None:
        """Stop the worker's process group: SIGTERM, SIGKILL after ``grace`` seconds; then close."""

    @abc.abstractmethod
    def wait_exit(self, timeout: float = 5.0) -> int | None:
        """The worker's exit status, killing it when it has not exited within ``timeout`` seconds."""

    @abc.abstractmethod
    def alive(self) -> bool:
        """Whether the worker process still runs."""

    @property
    @abc.abstractmethod
    def returncode(self) -> int | None:
        """The exit status once it exited, else None."""

    @abc.abstractmethod
    def close(self) -> None:
        """Let go of the worker (its lifeline closes: it exits). May be called twice."""


class RelayedWorker(Worker):
    """``poll()`` for workers whose output and results reach the kernel through a relay that reads the
    worker's pipes in separate threads (a Ray actor, a Slurm step): the worker flushed its output before it
    answered, so what is still on the way is taken before the result, and the cell's last lines never
    arrive after it (in the next cell)."""

    _results: list[dict[str, Any]]

    @abc.abstractmethod
    def _ended(self) -> bool: ...

    @abc.abstractmethod
    def _crashed(self) -> WorkerCrashed: ...

    @abc.abstractmethod
    def _fetch(self, timeout: float, out: Sink, err: Sink) -> int:
        """Relay what arrived within ``timeout``; returns how many chunks of output it brought."""

    def poll(self, timeout: float | None, out: Sink, err: Sink) -> dict[str, Any] | None:
        if not self._results:
            if self._ended():
                raise self._crashed()
            self._fetch(0.5 if timeout is None else timeout, out, err)
        if not self._results:
            return None
        for _ in range(20):  # settle: at most ~50 ms once nothing more comes
            if self._ended() or not self._fetch(0.05, out, err):
                break
        return self._results.pop(0)


class OutputDecoder:
    """UTF-8 across chunk boundaries."""

    def __init__(self) -> None:
        self._d = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def decode(self, data: bytes) -> str:
        return self._d.decode(data)


class Executor(LoggingConfigurable):
    """Starts workers for leases placed by one engine. Subclasses set ``kind`` (the placement kind they
    serve, ``local`` for leases on this host) and implement ``start``."""

    kind: ClassVar[str] = "base"

    def start(self, lease: LeaseView, python: str | None = None, preload: list[str] | None = None,
              session: bool = False) -> Worker:
        """A started worker on the lease's GPUs: ``python`` (None: the kernel's interpreter) with ``preload``
        imported; a ``session`` worker runs many jobs, else one."""
        raise NotImplementedError

    def shutdown(self) -> None:
        """Stop what the executor keeps ready (pre-started workers)."""

    @staticmethod
    def env_timeout(kind: str) -> float:
        """The start timeout from ``$GPULEASE_<KIND>_START_TIMEOUT``, else 120 s."""
        return float(os.environ.get(f"GPULEASE_{kind.upper()}_START_TIMEOUT", "120"))


class PlacedExecutor(Executor):
    """Workers for leases an engine placed (the lease view's ``placement.kind`` is this executor's ``kind``)."""

    start_timeout = Float(
        120.0,
        config=True,
        help="Seconds a worker may take to start on the GPU node before the cell fails, e.g. 120. "
        "Default: $GPULEASE_<KIND>_START_TIMEOUT (KIND: RAY, SLURM), else 120.",
    )

    @default("start_timeout")
    def _env_start_timeout(self) -> float:
        return self.env_timeout(self.kind)

    def start(self, lease: LeaseView, python: str | None = None, preload: list[str] | None = None,
              session: bool = False) -> Worker:
        if lease.placement is None or lease.placement.get("kind") != self.kind:
            raise ValueError(f"Lease {lease.id} was not placed by {self.kind.capitalize()}: {lease.placement!r}")
        return self.worker(lease, python, preload, session)

    @abc.abstractmethod
    def worker(self, lease: LeaseView, python: str | None, preload: list[str] | None, session: bool) -> Worker:
        """The engine's worker for a lease it placed."""


def inputs_on_shared_storage(job: dict[str, Any], artifacts: str | None) -> dict[str, Any]:
    """The job for a worker on another host: its values travel as a file, moved into the lease's artifact
    directory (shared storage; else this user's shm directory) under ``.oob``, which the job names: directories of
    the user's own (``private_dir``), as the worker reads only files of its own there."""
    base = lease_dir(artifacts, int(job.get("artifacts_mode") or 0o700)) if artifacts else transfer.shm_dir()
    oob = private_dir(os.path.join(base, ".oob"))
    inputs = job.get("inputs")
    if inputs and inputs.get("file") and os.path.dirname(inputs["file"]) != oob:
        moved = os.path.join(oob, os.path.basename(inputs["file"]))
        shutil.move(inputs["file"], moved)
        job = {**job, "inputs": {**inputs, "file": moved}}
    return {**job, "oob_dir": oob}
