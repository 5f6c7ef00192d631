"""The executor interface: where a leased cell's worker process runs, and how the kernel drives it.

An ``Executor`` (a small configurable class, chosen by the lease's placement: see ``executor_class``)
starts a ``Worker``: the kernel's handle on one worker process, wherever it runs (a child of the kernel,
a Ray actor on the GPU node, a Slurm job step). The kernel's cell run (``kernel.cellrun``) uses only the
methods below.
"""

from __future__ import annotations

import abc
import codecs
import contextlib
import os
import shutil
import signal
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from traitlets import Float, default
from traitlets.config import LoggingConfigurable

from gpulease_protocol.private import create_private, private_dir

from ..wire import transfer
from ..worker.env import lease_dir, write_marker

if TYPE_CHECKING:
    from ..client import LeaseView

Sink = Callable[[str], None]

#: what a relay's events carry (``RelayedWorker``): the worker's output, the frames of its control pipe (results),
#: and the relay's own last event, the worker's pipes all closed (its data: the exit status, where the relay has it).
#: ``slurm_relay``'s lines use the same numbers for the first three: its tags go into the inbox as they come.
STDOUT, STDERR, CTRL, ENDED = 1, 2, 3, -1


class WorkerCrashed(Exception):
    """The worker process ended without handing back a result."""

    def __init__(self, status: int | None, stderr_tail: str, how: str = "") -> None:
        """``how``: what happened, where the exit status does not say it (a worker that stopped answering)."""
        self.status, self.stderr_tail = status, stderr_tail
        what = f"The GPU worker {how}." if how else f"The GPU worker {_describe_status(status)} before the cell finished."
        tail = f"\nLast lines of its stderr:\n{stderr_tail.rstrip()}" if stderr_tail.strip() else ""
        super().__init__(f"{what}{tail}")


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

    def unseen(self, directory: str) -> str:
        """'' when this worker's node sees ``directory`` of the kernel's (a worker of this host does), else the one
        line that says it does not, with the fix (``root_unseen``)."""
        return ""

    def values_dir(self, env: dict[str, str], mode: int = 0o700) -> str | None:
        """Where the kernel writes a job's large input values for this worker (None: this user's shm directory);
        written there at once, never copied there later."""
        return None

    def values_inline(self, env: dict[str, str], mode: int = 0o700) -> bool:
        """Whether a job's large input values travel in its message itself (a node that does not see the kernel's
        artifact root): packed straight into it (``transfer.dumps(inline=True)``), never into a file here."""
        return False


