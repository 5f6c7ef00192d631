"""JSON views of leases and GPUs, with what a caller may see of other users' leases."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from ..core.clock import Clock
from ..core.fractional import shared_env
from ..core.identity import Identity
from ..core.lease import HOLDING, Lease, LeaseState
from ..inventory import GPU, GpuSample, Inventory

if TYPE_CHECKING:
    from ..core.gputable import GpuTable
    from .enforcer import Enforcer
    from .events import EventBus

#: The GPU summary (one entry per GPU) is published at most this often: at once after a quiet spell, then
#: on the trailing edge. A busy broker would otherwise rebuild it twice per grant and release.
GPU_EVENT_INTERVAL = 0.1


def may_see(lease: Lease, who: Identity) -> bool:
    return who.admin or lease.user == who.user


def lease_view(
    lease: Lease,
    gpus: dict[str, GPU],
    *,
    simulated: bool,
    visible_devices: str = "",
    position: int | None = None,
    estimate: float | None = None,
    idle_deadline: float | None = None,
    placement: dict[str, Any] | None = None,
    mps: bool = False,
) -> dict[str, Any]:
    req = lease.request
    devices = [
        {"id": g.id, "index": g.index, "node": g.node, "name": g.name}
        for g in (gpus.get(d) for d in lease.devices)
        if g is not None
    ]
    out: dict[str, Any] = {
        "id": lease.id,
        "user": lease.user,
        "state": lease.state.value,
        "reason": lease.reason,
        "created_at": lease.created_at,
        "granted_at": lease.granted_at,
        "expires_at": lease.expires_at,
        "ended_at": lease.ended_at,
        "devices": devices,
        "node": lease.node,
        "min_gpus": req.min_gpus,
        "max_gpus": req.max_gpus,
        "fraction": req.fraction,
        "mem_bytes": req.mem_bytes,
        "priority": req.priority,
        "locality": req.locality,
        "labels": dict(req.labels),
        "duration_seconds": lease.duration_seconds,
        "idle_timeout_seconds": lease.idle_timeout_seconds,
        "last_activity": lease.last_activity,
        "idle_deadline": idle_deadline,
        "pids": list(lease.pids),
        "simulated": simulated,
        "position": position,
        "estimated_start": estimate,
        "env": {"CUDA_VISIBLE_DEVICES": visible_devices} if lease.devices else {},
        "placement": placement,
    }
    if req.shared and lease.devices:
        gpu = gpus.get(lease.devices[0])
        out["env"].update(shared_env(req, gpu.memory_total if gpu else 0, mps))
    return out


def gpu_view(
    gpu: GPU,
    state: str,
    sample: GpuSample | None,
    holders: list[Lease],
    who: Identity,
) -> dict[str, Any]:
    return {
        "id": gpu.id,
        "index": gpu.index,
        "node": gpu.node,
        "name": gpu.name,
        "memory_total": gpu.memory_total,
        "memory_used": sample.memory_used if sample else 0,
        "utilization": sample.utilization if sample else 0.0,
        "link_group": gpu.link_group,
        "simulated": gpu.simulated,
        "mig": gpu.mig,
        "state": state,
        "holders": [
            {
                "user": h.user,
                "lease_id": h.id if may_see(h, who) else None,
                "fraction": h.request.fraction if h.request.shared else 1.0,
                "expires_at": h.expires_at,
                "mine": h.user == who.user,
            }
            for h in holders
        ],
    }


class ManagerViews:
    """The JSON views the API serves, computed from a LeaseManager's state (mixed into it)."""

    leases: dict[str, Lease]
    gpus: list[GPU]
    gpu_by_id: dict[str, GPU]
    samples: dict[str, GpuSample]
    planned: dict[str, float]
    order: list[str]
    inventory: Inventory
    clock: Clock
    enforcer: "Enforcer"
    events: "EventBus"
    table: "GpuTable"
    _gpus_dirty: bool
    _gpus_sent: float

    def _emit_gpus(self) -> None:
        """Publish the GPU summary: at once, or at most every GPU_EVENT_INTERVAL (the latest state wins)."""
        if self._gpus_dirty:
            return  # already scheduled: it will carry this change too
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (tests with a virtual clock): at once
            self._flush_gpus()
            return
        self._gpus_dirty = True
        loop.call_later(max(0.0, self._gpus_sent + GPU_EVENT_INTERVAL - time.monotonic()), self._flush_gpus)

    def _flush_gpus(self) -> None:
        self._gpus_dirty, self._gpus_sent = False, time.monotonic()
        self.events.publish("gpus", summary=self.summary())

    def view(self, lease: Lease) -> dict[str, Any]:
        position = estimate = idle_deadline = None
        if lease.state == LeaseState.QUEUED:
            try:
                position = self.order.index(lease.id) + 1
            except ValueError:
                position = None
            estimate = self.planned.get(lease.id)
        elif lease.state in HOLDING and lease.idle_timeout_seconds:
            idle_deadline = lease.last_activity + lease.idle_timeout_seconds
        devices = [self.gpu_by_id[d] for d in lease.devices if d in self.gpu_by_id]
        return lease_view(
            lease,
            self.gpu_by_id,
            simulated=self.inventory.simulated,
            visible_devices=self.inventory.visible_devices(devices) if devices else "",
            position=position,
            estimate=estimate,
            idle_deadline=idle_deadline,
            placement=self.inventory.placement(lease),
            mps=lease.request.shared and self.mps_enabled(),
        )

    def mps_enabled(self) -> bool:
        """Whether shared leases get CUDA MPS limits (the policy says so, or 'auto' and MPS runs)."""
        return False

    def gpu_states(self) -> dict[str, tuple[str, list[Lease]]]:
        out: dict[str, tuple[str, list[Lease]]] = {}
        holders = self.table.holders
        for g in self.gpus:
            hs = sorted(holders.get(g.id, {}).values(), key=lambda lease: lease.seq)
            if g.id in self.enforcer.unhealthy:
                state = "unhealthy"
            elif hs:
                state = "shared" if any(h.request.shared for h in hs) else "leased"
            elif g.id in self.enforcer.draining:
                state = "draining"
            else:
                state = "free"
            out[g.id] = (state, hs)
        return out

    def gpu_views(self, who: Identity) -> list[dict[str, Any]]:
        states = self.gpu_states()
        views = [gpu_view(g, states[g.id][0], self.samples.get(g.id), states[g.id][1], who) for g in self.gpus]
        for v in views:
            v["unleased_processes"] = self.enforcer.watch.view(v["id"], who)
        return views

    def summary(self) -> dict[str, Any]:
        """GPU counts by state (as gpu_states() says), from the GPU table: it runs often."""
        counts = self.table.counts(self.enforcer.draining, self.enforcer.unhealthy)
        return {
            "total": len(self.gpus),
            "free": counts.get("free", 0),
            "states": counts,
            "queued": len(self.table.queued),
            "simulated": self.inventory.simulated,
        }

    def queue_views(self, who: Identity) -> list[dict[str, Any]]:
        now = self.clock.now()
        out = []
        for pos, lease_id in enumerate(self.order, 1):
            lease = self.leases.get(lease_id)
            if lease is None or lease.state != LeaseState.QUEUED:
                continue
            mine = may_see(lease, who)
            out.append(
                {
                    "position": pos,
                    "lease_id": lease.id if mine else None,
                    "user": lease.user,
                    "mine": lease.user == who.user,
                    "min_gpus": lease.request.min_gpus,
                    "max_gpus": lease.request.max_gpus,
                    "fraction": lease.request.fraction,
                    "priority": lease.request.priority,
                    "waited_seconds": max(0.0, now - lease.created_at),
                    "estimated_start": self.planned.get(lease.id),
                }
            )
        return out

