"""Reconciling the Slurm inventory with Slurm on the event loop: allocations found again at start, pending
deadlines, and what each refresh saw (nodes lost or closed, GPUs gone, jobs that Slurm ended, forgot or holds on
a limit). Everything it finds is a change for the lease owner (``changes``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from ..core.errors import LeaseError
from ..core.gpu import GPU
from ..core.lease import HOLDING, Lease
from .changes import GpusChanged, GpusClosed
from .slurm_alloc import Allocation, Changes, SlurmAllocations
from .slurm_cli import LIVE_STATES, WAIT_REASONS, Node, SlurmCommands, Snapshot, _id_node, _per_node

log = logging.getLogger("lease_broker")


class SlurmReconciler:
    def __init__(self, cli: SlurmCommands, allocs: SlurmAllocations, changes: Changes) -> None:
        self.cli, self.allocs, self.changes = cli, allocs, changes
        self.closed_marks: dict[str, str] = {}  # gpu id -> why, as last told to the owner

    def adopt(self, leases: Mapping[str, Lease], now: float) -> None:
        """At start: find the allocations of holding leases again; cancel those of leases that ended."""
        jobs = self.cli.read_jobs()
        holding = {lid: lease for lid, lease in leases.items() if lease.state in HOLDING}
        prefix = len(self.cli.settings.job_prefix) + 1
        for name, job in jobs.items():
            lid = name[prefix:]
            if lid not in holding and job.state in LIVE_STATES:
                log.info("Slurm job %s (%s) has no live lease: cancelling it", job.id, name)
                self.allocs.cancel_job_async(job.id, [])
        for lid, lease in sorted(holding.items()):
            found = jobs.get(self.cli.job_name(lid))
            if found is not None and found.state in ("RUNNING", "CONFIGURING"):
                alloc = Allocation(lid, found.name, found.id, "ready", granted_at=time.monotonic(),
                                   devices=list(lease.devices))
                try:
                    alloc.nodes = self.cli.allocation_nodes(found.id)
                except LeaseError:
                    alloc.nodes = []
                self.allocs.allocs[lid] = alloc
                log.info("Lease %s: Slurm job %s found again", lid, found.id)
            elif found is not None and found.state == "PENDING":
                # its salloc died with the old broker: the pending job would be granted to no one
                self.allocs.cancel_job_async(found.id, [])
                self.allocs.allocate(lease, now)
            else:
                self.allocs.allocate(lease, now)

    def check_pending(self, placement_timeout: float) -> None:
        if not placement_timeout:
            return
        now = time.monotonic()
        for alloc in [a for a in self.allocs.allocs.values() if a.state == "pending"]:
            if now - alloc.since > placement_timeout:
                lease = self.allocs.live(alloc.lease_id)
                log.error("Lease %s: Slurm did not grant job %s within %g s (placement_timeout)", alloc.lease_id,
                          alloc.job_id or alloc.name, placement_timeout)
                self.allocs.allocs.pop(alloc.lease_id, None)
                self.allocs._cancel(alloc.lease_id, alloc.job_id, [])
                if lease is not None:
                    self.changes.fail(lease.id, f"placement_timeout: Slurm job {alloc.job_id or alloc.name} still "
                                      f"pending after {placement_timeout:g} s")

    def apply_snapshot(self, leases: Mapping[str, Lease], snap: Snapshot, known: set[str],
                       gpus: list[GPU] | None) -> None:
        """Nodes that went down fail their leases (their GPUs leave); closed nodes take no new leases;
        allocations that Slurm ended or forgot, or that wait on a limit, fail their leases. ``gpus``: the new
        inventory when discover() saw it change, else None."""
        lost = {n.name: n for n in snap.nodes.values() if n.lost}
        failed: set[str] = set()

        def fail(lease: Lease, reason: str) -> None:
            if lease.id not in failed:
                failed.add(lease.id)
                self.changes.fail(lease.id, reason)

        for lease in [v for v in leases.values() if v.state in HOLDING]:
            nodes = sorted({_id_node(d) for d in lease.devices if _id_node(d) in lost})
            if nodes:
                why = "; ".join(f"{n}: {lost[n].describe()}" for n in nodes)
                fail(lease, f"node_lost: {' '.join(nodes)} ({why})")
        if gpus is not None:
            gone = known - {g.id for g in gpus}
            log.info("Slurm inventory changed: %d GPU(s) on %d node(s); gone: %s", len(gpus),
                     len({g.node for g in gpus}), ", ".join(sorted(gone)) or "none")
            self.changes.items.append(GpusChanged(tuple(gpus)))
            for lease in [v for v in leases.values() if v.state in HOLDING]:
                if any(d in gone for d in lease.devices):
                    fail(lease, "device_gone: no longer in Slurm's partition " + self.cli.partition)
        self.mark_closed(gpus if gpus is not None else [], known, snap.nodes)
        for alloc in list(self.allocs.allocs.values()):
            held = self.allocs.live(alloc.lease_id)
            job = snap.jobs.get(alloc.name)
            if held is None or held.id in failed:
                continue
            if alloc.state == "pending":
                if job is not None and job.state == "PENDING" and job.reason not in WAIT_REASONS:
                    self.allocs.allocs.pop(alloc.lease_id, None)
                    self.allocs._cancel(alloc.lease_id, job.id, [])
                    said = f": {alloc.said}" if alloc.said else ""
                    fail(held, f"slurm_refused: job {job.id} pending ({job.reason}){said}; "
                         f"asked for {alloc.time_limit} min on {','.join(_per_node(alloc.devices))}")
                continue
            if alloc.granted_at >= snap.started:
                continue  # granted after this refresh began: not in it yet
            if job is None or job.id != alloc.job_id:
                fail(held, f"slurm_job_ended: job {alloc.job_id} is no longer known to Slurm")
            elif job.state not in LIVE_STATES or job.state == "COMPLETING":
                why = job.state + (f" ({job.reason})" if job.reason and job.reason != "None" else "")
                if job.state == "NODE_FAIL":
                    nodes = sorted(_per_node(alloc.devices))
                    fail(held, f"node_lost: {' '.join(nodes)} (Slurm: job {job.id} {why})")
                else:
                    fail(held, f"slurm_job_ended: job {job.id} {why}")

    def mark_closed(self, gpus: list[GPU], known: set[str], nodes: dict[str, Node]) -> None:
        """GPUs of drained (or otherwise closed) nodes: unavailable for new leases, like unhealthy ones."""
        marks = {gid: f"Slurm node {node} takes no new jobs ({nodes[node].describe()})"
                 for gid in ({g.id for g in gpus} or known)
                 if (node := _id_node(gid)) in nodes and nodes[node].closed}
        if marks != self.closed_marks:
            self.closed_marks = marks
            self.changes.items.append(GpusClosed(marks))