class RelayedWorker(Worker):
    """``poll()`` for workers whose output and results reach the kernel through a relay that reads the
    worker's pipes in separate threads (a Ray actor, a Slurm step): the worker flushed its output before it
    answered, so what is still on the way is taken before the result, and the cell's last lines never
    arrive after it (in the next cell).

    What a relay brought waits in ``_inbox`` and is handed on one event at a time (``_relay``): an interrupt (the
    user's, while the cell runs) in the middle leaves the rest for the next call instead of dropping the cell's answer
    to it (``test_ray_interrupted_wait_loses_nothing_the_relay_was_bringing``)."""

    _results: list[dict[str, Any]]
    #: whether the worker's node sees the kernel's artifact directories (the marker check)
    _root: RootCheck
    ready: dict[str, Any] | None
    _frames: transfer.FrameReader
    _decoders: dict[int, OutputDecoder]
    _stderr_tail: bytes
    _inbox: deque[tuple[int, Any]]

    def unseen(self, directory: str) -> str:
        return "" if self._root.sees(directory) else root_unseen(self._root.node, directory)

    def values_dir(self, env: dict[str, str], mode: int = 0o700) -> str | None:
        artifacts = env.get("GPULEASE_ARTIFACTS")
        if not self._root.sees(artifacts, mode):
            return None  # a node without the shared root: the values travel in the messages (values_in_messages)
        return oob_dir(artifacts, mode)

    def values_inline(self, env: dict[str, str], mode: int = 0o700) -> bool:
        return not self._root.sees(env.get("GPULEASE_ARTIFACTS"), mode)

    @abc.abstractmethod
    def _ended(self) -> bool: ...

    @abc.abstractmethod
    def _crashed(self) -> WorkerCrashed: ...

    @abc.abstractmethod
    def _fetch(self, timeout: float, out: Sink, err: Sink) -> int:
        """Relay what arrived within ``timeout`` (what the inbox still holds first); returns how many chunks of
        output it brought."""

    @abc.abstractmethod
    def _end(self, status: Any) -> None:
        """The relay's ``ENDED`` event: the worker's pipes are closed (``status``: its exit status, where known)."""

    def _relay(self, out: Sink, err: Sink) -> int:
        """Hand on the inbox's events in order: output to the cell's sinks, the control pipe's frames to
        ``ready`` and ``_results``; returns how many chunks of output there were."""
        chunks = 0
        while self._inbox:
            tag, data = self._inbox.popleft()
            if tag == ENDED:
                self._end(data)
            elif not data:
                continue
            elif tag == CTRL:
                for msg in self._frames.feed(data):
                    if msg.get("type") == "ready":
                        self.ready = msg
                    else:
                        self._results.append(self._root.files_back(msg))
            elif tag in (STDOUT, STDERR):
                chunks += 1
                if tag == STDERR:
                    self._stderr_tail = (self._stderr_tail + data)[-4000:]
                text = self._decoders[tag].decode(bytes(data))
                if text:
                    (out if tag == STDOUT else err)(text)
        return chunks

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

    def prepare(self, inventory: dict[str, Any]) -> None:
        """Get ready for the first lease, in the background at the kernel's start (the broker's ``inventory`` as
        ``GET /info`` describes it places leases with this executor's engine): e.g. join the engine's cluster."""

    @staticmethod
    def env_timeout(kind: str) -> float:
        """The start timeout from ``$GPULEASE_<KIND>_START_TIMEOUT``, else 120 s."""
        return float(os.environ.get(f"GPULEASE_{kind.upper()}_START_TIMEOUT", "120"))

    @staticmethod
    def env_call_timeout(kind: str) -> float:
        """The per-call timeout from ``$GPULEASE_<KIND>_CALL_TIMEOUT``, else 5 s."""
        return float(os.environ.get(f"GPULEASE_{kind.upper()}_CALL_TIMEOUT", "5"))


class PlacedExecutor(Executor):
    """Workers for leases an engine placed (the lease view's ``placement.kind`` is this executor's ``kind``)."""

    start_timeout = Float(
        120.0,
        config=True,
        help="Seconds a worker may take to start on the GPU node before the cell fails, e.g. 120. "
        "Default: $GPULEASE_<KIND>_START_TIMEOUT (KIND: RAY, SLURM), else 120.",
    )

    call_timeout = Float(
        5.0,
        config=True,
        help="Seconds a started worker's Ray actor or Slurm relay may take to answer any one call (output, a job, "
        "a signal) before it is taken for hung: it is killed (ray.kill; srun killed and the step cancelled), the "
        "cell fails with a one-line error and the lease is released, e.g. 5. Apart from start_timeout. "
        "Default: $GPULEASE_<KIND>_CALL_TIMEOUT (KIND: RAY, SLURM), else 5.",
    )

    @default("start_timeout")
    def _env_start_timeout(self) -> float:
        return self.env_timeout(self.kind)

    @default("call_timeout")
    def _env_call_timeout(self) -> float:
        return self.env_call_timeout(self.kind)

    def start(self, lease: LeaseView, python: str | None = None, preload: list[str] | None = None,
              session: bool = False) -> Worker:
        if lease.placement is None or lease.placement.get("kind") != self.kind:
            raise ValueError(f"Lease {lease.id} was not placed by {self.kind.capitalize()}: {lease.placement!r}")
        return self.worker(lease, python, preload, session)

    @abc.abstractmethod
    def worker(self, lease: LeaseView, python: str | None, preload: list[str] | None, session: bool) -> Worker:
        """The engine's worker for a lease it placed."""


def oob_dir(artifacts: str | None, mode: int = 0o700) -> str:
    """Where values for a worker on another host travel as files: ``.oob`` in the lease's artifact directory
    (shared storage; else this user's shm directory): directories of the user's own (``private_dir``), as the
    worker reads only files of its own there."""
    base = lease_dir(artifacts, mode) if artifacts else transfer.shm_dir()
    return private_dir(os.path.join(base, ".oob"))


