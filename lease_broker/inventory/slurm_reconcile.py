"""Reconciling the Slurm inventory with Slurm on the event loop: the lease bus's events (allocate, cancel,
extend), allocations found again at start, pending deadlines, and what each refresh saw (nodes lost or
closed, GPUs gone, jobs that Slurm ended, forgot or holds on a limit)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from ..core.errors import LeaseError
from ..core.lease import HOLDING, Lease, LeaseState
from . import GPU
from .slurm_alloc import Allocation, SlurmAllocations
from .slurm_cli import LIVE_STATES, WAIT_REASONS, Node, Snapshot, _id_node, _per_node, _reason

if TYPE_CHECKING:
    from ..manager.manager import LeaseManager

log = logging.getLogger("lease_broker")


class SlurmReconciler(SlurmAllocations):
    """Keeps leases and Slurm in step (a base of SlurmInventory, whose traitlets and state these use)."""

    placement_timeout: float
    _gpus: list[GPU]
    _dirty: bool
    _snapshot: Snapshot | None
    _closed_marks: dict[str, str]

    def _apply_results(self) -> None:
        """The threads' results, then what the last refresh saw (on the event loop)."""
        super()._apply_results()
        if self._manager is not None:
            with self._lock:
                snap, self._snapshot = self._snapshot, None
            if snap is not None:
                self._apply_snapshot(self._manager, snap)

    # ---------------------------------------------------------------- events
    def _on_event(self, event: dict[str, Any]) -> None:
        """Bus listener: allocate when a lease is granted, cancel when a lease ends, extend on renewal."""
        if event.get("type") != "lease" or self._manager is None:
            return
        view = event["lease"]
        try:
            state = LeaseState(view["state"])
            if state == LeaseState.GRANTED and event.get("previous") == LeaseState.QUEUED.value:
                lease = self._manager.leases.get(view["id"])
                if lease is not None:
                    self._allocate(lease)
            elif state.terminal:
                alloc = self._allocs.pop(view["id"], None)
                if alloc is not None:
                    self._cancel(view["id"], alloc.job_id, alloc.devices)
            elif event.get("change") == "renewed":
                lease = self._manager.leases.get(view["id"])
                if lease is not None:
                    self._update_time_limit(lease)
        except Exception:
            log.exception("Lease %s: Slurm placement failed", view["id"])


    # ---------------------------------------------------------------- reconcile
    def _adopt(self, manager: LeaseManager) -> None:
        """At start: find the allocations of holding leases again; cancel those of leases that ended."""
        jobs = self._read_jobs()
        holding = {lid: lease for lid, lease in manager.leases.items() if lease.state in HOLDING}
        for name, job in jobs.items():
            lid = name[len(self.job_prefix) + 1:]
            if lid not in holding and job.state in LIVE_STATES:
                log.info("Slurm job %s (%s) has no live lease: cancelling it", job.id, name)
                self._cancel_job_async(job.id, [])
        for lid, lease in sorted(holding.items()):
            found = jobs.get(self.job_name(lid))
            if found is not None and found.state in ("RUNNING", "CONFIGURING"):
                alloc = Allocation(lid, found.name, found.id, "ready", granted_at=time.monotonic(),
                                   devices=list(lease.devices))
                try:
                    alloc.nodes = self._allocation_nodes(found.id)
                except LeaseError:
                    alloc.nodes = []
                self._allocs[lid] = alloc
                log.info("Lease %s: Slurm job %s found again", lid, found.id)
            elif found is not None and found.state == "PENDING":
                # its salloc died with the old broker: the pending job would be granted to no one
                self._cancel_job_async(found.id, [])
                self._allocate(lease)
            else:
                self._allocate(lease)

    def _check_pending(self, manager: LeaseManager) -> None:
        if not self.placement_timeout:
            return
        now = time.monotonic()
        for alloc in [a for a in self._allocs.values() if a.state == "pending"]:
            if now - alloc.since > self.placement_timeout:
                lease = self._live(alloc.lease_id)
                log.error("Lease %s: Slurm did not grant job %s within %g s (placement_timeout)", alloc.lease_id,
                          alloc.job_id or alloc.name, self.placement_timeout)
                self._allocs.pop(alloc.lease_id, None)
                self._cancel(alloc.lease_id, alloc.job_id, [])
                if lease is not None:
                    manager.end(lease, LeaseState.FAILED,
                                f"placement_timeout: Slurm job {alloc.job_id or alloc.name} still pending after "
                                f"{self.placement_timeout:g} s")

    def _apply_snapshot(self, manager: LeaseManager, snap: Snapshot) -> None:
        """Nodes that went down fail their leases (their GPUs leave); closed nodes take no new leases;
        allocations that Slurm ended or forgot, or that wait on a limit, fail their leases."""
        lost = {n.name: n for n in snap.nodes.values() if n.lost}
        with self._lock:
            dirty, self._dirty = self._dirty, False
            gpus = list(self._gpus)
        for lease in [v for v in manager.leases.values() if v.state in HOLDING]:
            nodes = sorted({_id_node(d) for d in lease.devices if _id_node(d) in lost})
            if nodes:
                why = "; ".join(f"{n}: {lost[n].describe()}" for n in nodes)
                self._end(manager, lease, f"node_lost: {' '.join(nodes)} ({why})")
        if dirty:
            gone = set(manager.gpu_by_id) - {g.id for g in gpus}
            log.info("Slurm inventory changed: %d GPU(s) on %d node(s); gone: %s", len(gpus),
                     len({g.node for g in gpus}), ", ".join(sorted(gone)) or "none")
            manager.set_gpus(gpus)
            for lease in [v for v in manager.leases.values() if v.state in HOLDING]:
                if any(d in gone for d in lease.devices):
                    self._end(manager, lease, "device_gone: no longer in Slurm's partition " + self.partition)
            manager.schedule()
            manager._emit_gpus()
        self._mark_closed(manager, snap.nodes)
        for alloc in list(self._allocs.values()):
            held = self._live(alloc.lease_id)
            job = snap.jobs.get(alloc.name)
            if held is None:
                continue
            if alloc.state == "pending":
                if job is not None and job.state == "PENDING" and job.reason not in WAIT_REASONS:
                    self._allocs.pop(alloc.lease_id, None)
                    self._cancel(alloc.lease_id, job.id, [])
                    said = f": {alloc.said}" if alloc.said else ""
                    self._end(manager, held, f"slurm_refused: job {job.id} pending ({job.reason}){said}; "
                              f"asked for {alloc.time_limit} min on {','.join(_per_node(alloc.devices))}")
                continue
            if alloc.granted_at >= snap.started:
                continue  # granted after this refresh began: not in it yet
            if job is None or job.id != alloc.job_id:
                self._end(manager, held, f"slurm_job_ended: job {alloc.job_id} is no longer known to Slurm")
            elif job.state not in LIVE_STATES or job.state == "COMPLETING":
                why = job.state + (f" ({job.reason})" if job.reason and job.reason != "None" else "")
                if job.state == "NODE_FAIL":
                    nodes = sorted(_per_node(alloc.devices))
                    self._end(manager, held, f"node_lost: {' '.join(nodes)} (Slurm: job {job.id} {why})")
                else:
                    self._end(manager, held, f"slurm_job_ended: job {job.id} {why}")

    def _end(self, manager: LeaseManager, lease: Lease, reason: str) -> None:
        if lease.state in HOLDING:
            log.error("Lease %s: %s", lease.id, reason)
            manager.end(lease, LeaseState.FAILED, _reason(reason))

    def _mark_closed(self, manager: LeaseManager, nodes: dict[str, Node]) -> None:
        """GPUs of drained (or otherwise closed) nodes: unavailable for new leases, like unhealthy ones."""
        marks = {g.id: f"Slurm node {g.node} takes no new jobs ({nodes[g.node].describe()})"
                 for g in manager.gpus if g.node in nodes and nodes[g.node].closed}
        if marks == self._closed_marks:
            return
        unhealthy = manager.enforcer.unhealthy
        for gid in self._closed_marks:
            if gid not in marks and unhealthy.get(gid) == self._closed_marks[gid]:
                del unhealthy[gid]
        for gid, why in marks.items():
            if gid not in unhealthy:
                unhealthy[gid] = why
                log.info("GPU %s unavailable: %s", gid, why)
        self._closed_marks = marks
        manager.schedule()
        manager._emit_gpus()
