"""Allocations of the Slurm inventory: a lease's salloc (in a thread), its grant or refusal handed to the
event loop (as changes for the lease owner), and its release (scancel, then waiting until Slurm frees the GPUs)
and time limit updates."""

from __future__ import annotations

import functools
import logging
import math
import queue
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..core.errors import LeaseError
from ..core.lease import HOLDING, Lease
from .changes import InventoryChange, LeaseFailed, LeasePlaced
from .slurm_cli import _ALLOC_RE, LIVE_STATES, SlurmCommands, _reason, _slurm_message, gpu_id

log = logging.getLogger("lease_broker")


@dataclass
class Allocation:
    """The Slurm job behind one lease."""

    lease_id: str
    name: str
    job_id: str = ""
    state: str = "pending"  # pending (salloc waits for Slurm) / ready (granted)
    since: float = field(default_factory=time.monotonic)
    granted_at: float = 0.0  # monotonic; 0 until granted
    nodes: list[dict[str, Any]] = field(default_factory=list)  # [{"node", "gpus", "indices"}]
    time_limit: int = 0  # minutes asked of Slurm
    devices: list[str] = field(default_factory=list)  # the lease's GPU ids (drain until Slurm frees them)
    said: str = ""  # what salloc said about a pending job


class Changes:
    """Changes for the lease owner, gathered on the event loop until the inventory's next reconcile()."""

    def __init__(self) -> None:
        self.items: list[InventoryChange] = []

    def fail(self, lease_id: str, reason: str) -> None:
        log.error("Lease %s: %s", lease_id, reason)
        self.items.append(LeaseFailed(lease_id, _reason(reason)))

    def take(self) -> list[InventoryChange]:
        out, self.items = self.items, []
        return out


