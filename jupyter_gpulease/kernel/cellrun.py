"""Run code on a lease: the one path shared by ``%%gpu``, sessions and the Python API.

lease granted → worker attached to the lease → job sent (inputs out of band) → output
forwarded live to the cell and to ``output.log`` → result handed back → worker exits →
lease released (that is when the GPU memory is actually free) → ``meta.json`` written (once the kernel has
answered the cell: ``fastpath.after_answer``).
Cleanup lives in ``finally`` so the lease is released on every path.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..artifacts import ArtifactDir, now_iso
from ..client import BrokerClient, BrokerError
from ..executors.base import Sink, Worker, WorkerCrashed
from ..lease_view import LeaseView
from ..wire import transfer, vmcopy
from ..wire.fastpath import ATTACH_AFTER, after_answer, later, on_pool
from .acquire import HOLDINGS, Heartbeater, ended_text, release_quietly
from .drive import Sinks, drive
from .suspending import Suspender

# Broker calls off the cell's critical path (attaching a worker), in order, on one kept-alive connection.
_IO = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpulease-io")


class CellError(Exception):
    """The cell failed in its worker: IPython shows the worker's own traceback, not ours."""

    def __init__(self, ename: str, evalue: str, traceback_text: str) -> None:
        super().__init__(evalue)
        self.ename, self.evalue, self.traceback_text = ename, evalue, traceback_text
        #: the run so far (lease, wall time, artifacts), for the summary line of a failed cell
        self.outcome: Outcome | None = None
        #: the cell's code ran to its end; only its results could not come back (an unpicklable ``--out``)
        self.code_ok = False

    def _render_traceback_(self) -> list[str]:
        return self.traceback_text.rstrip("\n").split("\n")


def cell_error(ename: str, evalue: str, text: str) -> CellError:
    """A CellError whose type carries the remote exception's name (what the notebook shows as ename)."""
    cls: type[CellError] = type(ename, (CellError,), {"__module__": "gpu"}) if ename.isidentifier() else CellError
    return cls(ename, evalue, text)


@dataclass
class Job:
    kind: str = "cell"  # "cell" | "call"
    code: str = ""
    cell_name: str = "<gpu>"
    inputs: dict[str, Any] = field(default_factory=dict)
    out: list[str] = field(default_factory=list)
    want_value: bool = True
    header: str = ""  # the magic line, so line numbers match the notebook's


@dataclass
class Outcome:
    lease: LeaseView
    value: Any = None
    outputs: dict[str, Any] = field(default_factory=dict)
    wall: float = 0.0
    queued: float = 0.0
    exit_status: int | None = None
    artifacts: str = ""
    usage: dict[str, Any] | None = None  # the lease's figures when the result came (shared leases: the --mem hint)


def lease_env(lease: LeaseView, artifacts: ArtifactDir) -> dict[str, str]:
    env = {k: str(v) for k, v in lease.env.items()}
    env.setdefault("CUDA_VISIBLE_DEVICES", "")
    env["GPULEASE_LEASE_ID"] = lease.id
    env["GPULEASE_ARTIFACTS"] = artifacts.local
    return env


def job_message(job: Job, env: dict[str, str], oob_dir: str | None, vm: bool = False,
                inline: bool = False) -> dict[str, Any]:
    """The job for a worker. ``vm``: it is this kernel's own child, big buffers are copied straight
    between the two processes (``transfer.push``/``pull``) instead of through files. ``oob_dir``: where buffer
    files go (None: this user's ``transfer.shm_dir()``, made only if a file is needed). ``inline``: the worker
    cannot read this host's files (``Worker.values_inline``): big buffers in the message itself, no file."""
    msg: dict[str, Any] = {
        "type": "run",
        "kind": job.kind,
        "code": job.code,
        "cell_name": job.cell_name,
        "out": job.out,
        "want_value": job.want_value,
        "header": job.header,
        "env": env,
        "cwd": os.getcwd(),
        "sys_path": [p for p in sys.path if p and os.path.isdir(p)],
        "oob_dir": oob_dir,
        "vm": vm,
        "inputs": transfer.dumps_named(job.inputs, oob_dir, vm, inline) if job.inputs else None,
    }
    return msg


def finish_result(result: dict[str, Any], outcome: Outcome) -> None:
    """Unpack the worker's answer into ``outcome``, or raise the cell's own error."""
    if result["status"] != "ok":
        err = cell_error(result["ename"], result["evalue"], result["traceback"])
        err.code_ok = bool(result.get("code_ok"))
        raise err
    payload = transfer.loads(result["payload"], result["payload"].get("buffers"))
    outcome.outputs, outcome.value = payload["outputs"], payload["value"]