def inputs_on_shared_storage(job: dict[str, Any], artifacts: str | None) -> dict[str, Any]:
    """The job for a worker on another host: its values travel as a file in ``oob_dir``, which the job names. The
    kernel wrote them there (``Worker.values_dir``); one written elsewhere is moved, and the job's own ``inputs``
    then name the moved file (the kernel removes it after the cell: a file the worker never read must not stay)."""
    oob = oob_dir(artifacts, int(job.get("artifacts_mode") or 0o700))
    inputs = job.get("inputs")
    if inputs and inputs.get("file") and os.path.dirname(inputs["file"]) != oob:
        moved = os.path.join(oob, os.path.basename(inputs["file"]))
        shutil.move(inputs["file"], moved)
        inputs["file"] = moved  # in place: the caller's message, which the kernel discards after the cell
    return {**job, "oob_dir": oob}


def root_unseen(node: str, artifacts: str) -> str:
    """The one line for a node that does not see the kernel's artifact directory (the marker check)."""
    root = os.path.dirname(artifacts.rstrip("/"))
    return (f"node {node} does not see the artifact root {root} (marker missing): mount it there, or set "
            f"GpuMagics.artifact_root to a path every node shares")


def values_in_messages(job: dict[str, Any], unseen: str = "") -> dict[str, Any]:
    """The job for a worker on a node that does not see the kernel's files (the marker check failed): its values
    travel in the messages themselves, both ways (``inline``), through the executor's own channel (Ray's object
    store, the Slurm relay's direct channel or stdio): the kernel packed its inputs straight into the message
    (``Worker.values_inline``), so no file of them was made here; ``unseen``: the line that says so
    (``root_unseen``), which the worker prints should the cell leave files in ``$GPULEASE_ARTIFACTS`` there."""
    if (job.get("inputs") or {}).get("file"):  # a caller that did not ask values_inline: the node cannot read it
        raise transfer.TransferError(f"{unseen or 'the worker does not see the kernel files'}: the cell's inputs "
                                     "were written to a file here, not packed into the message")
    return {**job, "inline": True, "oob_dir": None, "root_unseen": unseen}


class RootCheck:
    """Whether a started worker's node sees the kernel's artifact directories: the kernel writes a marker (a random
    token, ``write_marker``) into the lease's directory, the node reads it (``ask(path, token)``, on the node:
    ``sees_marker``). Once per directory and worker."""

    def __init__(self, ask: Callable[[str, str], bool], node: str) -> None:
        self._ask, self.node = ask, node
        self._seen: dict[str, bool] = {}
        self._artifacts = ""  # the lease directory of the job on its way: where the cell's files come back to

    def sees(self, artifacts: str | None, mode: int = 0o700) -> bool:
        if not artifacts:  # (an fsspec root's is a local staging directory: no node sees it)
            return False
        if artifacts not in self._seen:
            try:
                path, token = write_marker(artifacts, mode)
            except OSError:
                return False  # the kernel cannot write there itself: nothing shared to check
            try:
                self._seen[artifacts] = bool(self._ask(path, token))
            except Exception:  # the actor or relay did not answer: not seen (its next call says what became of it)
                self._seen[artifacts] = False
        return self._seen[artifacts]

    def job(self, job: dict[str, Any]) -> dict[str, Any]:
        """``job`` as this worker's node can take it: values through the shared root when it sees it
        (``inputs_on_shared_storage``), else in the messages (``values_in_messages``)."""
        artifacts = (job.get("env") or {}).get("GPULEASE_ARTIFACTS")
        self._artifacts = artifacts or ""
        if self.sees(artifacts, int(job.get("artifacts_mode") or 0o700)):
            return inputs_on_shared_storage(job, artifacts)
        return values_in_messages(job, root_unseen(self.node, artifacts) if artifacts else "")

    def files_back(self, result: dict[str, Any]) -> dict[str, Any]:
        """A worker's result without the cell's files it brought back from a node without the shared root
        (``files``), written into the lease's directory here, each 0600, never through a link or out of it."""
        files = result.pop("files", None)
        if not files or not self._artifacts:
            return result
        base = os.path.realpath(self._artifacts)
        for rel, data in files.items():
            path = os.path.normpath(os.path.join(base, rel))
            if not path.startswith(base + os.sep):
                continue
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                with os.fdopen(create_private(path), "wb") as f:
                    f.write(data)
            except OSError as e:  # e.g. the disk is full: the cell's answer still comes
                result.setdefault("files_failed", []).append(f"{rel}: {e}")
        return result