class SlurmAllocations:
    """The Slurm jobs behind holding leases: each lease's salloc (in a thread), its grant or refusal (handed to
    the event loop as a result), its release (scancel, then waiting until Slurm frees the GPUs) and time limit."""

    def __init__(self, cli: SlurmCommands, time_margin_seconds: Callable[[], float], wake: Callable[[], None],
                 changes: Changes) -> None:
        self.cli, self._margin, self._wake, self.changes = cli, time_margin_seconds, wake, changes
        self._lock = threading.Lock()
        self.allocs: dict[str, Allocation] = {}  # lease id -> its Slurm job (holding leases only)
        self._ended: set[str] = set()  # leases ended while their salloc still ran
        self._salloc: dict[str, subprocess.Popen[str]] = {}  # lease id -> salloc in flight
        self._freeing: dict[str, str] = {}  # gpu id -> job id being cancelled (the GPU drains meanwhile)
        self._results: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._leases: Mapping[str, Lease] = {}  # the live leases, as the last reconcile() gave them
        self._known: set[str] = set()  # the GPUs the broker has, as the last reconcile() gave them

    def freeing(self, gpu_id: str) -> bool:
        """Whether Slurm may still hold a GPU of a cancelled job."""
        return gpu_id in self._freeing

    # ---------------------------------------------------------------- allocations
    def _time_limit(self, lease: Lease, now: float | None) -> int:
        remaining = (lease.expires_at - now) if now is not None and lease.expires_at else lease.duration_seconds
        return max(1, math.ceil((max(remaining, 0.0) + self._margin()) / 60.0))

    def allocate(self, lease: Lease, now: float | None) -> None:
        if lease.id in self.allocs:
            return
        alloc = Allocation(lease.id, self.cli.job_name(lease.id), devices=list(lease.devices))
        self.allocs[lease.id] = alloc
        if lease.request.shared:
            self._post(lambda: self._refuse(lease.id, "", "shared (fractional) GPUs cannot be leased through Slurm, "
                                            "whose GRES are whole GPUs: ask for whole GPUs"))
            return
        alloc.time_limit = self._time_limit(lease, now)
        cmd = self.cli.salloc_command(lease, alloc.time_limit)
        log.info("Lease %s: allocating in Slurm: %s", lease.id, " ".join(cmd))
        threading.Thread(target=self._salloc_thread, args=(lease.id, cmd), daemon=True,
                         name=f"gpulease-salloc-{lease.id}").start()

    def _salloc_thread(self, lease_id: str, cmd: list[str]) -> None:
        job_id, t0 = "", time.monotonic()
        errors: list[str] = []
        notes: list[str] = []
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, env=self.cli.env, start_new_session=True)
        except OSError as e:
            why = f"cannot run salloc: {e}"
            self._post(lambda: self._refuse(lease_id, "", why))
            return
        with self._lock:
            self._salloc[lease_id] = proc
        try:
            assert proc.stderr is not None
            for line in proc.stderr:
                m = _ALLOC_RE.search(line)
                if m:
                    job_id = m.group(2)
                    if m.group(1) == "Pending":
                        self._post(functools.partial(self._pending, lease_id, job_id, "; ".join(notes)))
                elif "error:" in line or "salloc: Job allocation" in line:
                    errors.append(line.split("error:", 1)[-1].replace("salloc:", "").strip())
                elif line.startswith("salloc: ") and "queued and waiting" not in line:
                    notes.append(line[len("salloc: "):].strip())  # e.g. why a job pends
            rc = proc.wait()
        finally:
            with self._lock:
                self._salloc.pop(lease_id, None)
                ended = lease_id in self._ended
                self._ended.discard(lease_id)
        if rc == 0 and job_id:
            if ended:  # released while salloc ran: the allocation is nobody's
                self._cancel_job(job_id, [])
                return
            try:
                nodes = self.cli.allocation_nodes(job_id)
            except LeaseError as e:
                log.warning("Lease %s: cannot read the GPUs of Slurm job %s: %s", lease_id, job_id, e)
                nodes = []
            elapsed = time.monotonic() - t0
            self._post(lambda: self._granted(lease_id, job_id, nodes, elapsed))
        elif not ended:
            message = "; ".join(e for e in errors if e) or f"salloc exited with status {rc}"
            self._post(lambda: self._refuse(lease_id, job_id, message))

    def _post(self, fn: Callable[[], None]) -> None:
        """Hand a result of a thread to the event loop: the owner reconciles soon and applies it."""
        self._results.put(fn)
        self._wake()

    def apply_results(self, leases: Mapping[str, Lease], known: set[str]) -> None:
        """The threads' results, in order (on the event loop); ``known``: the GPUs the broker has."""
        self._leases, self._known = leases, known
        while True:
            try:
                fn = self._results.get_nowait()
            except queue.Empty:
                break
            try:
                fn()
            except Exception:
                log.exception("Slurm inventory: applying a result failed")

    # results, on the event loop
    def live(self, lease_id: str) -> Lease | None:
        lease = self._leases.get(lease_id)
        return lease if lease is not None and lease.state in HOLDING else None

    def _pending(self, lease_id: str, job_id: str, said: str) -> None:
        alloc = self.allocs.get(lease_id)
        if alloc is not None:
            alloc.job_id, alloc.said = job_id, said
            log.info("Lease %s: Slurm job %s pending%s", lease_id, job_id, f": {said}" if said else "")

    def _granted(self, lease_id: str, job_id: str, nodes: list[dict[str, Any]], elapsed: float) -> None:
        alloc, lease = self.allocs.get(lease_id), self.live(lease_id)
        if alloc is None or lease is None:
            self._cancel(lease_id, job_id, [])
            return
        alloc.job_id, alloc.state, alloc.nodes, alloc.granted_at = job_id, "ready", nodes, time.monotonic()
        log.info("Lease %s: Slurm job %s granted after %.3f s: %s", lease_id, job_id, elapsed,
                 " ".join(f"{n['node']}:{','.join(map(str, n['indices']))}" for n in nodes))
        devices = self._slurm_choice(lease, nodes)
        if devices is not None:
            alloc.devices = list(devices)
        self.changes.items.append(LeasePlaced(lease_id, devices))

    def _slurm_choice(self, lease: Lease, nodes: list[dict[str, Any]]) -> tuple[str, ...] | None:
        """Slurm picks the GPU indices on each node: the lease's devices become those (None: as they are)."""
        chosen = [gpu_id(n["node"], i) for n in nodes for i in n["indices"]]
        if not chosen or sorted(chosen) == sorted(lease.devices):
            return None
        held = {d for other in self._leases.values() if other is not lease and other.state in HOLDING
                for d in other.devices}
        known = self._known
        if len(chosen) != len(lease.devices) or any(d in held or d not in known for d in chosen):
            log.warning("Lease %s: Slurm gave GPUs %s, the broker chose %s (held elsewhere or unknown: kept)",
                        lease.id, chosen, lease.devices)
            return None
        log.info("Lease %s: devices follow Slurm's choice: %s -> %s", lease.id, lease.devices, chosen)
        return tuple(chosen)

    def _refuse(self, lease_id: str, job_id: str, message: str) -> None:
        lease = self.live(lease_id)
        self.allocs.pop(lease_id, None)
        if job_id:
            self.cancel_job_async(job_id, [])
        if lease is not None:
            self.changes.fail(lease_id, "slurm_refused: " + message)

    # ---------------------------------------------------------------- release
    def end(self, lease_id: str) -> None:
        """A lease ended: cancel its allocation, if it has one."""
        alloc = self.allocs.pop(lease_id, None)
        if alloc is not None:
            self._cancel(lease_id, alloc.job_id, alloc.devices)

    def _cancel(self, lease_id: str, job_id: str, devices: list[str]) -> None:
        """End a lease's allocation (by name too: it may still be pending, or not yet known)."""
        with self._lock:
            if lease_id in self._salloc:
                self._ended.add(lease_id)
            for d in devices:
                self._freeing[d] = job_id or self.cli.job_name(lease_id)
        threading.Thread(target=self._cancel_thread, args=(lease_id, job_id, devices), daemon=True,
                         name=f"gpulease-scancel-{lease_id}").start()

    def cancel_job_async(self, job_id: str, devices: list[str]) -> None:
        threading.Thread(target=self._cancel_job, args=(job_id, devices), daemon=True).start()

    def _cancel_thread(self, lease_id: str, job_id: str, devices: list[str]) -> None:
        try:
            if job_id:
                self._cancel_job(job_id, devices)
            else:
                self.cli.run("scancel", f"--name={self.cli.job_name(lease_id)}", *self.cli.mine(), check=False)
        finally:
            self._freed(devices)

    def _cancel_job(self, job_id: str, devices: list[str]) -> None:
        """scancel, then wait (bounded) until Slurm no longer holds the job's GPUs."""
        try:
            p = self.cli.run("scancel", job_id, check=False)
            if p.returncode and "Invalid job id" not in p.stderr and "already completing" not in p.stderr:
                log.error("Slurm job %s: scancel failed: %s", job_id, _slurm_message(p.stderr))
            deadline = time.monotonic() + self.cli.settings.command_timeout + 60  # KillWait and the steps' exit
            while time.monotonic() < deadline:
                q = self.cli.run("squeue", "--noheader", f"--jobs={job_id}", "--states=all", "--format=%T", check=False)
                state = q.stdout.strip()
                if q.returncode or state not in LIVE_STATES:
                    log.debug("Slurm job %s: freed (%s)", job_id, state or "gone")
                    return
                time.sleep(0.01 if state != "COMPLETING" else 0.05)
            log.error("Slurm job %s still holds its GPUs after scancel", job_id)
        except LeaseError as e:
            log.error("Slurm job %s: cancelling failed: %s", job_id, e)
        finally:
            self._freed(devices)

    def _freed(self, devices: list[str]) -> None:
        with self._lock:
            for d in devices:
                self._freeing.pop(d, None)

    def extend(self, lease: Lease, now: float) -> None:
        """A lease's time limit grew: so does its job's (never shrinks)."""
        alloc = self.allocs.get(lease.id)
        if alloc is None or not alloc.job_id:
            return
        minutes = self._time_limit(lease, now)
        if minutes <= alloc.time_limit:
            return
        alloc.time_limit = minutes

        def update() -> None:
            p = self.cli.run("scontrol", "update", f"JobId={alloc.job_id}", f"TimeLimit={minutes}", check=False)
            if p.returncode:
                log.error("Lease %s: Slurm refused to extend job %s to %d min: %s (Slurm ends it at its own limit)",
                          lease.id, alloc.job_id, minutes, _slurm_message(p.stderr))
            else:
                log.info("Lease %s: Slurm job %s time limit now %d min", lease.id, alloc.job_id, minutes)

        threading.Thread(target=update, daemon=True).start()
