"""Suspending a lease's worker instead of ending the lease (issue 33), from the kernel's side.

The broker asks a ``suspendable`` lease's holder to suspend (the heartbeat reply's ``suspend``: why, by when). The
kernel suspends its worker's processes where they run (``worker.suspend``: CUDA checkpoint to host memory, then
SIGSTOP; SIGSTOP alone without CUDA) and reports it (``BrokerClient.suspended``): the broker frees the lease's GPUs.
When the lease is granted again (the holder asked with ``BrokerClient.resume``, or the broker resumed a preempted
lease itself) the processes are resumed, on other GPUs of the same model by UUID pairs when the grant differs, and
go on where they were. Where the worker cannot be suspended (another node's worker, a CUDA host without the
checkpoint API, an error) the kernel says why and the broker does what it does today (the lease is revoked; a
session parks by pickling).

One ``Suspender`` per lease: the session's or the running cell's. Its texts are the broker's words (the view's
``suspend.text`` and ``suspended.text``), never made here.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

from ..client import BrokerClient, BrokerError
from ..executors.base import Worker
from ..lease_view import LeaseView


@functools.lru_cache(maxsize=1)
def local_suspendable() -> bool:
    """Whether this host's workers can be suspended (``worker.suspend.capability().suspendable``): what the local
    executor's requests say in their ``suspendable`` field. Asked once per kernel."""
    from ..worker import suspend

    try:
        return suspend.capability().suspendable
    except Exception:
        return False


def worker_pids(pid: int) -> list[int]:
    """The worker's process and every descendant of it (a DataLoader's workers, a subprocess): all are suspended
    together, the worker first."""
    pids, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        if p in pids:
            continue
        pids.append(p)
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo += [int(c) for c in f.read().split()]
            except (OSError, ValueError):
                continue
    return pids


def _uuids(devices: Any) -> list[str]:
    out = []
    for d in devices or []:
        uuid = (d.get("uuid") or d.get("id")) if isinstance(d, dict) else d  # a view's device: its id is the UUID
        if uuid:
            out.append(str(uuid))
    return out


def gpu_pairs(old: Any, new: Any) -> dict[str, str] | None:
    """Old GPU UUID -> new one, in order, when the new grant's GPUs differ from those the lease left (``None`` when
    they are the same): every checkpointed GPU is listed, as ``cuCheckpointProcessRestore`` requires."""
    before, after = _uuids(old), _uuids(new)
    if not before or before == after or len(after) < len(before):
        return None
    return dict(zip(before, after, strict=False))


