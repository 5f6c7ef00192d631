"""``%%gpu --session NAME``: one leased worker kept across cells (a model stays on the GPU)
until ``%gpu session stop NAME`` or the broker ends its lease (idle, a waiting request's pressure, its time
limit: warned first).

A session whose suspendable lease the broker asks to suspend (idle, a waiting request's pressure, its time limit,
a preemption) is *suspended* (``kernel.suspending``): its worker's processes stop where they are (their GPU state
checkpointed to host memory on a CUDA host) and the GPU is free at once; its next cell gets a GPU again and resumes
them, every variable intact, unpicklable ones included. ``%gpu session suspend|resume NAME`` do it by hand.

A session whose lease ends while it waits for its next cell (no suspension: another node's worker, a host that
cannot checkpoint, an error while suspending) is *parked* (``worker.park``): its worker pickles its variables into
host memory and exits, so the GPU is free at once; the session's next cell gets a GPU again and its variables back.
``%gpu session park NAME`` parks one by hand.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from gpulease_protocol.private import private_dir
from gpulease_protocol.words import duration_text

from ..executors.base import Worker, WorkerCrashed
from ..lease_view import LeaseView
from ..tables import fmt_bytes
from ..worker import park
from .acquire import gpu_error, kernel_log, wait_resumed
from .cellrun import LeaseRun
from .suspending import Suspender

#: seconds a worker may take to park its state when the kernel asks (a large model to host memory)
PARK_TIMEOUT = 600.0
#: seconds a worker may take to fault in its checkpoint region (measured: 1.6-2.0 s for 12 GB, H200)
POOL_TIMEOUT = 60.0


@dataclass
class Session:
    name: str
    run: LeaseRun
    worker: Worker
    cells: int = 0
    parent: Any = None  # the message of the last cell that used it: where warnings go
    warned: bool = False
    ended_reason: str = ""
    created: float = field(default_factory=time.time)
    #: where the worker parks its state ({"to": manifest path, "dir": its directory}); None: parking is off
    park_target: dict[str, str] | None = None
    #: the parked state's summary (names, dropped, nbytes, at) once parked, until restored
    parked: dict[str, Any] | None = None
    lock: threading.RLock = field(default_factory=threading.RLock)  # a cell or a park at a time
    #: what holds ``lock`` on a background thread now (words for a cell that waits for it: ``turn``)
    doing: str = ""
    busy: bool = False  # a cell runs in it now
    #: the worker's region for the driver's next checkpoint is faulted in (``worker.ckpt_pool``), until its next job
    pool: bool = False
    #: one prepare at a time: a suspension waits for the warning's to finish (never stopping a worker mid-job)
    preparing: threading.Lock = field(default_factory=threading.Lock)
    shell: Any = None  # the IPython shell its messages go through

    @property
    def lease_id(self) -> str:
        return self.run.lease.id

    def alive(self) -> bool:
        return not self.ended_reason and self.worker.alive() and self.run.status != "ended"

    @property
    def suspender(self) -> Suspender:
        """Suspends and resumes this session's worker (its current lease's ``Suspender``), speaking in its cell."""
        sp = self.run.suspender
        sp.worker, sp.label = self.worker, f"session {self.name!r}"
        sp.say = lambda text: self._say(text, self.shell)
        sp.prepare = self.prepare_pool
        return sp

    def prepare_pool(self) -> None:
        """Fault in the worker's host memory for the driver's checkpoint now (``worker.ckpt_pool``), so that a
        suspension copies at the speed of pages already faulted in: at the idle warning (off the heartbeat thread),
        and before suspending an idle session that was not prepared. Nothing while a cell runs (the session is not
        idle, and its lock is taken), for a worker on another node, without GPU memory, or when done already.
        A second call while one runs (the broker's ask soon after the warning) waits for it."""
        with self.preparing:
            if self.pool or not self.lock.acquire(blocking=False):
                return
            try:
                if self.busy or self.suspended or not self.worker.local or not self.worker.alive():
                    return
                self.doing = f"getting host memory ready for its suspension (at most {POOL_TIMEOUT:g} s)"
                self.pool = self._prepare_pool()
            except (WorkerCrashed, OSError):
                return
            finally:
                self.doing = ""
                self.lock.release()

    @contextlib.contextmanager
    def turn(self, say: Callable[[str], None]) -> Iterator[None]:
        """The session's lock, for a cell (or a line magic): one that finds it held by a background thread (a park,
        the checkpoint region being faulted in) says what it waits for, in one line, instead of waiting silently."""
        if not self.lock.acquire(blocking=False):
            say(f"gpulease: session {self.name!r} is {self.doing or 'busy'}; this cell goes on when that is done\n")
            self.lock.acquire()
        try:
            yield
        finally:
            self.lock.release()

    def _prepare_pool(self) -> bool:
        """Ask the worker for the region and wait for its answer; whether it has one. A region it could not make is
        said in the kernel's log (the suspension then copies at page-fault speed)."""
        from ..worker import ckpt_pool
        from .suspending import worker_pids

        if ckpt_pool.library()[0] is None:  # turned off, or no compiler: the worker has no region to make
            return False
        if any(isinstance(d, dict) and d.get("mig") for d in self.run.lease.devices):
            # a MIG slice: the driver does not checkpoint it (NVIDIA/cuda-checkpoint#42, "out of memory"), and the
            # broker counts the worker's CPU time as activity there: faulting in would put off the idle suspension
            return False
        nbytes = ckpt_pool.gpu_footprint(worker_pids(self.worker.pid))
        if not nbytes:
            return False
        self.worker.submit({"type": "ckpt_pool", "nbytes": nbytes + ckpt_pool.MARGIN})
        deadline = time.monotonic() + POOL_TIMEOUT
        while time.monotonic() < deadline:
            msg = self.worker.poll(0.5, self._quiet, self._quiet)
            if msg is not None and msg.get("type") == "ckpt_pool":
                if not msg.get("ok"):
                    kernel_log(f"gpulease: session {self.name!r}: no checkpoint region ({msg.get('why')}); "
                               "a suspension copies its GPU memory at page-fault speed")
                return bool(msg.get("ok"))
        kernel_log(f"gpulease: session {self.name!r}: its worker did not fault in a checkpoint region within "
                   f"{POOL_TIMEOUT} s")
        return False

    @staticmethod
    def _quiet(text: str) -> None:
        """Output of an idle worker while it prepares (none is expected): dropped."""

    @property
    def suspended(self) -> bool:
        return self.run.suspender.suspended

    def suspended_text(self) -> str:
        """The broker's words for the suspension ("suspended since 14:05 (idle); resumes with its next cell")."""
        return self.run.suspender.text()

    def resume_suspended(self, wait: float | None, label: str) -> None:
        """Get GPUs for a suspended session again (waiting as a request does) and resume its worker on them; the
        caller holds ``lock``. A worker whose state could not be brought back ends the session (``GpuError``)."""
        sp = self.suspender
        if not sp.suspended:
            return
        print(f"gpulease: session {self.name!r}: {sp.text()}; getting GPUs to resume it", file=sys.stderr, flush=True)
        lease = wait_resumed(self.run.client, self.lease_id, wait, label)
        if not sp.resume_processes(lease, quiet=True):
            self.ended_reason = f"its state was lost when resuming it ({sp.lost})"
            self._stop_worker()
            self.run.end("resume_failed")
            raise gpu_error("SessionLost", f"session {self.name!r} could not be resumed: {sp.lost}. Its variables are "
                                           "lost and its lease was released; its next cell starts a new session.")
        self.run.lease = lease

    def resume(self, run: LeaseRun, worker: Worker) -> None:
        """A parked session's new lease and worker (its next job restores the parked state)."""
        self.run, self.worker, self.ended_reason, self.warned = run, worker, "", False

    def job_extra(self) -> dict[str, Any]:
        """What every job of this session carries: where to park, and the parked state to load first."""
        extra: dict[str, Any] = {"park": self.park_target} if self.park_target else {}
        if self.parked is not None and self.park_target:
            extra["restore"] = self.park_target["to"]
        return extra

    def restored(self) -> None:
        """The parked state is back in the worker (or dropped): its files go, with any a killed park left."""
        if self.park_target:
            park.discard(self.park_target["to"])
        self.parked = None

    def find_parked(self) -> dict[str, Any] | None:
        """The parked state's summary, when the worker parked (on the broker's SIGTERM, or asked), else None."""
        if self.parked is None and self.park_target:
            try:
                manifest = park.read(self.park_target["to"])
            except OSError as e:  # not this user's own file (UnsafePathError): never loaded
                print(f"gpulease: session {self.name!r}: {e}", file=sys.stderr)
                manifest = None
            if manifest is not None:
                self.parked = {k: manifest[k] for k in ("names", "dropped", "nbytes", "at")}
        return self.parked

    def parked_where(self) -> str:
        """Where its variables are parked: host memory for a worker of this host, else the park directory (under the
        shared artifact root, ``park_dir``)."""
        if self.worker.local or not self.park_target:
            return "in host memory"
        return f"in {self.park_target['dir']}"

    def describe_parked(self) -> str:
        p = self.parked or {}
        names = p.get("names") or []
        text = f"{len(names)} variable{'s' if len(names) != 1 else ''}, {fmt_bytes(p.get('nbytes') or 0)}"
        dropped = p.get("dropped") or {}
        if dropped:
            text += "; left out (cannot be pickled): " + ", ".join(f"{n} ({why})" for n, why in sorted(dropped.items()))
        return text

    def park(self, reason: str, say: Any = None) -> bool:
        """Ask the worker to park its state, then stop it and end the lease (``reason``); whether the state is
        parked."""
        say = say or (lambda text: None)
        with self.lock:
            if self.parked is None and self.park_target and self.worker.alive():
                self.doing = f"parking its variables {self.parked_where()}"
                try:
                    self.worker.submit({"type": "park", **self.park_target})
                    deadline = time.monotonic() + PARK_TIMEOUT
                    while time.monotonic() < deadline:
                        msg = self.worker.poll(0.5, say, say)
                        if msg is not None and msg.get("type") in ("parked", "park_failed"):
                            if msg.get("error"):
                                say(f"gpulease: session {self.name!r} could not be parked: {msg['error']}\n")
                            break
                except (WorkerCrashed, OSError):
                    pass  # gone meanwhile (the broker stopped it): it may have parked on its SIGTERM
                finally:
                    self.doing = ""
            self._stop_worker()
            self.run.end(reason)
            self.ended_reason = self.ended_reason or reason
            return self.find_parked() is not None

    def on_gone(self, shell: Any) -> None:
        """The broker ended the lease (heartbeat thread): park the state, if the worker has not already (it parks
        on the broker's SIGTERM; a worker the broker may not stop is asked here), and say so in the session's
        last cell. Off the heartbeat thread: parking a large model takes a while."""
        why = self.run.ended_why() or f"its lease {self.lease_id} ended"
        self.ended_reason = why
        sp = self.run.suspender
        sp.continue_processes()  # ended while suspended: the processes go on, to park (or be stopped)
        if sp.lost:
            self._stop_worker()
            self._say(f"gpulease: session {self.name!r}: {why}; {sp.lost}: its variables are gone", shell)
            return

        def park_and_say() -> None:
            say = lambda text: self._say(text.rstrip("\n"), shell)  # noqa: E731
            parked = self.park_target is not None and (self.park(why, say) or self._wait_parked())
            if parked:
                say(f"gpulease: session {self.name!r}: {why}; its variables are parked {self.parked_where()} "
                    f"({self.describe_parked()}) and come back with its next cell")
            else:
                say(f"gpulease: session {self.name!r}: {why}; its variables are gone")

        threading.Thread(target=park_and_say, name="gpulease-park", daemon=True).start()

    def _wait_parked(self, timeout: float = 5.0) -> bool:
        """A worker the broker stopped may still be writing its manifest (it has the broker's term_timeout)."""
        deadline = time.monotonic() + timeout
        while self.find_parked() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        return self.parked is not None

    def _stop_worker(self) -> None:
        try:
            if self.worker.alive():
                self.worker.submit({"type": "stop"})
                if self.worker.wait_exit(2.0) is None:
                    self.worker.kill(1.0)
        except Exception:
            self.worker.kill(0.5)
        finally:
            self.worker.close()

    def on_heartbeat(self, view: LeaseView, warn_window: float, shell: Any) -> None:
        """Called from the heartbeat thread with the broker's view of the lease (a live one: the broker answers a
        heartbeat for an ended lease with 409, and ``on_gone`` runs)."""
        self.suspender.ask(view, running=self.busy)
        if view.phase == "suspended":  # no idle countdown; a prepared region was the checkpoint's
            self.pool = False
            return
        deadline = view.idle_deadline
        # never while a cell runs: its heartbeats count as activity (a beat the load delayed can bring the deadline
        # near), and a warning then would mark the session warned before it is idle, and its region unprepared
        if deadline and not self.warned and not self.busy and deadline - time.time() <= warn_window:
            self.warned = True
            suspends = self.run.suspender.enabled and not self.run.suspender.why_not()
            if suspends:  # the checkpoint's memory, faulted in while nobody waits (worker.ckpt_pool)
                threading.Thread(target=self.prepare_pool, name="gpulease-ckpt-pool", daemon=True).start()
            then = ("its processes will be suspended until its next cell, every variable kept"
                    if suspends
                    else f"its variables will be parked {self.parked_where()} until its next cell" if self.park_target
                    else "its variables will be gone")
            self._say(
                f"gpulease: session {self.name!r} has been idle; its lease {self.lease_id} will be revoked in "
                f"{duration_text(deadline - time.time())} unless a cell uses it, and {then} (`%gpu session park "
                f"{self.name}` gives the GPU back now, `%gpu session stop {self.name}` ends the session)", shell)

    def _say(self, text: str, shell: Any) -> None:
        tokens = None
        if self.parent is not None and hasattr(shell, "set_thread_parent"):
            tokens = shell.set_thread_parent(self.parent)
        try:
            print(text, file=sys.stderr, flush=True)
        finally:
            if tokens is not None:
                shell.reset_thread_parent(tokens)

    def stop(self, reason: str = "released") -> None:
        """End the session: its worker, its lease and any parked state."""
        with self.lock:
            try:
                self._stop_worker()
            finally:
                self.run.end(reason)
                self.find_parked()
                self.restored()  # (the parked files go)


class Sessions:
    def __init__(self) -> None:
        self.by_name: dict[str, Session] = {}

    def get(self, name: str) -> Session | None:
        return self.by_name.get(name)

    def add(self, session: Session) -> None:
        self.by_name[session.name] = session

    def stop(self, name: str) -> Session:
        s = self.by_name.pop(name, None)
        if s is None:
            known = ", ".join(sorted(self.by_name)) or "none"
            raise KeyError(f"No session {name!r} (sessions: {known})")
        s.stop()
        return s

    def discard(self, name: str) -> None:
        s = self.by_name.pop(name, None)
        if s is not None:
            s.stop("session_gone")

    def stop_all(self, reason: str = "session_gone") -> None:
        for name in list(self.by_name):
            s = self.by_name.pop(name)
            s.stop(reason)

    def park(self, name: str) -> Session:
        s = self.by_name.get(name)
        if s is None:
            known = ", ".join(sorted(self.by_name)) or "none"
            raise KeyError(f"No session {name!r} (sessions: {known})")
        if s.park_target is None:
            raise ValueError("parking is off (GpuMagics.park_sessions)")
        if not s.alive() and s.find_parked() is None:
            raise ValueError(f"session {name!r} has ended ({s.ended_reason or 'worker gone'}): nothing to park")
        if s.parked is None and not s.park("parked", lambda text: print(text, end="", file=sys.stderr)):
            raise ValueError(f"session {name!r} could not be parked; its lease was released")
        s.ended_reason = s.ended_reason or "parked"
        return s

    def suspend(self, name: str) -> Session:
        """``%gpu session suspend NAME``: suspend the session's worker now and report it (of its own accord)."""
        s = self._named(name)
        if not s.alive():
            raise ValueError(f"session {name!r} has ended ({s.ended_reason or 'worker gone'}): nothing to suspend")
        with s.lock:
            sp = s.suspender
            said: list[str] = []
            sp.say = said.append  # the line magic says what happened
            try:
                if sp.suspend() is None:
                    raise ValueError(said[-1].removeprefix("gpulease: ") if said else
                                     f"session {name!r} could not be suspended")
            finally:
                sp.say = lambda text: s._say(text, s.shell)
        return s

    def resume(self, name: str) -> Session:
        """``%gpu session resume NAME``: get GPUs for a suspended session and resume its worker now."""
        s = self._named(name)
        with s.lock:
            if not s.suspended:
                raise ValueError(f"session {name!r} is not suspended")
            s.resume_suspended(None, f"session {name}")
        return s

    def _named(self, name: str) -> Session:
        s = self.by_name.get(name)
        if s is None:
            known = ", ".join(sorted(self.by_name)) or "none"
            raise KeyError(f"No session {name!r} (sessions: {known})")
        return s

    def rows(self) -> list[list[Any]]:
        return [[s.name, s.lease_id, _state(s), s.cells, duration_text(time.time() - s.created)]
                for s in self.by_name.values()]


def _state(s: Session) -> str:
    if s.alive() and s.suspended:
        return s.suspended_text()
    if s.alive():
        return "alive"
    if s.find_parked() is not None:
        return f"parked ({s.describe_parked()})"
    return s.ended_reason or "ended"


def park_target(directory: str) -> dict[str, str]:
    """Where a new session of this kernel parks: a manifest named after this process, so that a kernel that died
    without cleaning up can be told from a live one (``sweep_orphans``)."""
    return {"dir": directory, "to": os.path.join(directory, f"gpulease-park-{os.getpid()}-{os.urandom(8).hex()}")}


def sweep_orphans(directory: str | None = None) -> int:
    """Remove the parked states of this user's kernels that are gone (killed before they could remove them) from
    ``directory`` (default: this user's ``shm_dir``): host memory otherwise held until the next reboot. How many
    were removed."""
    from ..wire import transfer

    removed = 0
    try:
        directory = directory or transfer.shm_dir()
        names = os.listdir(directory)
    except OSError:  # (a directory another user made in this user's place: refused, and said at the first park)
        return 0
    for name in names:
        parts = name.split(".")[0].split("-")  # gpulease-park-PID-RANDOM[.buf|.N.tmp]
        if not name.startswith("gpulease-park-") or len(parts) != 4 or not parts[2].isdigit():
            continue
        path = os.path.join(directory, name)
        try:
            if os.lstat(path).st_uid != os.geteuid() or os.path.exists(f"/proc/{parts[2]}"):
                continue
            os.unlink(path)
        except OSError:
            continue
        removed += 1
    return removed


def park_dir(worker: Worker, artifact_root: str | None) -> str | None:
    """Where a session's worker parks its state, a directory of this user's own (0700): in host memory for a worker
    of this host (``shm_dir``); under the shared artifact root for one on another node (None when it has none: no
    parking). One that another user made first is refused (``UnsafePathError``), never used."""
    from ..artifacts import local_root
    from ..wire import transfer

    if worker.local:
        return transfer.shm_dir()
    local = local_root(artifact_root) if artifact_root else None
    if local is None:
        return None
    os.makedirs(local, exist_ok=True)
    directory = private_dir(os.path.join(local, ".park"))
    unseen = worker.unseen(directory)  # the worker's node checks it reads this kernel's marker there
    if unseen:
        raise OSError(unseen)  # said at once, in one line: the session's variables would be lost with its lease
    return directory