class LeaseRun:
    """Runs jobs on one granted lease (one single-use worker each, or a session's worker)."""

    def __init__(self, client: BrokerClient, heartbeater: Heartbeater, lease: Mapping[str, Any], artifact_root: str,
                 queued: float = 0.0, group_readable: bool = False) -> None:
        self.client, self.heartbeater = client, heartbeater
        self.lease = lease = LeaseView.from_json(lease)
        self.artifacts = ArtifactDir(artifact_root, lease.id, group_readable)
        self.queued = queued
        self.started_at = now_iso()
        self.t0 = time.monotonic()
        self.code_hashes: list[str] = []
        self.exit_status: int | None = None
        self.status = "running"
        self.error: dict[str, str] | None = None  # the last failed job's exception: {type, message}
        self._attached: set[int] = set()
        self._reapers: list[threading.Event] = []  # set once each reaped worker is gone
        self._auto_end = False
        self._end_lock = threading.Lock()
        self._notices: list[str] = []
        self._preempting: dict[str, Any] | None = None
        #: suspends the running cell's worker when the broker asks (a suspendable lease), resumes it at the grant
        self.suspender = Suspender(client, lease.id, lambda text: self._notices.append(text.rstrip("\n") + "\n"))
        heartbeater.add(lease.id, active=True, on_reply=self.on_beat)

    def on_beat(self, reply: Mapping[str, Any]) -> None:
        """A heartbeat's answer (heartbeat thread): note a preemption warning for the cell to print; keep the
        lease's devices (an incremental lease grows)."""
        view = LeaseView.from_json(reply)
        if self.status == "running" and self.suspender.worker is not None:
            self.suspender.ask(view, running=True)
        warning = view.preempting
        if warning and self._preempting is None:
            self._preempting = warning
            left = max(0.0, float(warning["deadline"]) - time.time())
            self._notices.append(
                f"gpulease: lease {view.id} is being preempted by priority class {warning['by_class']!r}: "
                f"save a checkpoint within {left:.0f} s, then the lease is revoked\n")
        if view.holding:
            self.lease = view

    def take_notices(self) -> list[str]:
        out, self._notices = self._notices, []
        return out

    def ended_why(self) -> str:
        """Why the broker ended this lease, for a worker that died (preempted, revoked, expired), or ''."""
        try:
            view = self.client.lease(self.lease.id)
        except Exception:
            return ""
        if not view.ended or view.state == "released":  # a release while the cell ran: ``stopped_by``
            return ""
        if view.reason == "preempted":  # the words, with the class (and, for admins, the user) that took it
            by = (view.preempted_by or {}).get("priority")
            who = (view.preempted_by or {}).get("user")
            return (f"the lease was preempted by priority class {by!r}" + (f" (user {who})" if who else "")
                    + ": its GPUs went to a higher priority request")
        return f"the lease was {ended_text(view)}"

    def _view(self) -> LeaseView | None:
        try:
            return self.client.lease(self.lease.id)
        except Exception:
            return None

    def stopped_by(self) -> str:
        """For a worker that died because its owner released the lease (``gpulease release``, the sidebar,
        ``%gpu release``) while the cell ran: one line saying who and how; else ''. (An admin's revocation stays
        a ``WorkerCrashed`` naming the admin's reason, see ``ended_why``.)"""
        try:
            view = self.client.lease(self.lease.id)
        except Exception:
            return ""
        if view.state != "released":
            return ""
        how = view.reason[len("released"):].strip() if view.reason.startswith("released") else view.reason
        return (f"lease {view.id} was released by {view.user or 'its owner'}" + (f" {how}" if how else "")
                + " while the cell ran: the cell was stopped")

    def env(self) -> dict[str, str]:
        return lease_env(self.lease, self.artifacts)

    def logging_sinks(self, sinks: Sinks) -> Sinks:
        def tee(sink: Sink) -> Sink:
            def write(text: str) -> None:
                self.artifacts.log(text)
                sink(text)

            return write

        return Sinks(tee(sinks.out), tee(sinks.err))

    def run(self, worker: Worker, job: Job, sinks: Sinks, grace: float, single_use: bool = True,
            release: bool = True, env: dict[str, str] | None = None, extra: dict[str, Any] | None = None) -> Outcome:
        """Run ``job`` on ``worker`` (already started); ``extra``: more fields for the job's message (a session's
        ``park`` and ``restore``, see ``worker.park``).

        The result is handed back as soon as the worker sends it; a single-use worker is then
        reaped off the critical path and, with ``release``, the lease given back the moment the
        process is gone (that is when its GPU memory is free).
        """
        self.code_hashes.append(hashlib.sha256(job.code.encode()).hexdigest()[:16])
        self.status = "running"
        self.error = None
        self.suspender.worker = worker
        if worker.local and worker.pid not in self._attached:
            self._attached.add(worker.pid)
            on_pool(_IO, self._attach, worker)  # in flight while the job runs (never waited for: see _attach)
        self.heartbeater.set_active(self.lease.id, True)
        oob_dir = None  # this user's shm directory, where a file is needed at all
        outcome = Outcome(self.lease, queued=self.queued, artifacts=self.artifacts.display_path)
        t0 = time.monotonic()
        msg: dict[str, Any] | None = None
        reaped = False
        try:
            try:
                job_env = {**self.env(), **(env or {})}
                oob_dir = worker.values_dir(job_env, self.artifacts.mode)  # a remote worker's: written there at once
                msg = job_message(job, job_env, oob_dir, worker.local and vmcopy.usable(),
                                  worker.values_inline(job_env, self.artifacts.mode))
            except transfer.TransferError as e:  # an unpicklable input: one line naming it, not our frames
                self.status = "error"
                raise self._failed(cell_error("TransferError", str(e), f"TransferError: {e}"), outcome, t0) from None
            msg["artifacts_mode"] = self.artifacts.mode  # the worker makes the lease's directory so
            msg.update(extra or {})
            try:
                result = drive(worker, msg, self.logging_sinks(sinks), grace, self.take_notices)
            except WorkerCrashed as e:
                self.exit_status = e.status
                # the broker stops a released lease's processes: SIGTERM, then SIGKILL after its grace
                stopped = self.stopped_by() if e.status in (-signal.SIGTERM, -signal.SIGKILL) else ""
                if stopped:  # not a crash: someone ended the lease, and the broker stopped its processes
                    self.status = "stopped"
                    err = cell_error("LeaseEnded", stopped, f"{job.header.split()[0] if job.header else 'gpulease'}"
                                                            f": {stopped}")
                else:
                    self.status = "crashed"
                    why = self.ended_why()
                    text = f"{e}: {why}" if why else str(e)
                    err = cell_error("WorkerCrashed", text, f"WorkerCrashed: {text}")
                raise self._failed(err, outcome, t0) from None
            except KeyboardInterrupt:
                self.status = "interrupted"
                self.error = {"type": "KeyboardInterrupt", "message": "interrupted"}
                raise
            self.status = "ok" if result["status"] == "ok" else "error"
            outcome.wall = time.monotonic() - t0
            if self.lease.fraction < 1 or self.lease.mem_bytes:  # a shared GPU: the --mem hint needs its figures
                outcome.usage = (self._view() or self.lease).usage
            if single_use:
                self._reap(worker, release)
                reaped = True
            try:
                finish_result(result, outcome)
            except CellError as e:
                raise self._failed(e, outcome, t0) from None
            return outcome
        finally:
            if msg is not None:
                transfer.discard(msg.get("inputs"))
            if single_use and not reaped:
                if worker.alive():
                    worker.kill(0.5)
                self.exit_status = worker.returncode
                worker.close()
            elif not single_use:
                self.heartbeater.set_active(self.lease.id, False)

    def _failed(self, err: CellError, outcome: Outcome, t0: float) -> CellError:
        """Note a failed job: its traceback in ``output.log``, its type and message for ``meta.json``, the run so
        far on the error (for the cell's summary line)."""
        self.error = {"type": err.ename, "message": err.evalue}
        outcome.wall = outcome.wall or time.monotonic() - t0
        err.outcome = outcome
        try:
            self.artifacts.log(err.traceback_text.rstrip("\n") + "\n")
        except Exception:
            pass
        return err

    def _attach(self, worker: Worker) -> None:
        """Tell the broker the worker's pid (so that it can stop it when the lease ends, and count its use of the
        GPUs). Only once it has run ``ATTACH_AFTER`` seconds: a single-use worker done sooner is gone before the
        broker could act on it, and its attach would only compete with the cell for the kernel and the broker."""
        time.sleep(ATTACH_AFTER)
        if not worker.alive():
            return
        try:
            self.client.attach(self.lease.id, worker.pid)
        except Exception as e:
            if self.status != "running" or not worker.alive():
                return  # the worker is already gone: nothing left to attach
            if isinstance(e, BrokerError) and e.status in (404, 409):
                worker.kill(0.5)  # the lease ended meanwhile: its GPUs are no longer this worker's
                return
            print(f"gpulease: could not attach worker {worker.pid} to lease {self.lease.id}: {e}", file=sys.stderr)

    def _reap(self, worker: Worker, then_end: bool) -> None:
        """Wait for the worker's exit in the background; with ``then_end``, then release the lease."""
        reaped = threading.Event()

        def reap() -> None:
            try:
                self.exit_status = worker.wait_exit()
                worker.close()
            finally:
                reaped.set()
                if then_end:
                    self.end(from_reaper=True)

        if then_end:
            self._auto_end = True
            HOLDINGS.giving_back(self.lease.id)
        self._reapers.append(reaped)
        later(reap)  # on a thread that is already running: starting one would hold up the cell's answer

    def end(self, reason: str = "released", *, from_reaper: bool = False) -> None:
        """Release the lease (idempotent, after its workers are gone) and write meta.json (from the reaper: once the
        kernel has answered the cell, ``fastpath.after_answer``)."""
        if self._auto_end and not from_reaper:
            return  # the reaper ends it the moment the worker is gone (never wait on its lock: it waits on the broker)
        with self._end_lock:
            if self.status == "ended" or (self._auto_end and not from_reaper):
                return  # already ended, or the reaper ends it the moment the worker is gone
            for reaped in self._reapers:  # (a reaper that ends the lease has set its own)
                reaped.wait(30)
            status, self.status = self.status, "ended"
        self.heartbeater.remove(self.lease.id)
        final = release_quietly(self.client, self.lease.id, reason) or self._view()
        HOLDINGS.discard(self.lease.id)
        meta = {
            "lease_id": self.lease.id,
            "user": self.lease.user,
            "devices": self.lease.devices,
            "node": self.lease.node,
            "simulated": self.lease.simulated,
            "env": self.lease.env,
            "started_at": self.started_at,
            "ended_at": now_iso(),
            "wall_seconds": round(time.monotonic() - self.t0, 6),
            "queued_seconds": round(self.queued, 6),
            "status": status,
            "error": self.error,
            "exit_status": self.exit_status,
            "code_sha256": self.code_hashes,
            "usage": final.usage if final is not None else None,  # peak GPU memory, mean/peak utilisation
        }
        if from_reaper:  # the kernel is answering the cell now: its meta.json waits until that is done
            after_answer(self._finish_artifacts, meta)
        else:
            self._finish_artifacts(meta)

    def _finish_artifacts(self, meta: dict[str, Any]) -> None:
        try:
            self.artifacts.finish(meta)
        except Exception as e:  # storage trouble must not lose the result
            print(f"gpulease: could not write artifacts to {self.artifacts.url}: {e}", file=sys.stderr)