class Suspender:
    """Suspends and resumes one lease's worker; thread-safe (the heartbeat thread, a cell, a line magic).

    ``say(text)``: where its messages go (the session's last cell, the running cell's output)."""

    def __init__(self, client: BrokerClient, lease_id: str, say: Callable[[str], None], label: str = "") -> None:
        self.client, self.lease_id, self.say = client, lease_id, say
        self.label = label or f"lease {lease_id}"  # what the messages name: the lease, a session
        #: whether the lease was asked for as ``suspendable`` (else the broker never asks, and nothing is done)
        self.enabled = True
        self.worker: Worker | None = None
        #: the broker's view while the worker's processes are suspended (its ``suspended`` says since when, why,
        #: on which GPUs); None while they run
        self.view: LeaseView | None = None
        self.pids: list[int] = []
        self.how = ""
        self.lost = ""  # why the worker's state was lost at a resume ('' unless it was)
        self._lock = threading.RLock()
        self._asked = 0.0  # the deadline of the ask being handled (one thread per ask)
        #: called before a checkpoint: faults in the worker's host memory for it (a session's, while idle)
        self.prepare: Callable[[], None] | None = None

    @property
    def suspended(self) -> bool:
        return self.view is not None

    def text(self) -> str:
        """The broker's words for the suspension ("suspended since 14:05 (idle); resumes with its next cell")."""
        s = (self.view.suspended if self.view is not None else None) or {}
        return str(s.get("text") or "suspended")

    def why_not(self) -> str:
        """Why this lease's worker cannot be suspended here, or ''."""
        if self.worker is None or not self.worker.alive():
            return "no worker runs on the lease"
        if not self.worker.local:
            return "its worker runs on another node (Ray, Slurm), where the kernel cannot suspend it"
        if not local_suspendable():
            from ..worker import suspend

            return f"this host cannot checkpoint CUDA processes ({suspend.capability().why})"
        return ""

    def ask(self, view: LeaseView, running: bool) -> None:
        """A heartbeat reply: act on a pending ask (off the heartbeat thread: a checkpoint takes a while), and on a
        grant of a suspended lease (resume the processes)."""
        if not self.enabled:
            return
        if self.view is not None and view.holding and self._regranted(view):
            threading.Thread(target=self.resume_processes, args=(view,), name="gpulease-resume", daemon=True).start()
            return
        ask = view.suspend
        if not ask or self.view is not None or not view.holding:
            return
        deadline = float(ask.get("deadline") or 0)
        with self._lock:
            if deadline and deadline == self._asked:
                return  # already handled
            self._asked = deadline or -1.0
        threading.Thread(target=self._answer, args=(ask, running), name="gpulease-suspend", daemon=True).start()

    def _regranted(self, view: LeaseView) -> bool:
        """A holding view of a suspended lease is a new grant, not a heartbeat answered before the suspension was
        reported: the broker resumed it (reason "resumed"), or its suspended time grew."""
        assert self.view is not None
        before = self.view.suspended_seconds
        return view.reason == "resumed" or view.suspended_seconds > before

    def _answer(self, ask: dict[str, Any], running: bool) -> None:
        why = str(ask.get("why") or "")
        if running and why == "expired":  # a running cell's time limit is its time limit: it is not extended
            self.refuse("the cell is running and its time limit ran out")
            return
        view = self.suspend()
        if view is None:
            return
        if running and not (view.suspended or {}).get("resume"):
            try:  # a running cell wants its GPUs back as soon as they are free
                self.client.resume(self.lease_id)
            except BrokerError:
                pass

    def refuse(self, why: str) -> None:
        try:
            self.client.suspended(self.lease_id, False, why=why)
        except Exception:
            pass

    def suspend(self) -> LeaseView | None:
        """Suspend the worker's processes and report it; the broker's view, or None (it could not: reported with
        why, the broker then does what it would have done without suspension, and the message says so)."""
        from ..worker import suspend

        if self.prepare is not None and self.view is None and not self.why_not():
            self.prepare()  # outside the lock: the heartbeat thread's ask takes it
        with self._lock:
            if self.view is not None:
                return self.view
            why_not = self.why_not()
            if why_not:
                self.say(f"gpulease: {self.label} could not be suspended: {why_not}")
                self.refuse(why_not)
                return None
            assert self.worker is not None
            pids = worker_pids(self.worker.pid)
            try:
                done = suspend.suspend(pids)
            except suspend.SuspendError as e:
                self.say(f"gpulease: {self.label} could not be suspended: {e}")
                self.refuse(str(e))
                return None
            try:
                view = self.client.suspended(self.lease_id, True, done.how, done.host_bytes)
            except BrokerError as e:  # the broker did not take it (the lease ended meanwhile): the processes go on
                try:
                    suspend.resume(pids)
                except suspend.ResumeError:
                    pass
                self.say(f"gpulease: {self.label} was not suspended: {e}")
                return None
            self.view, self.pids, self.how = view, pids, done.how
            self.say(f"gpulease: {self.label}: {self.text()}")
            return view

    def resume_processes(self, lease: LeaseView, quiet: bool = False) -> bool:
        """The lease holds GPUs again: resume the processes on them (remapped when they differ from those it
        left), and say so unless ``quiet``. False when the state was lost (``lost`` says why; the worker is
        killed: what ran on it ends)."""
        from ..worker import suspend

        with self._lock:
            if self.view is None:
                return not self.lost
            pairs = (gpu_pairs((self.view.suspended or {}).get("devices"), lease.devices)
                     if self.how == "checkpoint" else None)  # stopped only: no GPU state to move
            try:
                suspend.resume(self.pids, pairs)
            except suspend.ResumeError as e:
                self.lost = str(e)
                self.view = None
                self.say(f"gpulease: {self.label} could not be resumed: {e}; its state is lost")
                if self.worker is not None:
                    self.worker.kill(0.5)
                return False
            self.view = None
            if not quiet:
                devs = ", ".join(f"{d.get('node')}:{d.get('index')}" for d in lease.devices) or "-"
                moved = " (moved to other GPUs of its model)" if pairs else ""
                self.say(f"gpulease: {self.label}: resumed on [{devs}]{moved}")
            return True

    def continue_processes(self) -> None:
        """The lease ended while suspended: let the processes go on (without GPUs) so that they can be stopped or
        parked; a checkpointed process's GPU state cannot come back without a GPU."""
        with self._lock:
            if self.view is None:
                return
            self.view = None
            for pid in self.pids:
                try:
                    os.kill(pid, signal.SIGCONT)
                except OSError:
                    pass
            if self.how == "checkpoint":
                self.lost = "its lease ended while its GPU state was checkpointed"