def summary_line(outcome: Outcome, failed: str = "", not_back: bool = False) -> str:
    """The one line after a cell: lease, GPUs, wall time, time queued, artifacts. ``failed``: the error's type;
    ``not_back``: the cell's code succeeded but its results could not come back (the error says which)."""
    from gpulease_protocol.words import duration_text, gpus_text

    lease = outcome.lease
    devs = lease.devices
    what = ", ".join(f"{d.get('node')}:{d.get('index')}" for d in devs) or "-"
    frac = lease.fraction or 1.0
    n = gpus_text(frac if frac < 1 else len(devs))
    sim = " (simulated)" if lease.simulated else ""
    if not_back:
        ran = f"ran {duration_text(outcome.wall)}, results not brought back"
    elif failed:
        ran = f"failed ({failed}) after {duration_text(outcome.wall)}"
    else:
        ran = f"ran {duration_text(outcome.wall)}"
    return (f"gpulease: lease {lease.id} · {n} [{what}]{sim} · {ran} · "
            f"queued {duration_text(outcome.queued)} · artifacts {outcome.artifacts}") + memory_hint(outcome)


def memory_hint(outcome: Outcome) -> str:
    """A second line when a cell on a shared GPU used far less memory than it held (under a quarter, and at least
    1 GiB less): the ``--mem`` that would leave the rest to others. '' otherwise."""
    from ..tables import fmt_bytes

    u = outcome.usage or {}
    peak, held = u.get("peak_memory"), u.get("held_memory") or 0
    if peak is None or not held or peak * 4 > held or held - peak < 1 << 30:
        return ""
    suggest = max(1, -(-int(peak * 1.5) // (1 << 30)))  # GiB, rounded up, with room to grow
    sim = " (simulated figures)" if outcome.lease.simulated else ""
    return (f"\ngpulease: this cell used at most {fmt_bytes(peak)} of the {fmt_bytes(held)} of GPU memory it held on "
            f"a shared GPU{sim}: --mem {suggest}G would leave the rest to others")
