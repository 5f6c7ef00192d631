"""JSON views of leases, GPUs and the queue, with what a viewer may see of other users' leases.

The view functions are pure (the lease, the viewer, the time and what the broker knows are passed in);
:class:`Views` gathers what they need from the live state and the parts."""

from __future__ import annotations

from typing import Any

from ..core.estimate import Span, start_text
from ..core.fractional import held_memory, shared_env
from ..core.gpu import GPU, GpuSample
from ..core.identity import Identity
from ..core.lease import HOLDING, Lease, LeaseState
from ..core.words import ended_text
from ..host.procs import mps_running
from ..inventory import Inventory
from ..policy.lease_policy import LeasePolicy
from .enforcer import Enforcer
from .estimates import Estimates
from .holders import Holders
from .preemption import Preemption
from .reservations import Reservations
from .state import LiveState
from .waits import Waits, ended_facts


def may_see(lease: Lease, who: Identity) -> bool:
    return who.admin or lease.user == who.user


#: A holder without a watched process is *silent* after this many seconds without a heartbeat: two of the 10 s
#: beats a kernel sends (``jupyter_gpulease.kernel.acquire.Heartbeater``) missed. The broker knows only its
#: ``heartbeat_timeout``, so a shorter timeout bounds it.
SILENT_AFTER = 20.0


def holder_view(lease: Lease, watched: bool, alive: bool, now: float, heartbeat_timeout: float) -> dict[str, Any]:
    """Who holds the lease, in words: its holder process (``ends_with_caller``), whether the broker watches it and
    whether it runs; for a lease without one, whether its heartbeats come (only a holding lease is expected to beat;
    CLI leases do not)."""
    if lease.holder is not None:
        pid = lease.holder[0]
        text = f"process {pid}" if alive else f"process {pid} is gone"
        return {"pid": pid, "watched": watched, "alive": alive, "text": text}
    silent_for = now - lease.last_heartbeat
    if not lease.request.heartbeat or lease.state not in HOLDING:
        return {"pid": None, "watched": False, "alive": True, "text": ""}
    silent_after = min(SILENT_AFTER, heartbeat_timeout) if heartbeat_timeout else SILENT_AFTER
    if silent_for <= silent_after:
        return {"pid": None, "watched": False, "alive": True, "text": f"heartbeat {max(0.0, silent_for):.0f} s ago"}
    text = f"no heartbeat for {silent_for:.0f} s" + (f" (revoked at {heartbeat_timeout:g} s)" if heartbeat_timeout
                                                     else "")
    return {"pid": None, "watched": False, "alive": False, "text": text}


def idle_countdown(lease: Lease, timeout: float, now: float, idle_mark: float) -> float | None:
    """When a holding lease would be revoked for idleness (``idle_deadline``), or None while it is busy: active,
    with activity (a running cell's heartbeats) within ``idle_mark`` seconds or half its timeout, whichever is less,
    so no countdown runs toward a revocation that its next beat would put off. The enforcer revokes a lease only once
    it has been without activity for its timeout, so the countdown shows for at least the last half of it (a session
    with a 3 s idle timeout is warned in its last 1.5 s: a kernel beats at a quarter of the timeout while a cell
    runs)."""
    if lease.state == LeaseState.ACTIVE and now - lease.last_activity < min(idle_mark, timeout / 2):
        return None
    return lease.last_activity + timeout


def lease_view(
    lease: Lease,
    gpus: dict[str, GPU],
    *,
    simulated: bool,
    visible_devices: str = "",
    position: int | None = None,
    estimate: float | None = None,
    estimate_range: tuple[float, float] | None = None,
    estimate_text: str | None = None,
    idle_deadline: float | None = None,
    max_expires_at: float | None = None,
    placement: dict[str, Any] | None = None,
    mps: bool = False,
) -> dict[str, Any]:
    req = lease.request
    devices = [
        {"id": g.id, "index": g.index, "node": g.node, "name": g.name, "memory_total": g.memory_total, "mig": g.mig}
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
        "gpu_type": req.gpu_type,
        "gpu_mem": req.gpu_mem,
        "priority": req.priority,
        "locality": req.locality,
        "labels": dict(req.labels),
        "duration_seconds": lease.duration_seconds,
        "idle_timeout_seconds": lease.idle_timeout_seconds,
        "last_activity": lease.last_activity,
        "idle_deadline": idle_deadline,
        "max_expires_at": max_expires_at,
        "pids": list(lease.pids),
        "simulated": simulated,
        "position": position,
        "estimated_start": estimate,
        "estimated_start_range": list(estimate_range) if estimate_range is not None else None,
        "estimate_text": estimate_text,
        "env": {"CUDA_VISIBLE_DEVICES": visible_devices} if lease.devices else {},
        "placement": placement,
        "usage": lease.use.view(held_memory(lease, gpus)) if lease.granted_at is not None else None,
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
        "parent": gpu.parent or None,
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


class Views:
    """The JSON views the API serves and the events carry. ``viewer`` None: the owner's view (events)."""

    def __init__(self, state: LiveState, policy: LeasePolicy, inventory: Inventory, enforcer: Enforcer,
                 reservations: Reservations, preemption: Preemption, estimates: Estimates, holders: Holders,
                 waits: Waits) -> None:
        self.state, self.policy, self.inventory, self.enforcer = state, policy, inventory, enforcer
        self.reservations, self.preemption, self.estimates, self.holders = reservations, preemption, estimates, holders
        self.waits = waits

    def lease(self, lease: Lease, viewer: Identity | None, now: float) -> dict[str, Any]:
        state = self.state
        position = estimate = estimate_range = estimate_text = idle_deadline = max_expires_at = None
        if lease.state == LeaseState.QUEUED:
            position = state.queue.position(lease.id)
            # the range when someone asks (events carry the pass's plan: a request's event must stay cheap)
            span = self.estimates.start(lease, now) if viewer is not None else None
            estimate, estimate_range, estimate_text = self.start(lease.id, span, now)
            if viewer is None:  # no words from the plan where a view or the queue would say others: one estimate
                estimate_text = None
        elif lease.state in HOLDING:
            if lease.idle_timeout_seconds:
                idle_deadline = idle_countdown(lease, self.enforcer.idle_timeout(lease)[0], now,
                                               float(self.policy.idle_mark_seconds))
            if lease.granted_at is not None:  # renewals stop here (Quotas.check_renewal): the sidebar's Extend choices
                max_expires_at = lease.granted_at + float(self.policy.limit(lease.user, "max_duration_seconds"))
        devices = [state.gpu_by_id[d] for d in lease.devices if d in state.gpu_by_id]
        out = lease_view(
            lease,
            state.gpu_by_id,
            simulated=self.inventory.simulated,
            visible_devices=self.inventory.visible_devices(devices) if devices else "",
            position=position,
            estimate=estimate,
            estimate_range=estimate_range,
            estimate_text=estimate_text,
            idle_deadline=idle_deadline,
            max_expires_at=max_expires_at,
            placement=self.inventory.placement(lease),
            mps=lease.request.shared and self.mps_enabled(),
        )
        out.update(self.preemption.view(lease, admin=viewer is not None and viewer.admin))
        watched, alive = self.holders.view(lease)
        out["holder"] = holder_view(lease, watched, alive, now, float(self.policy.heartbeat_timeout))
        # why it waits (the latest pass's reason, in words), and why it ended as a sentence (the slug stays in reason)
        # (not in events, like the estimate's words: a request's event must stay cheap, and the words name every
        # holder, O(holding leases): 13 ms a grant with 1,000 leases held, BENCHMARKS.md's broker section)
        out["wait"] = (self.waits.view(lease, position, now) if lease.state == LeaseState.QUEUED and viewer is not None
                       else None)
        out["reason_text"] = (ended_text(lease.state.value, lease.reason, **ended_facts(lease))
                              if lease.state.terminal else None)
        return out

    def start(self, lease_id: str, span: Span | None,
              now: float) -> tuple[float | None, tuple[float, float] | None, str]:
        """A queued lease's ``estimated_start``, ``estimated_start_range`` and ``estimate_text``: the likely start,
        the range shown (``Estimates``) and its words (``core.estimate.start_text``, the one text every client
        shows); without a range (deep in the queue), the scheduler's plan from the holders' time limits."""
        if span is None:
            planned = self.state.planned.get(lease_id)
            return planned, None, start_text(None, planned, now)
        return span.likely, (span.low, span.high), start_text(span, None, now)

    def mps_enabled(self) -> bool:
        """Whether shared leases get CUDA MPS limits (the policy says so, or 'auto' and MPS runs)."""
        mode = self.policy.shared_mps
        return mode == "on" or (mode == "auto" and mps_running())

    def gpu_states(self, now: float) -> dict[str, tuple[str, list[Lease]]]:
        out: dict[str, tuple[str, list[Lease]]] = {}
        holders = self.state.table.holders
        enf = self.enforcer
        reserved = self.reservations.reserved_now(now) if self.reservations.live else {}
        for g in self.state.gpus:
            hs = sorted(holders.get(g.id, {}).values(), key=lambda lease: lease.seq)
            if g.id in enf.unhealthy:
                state = "unhealthy"
            elif hs:
                state = "shared" if any(h.request.shared for h in hs) else "leased"
            elif g.id in enf.draining:
                state = "draining"
            else:
                state = "reserved" if g.id in reserved else "free"
            out[g.id] = (state, hs)
        return out

    def gpus(self, viewer: Identity, now: float) -> list[dict[str, Any]]:
        """GPU views; a reserved GPU says for whom (``reservation``: id, user or group, end)."""
        states = self.gpu_states(now)
        samples = self.state.samples
        views = [gpu_view(g, states[g.id][0], samples.get(g.id), states[g.id][1], viewer) for g in self.state.gpus]
        reserved = self.reservations.reserved_now(now) if self.reservations.live else {}
        by_id = {r.id: r for r in self.reservations.live}
        for v in views:
            v["unleased_processes"] = self.enforcer.watch.view(v["id"], viewer)
            r = by_id.get(reserved.get(v["id"], ""))
            if r is not None:
                v["reservation"] = {"id": r.id, "user": r.user, "group": r.group, "end": r.end}
        return views

    def summary(self, now: float) -> dict[str, Any]:
        """GPU counts by state (as gpu_states() says), from the GPU table: it runs often."""
        state, enf = self.state, self.enforcer
        counts = state.table.counts(enf.draining, enf.unhealthy)
        n = sum(1 for st, _ in self.gpu_states(now).values() if st == "reserved") if self.reservations.live else 0
        if n:
            counts["free"] = counts.get("free", 0) - n
            counts["reserved"] = n
        return {
            "total": len(state.gpus),
            "free": counts.get("free", 0),
            "states": counts,
            "queued": len(state.table.queued),
            "simulated": self.inventory.simulated,
        }

    def queue(self, viewer: Identity, now: float) -> list[dict[str, Any]]:
        out = []
        leases = self.state.leases
        starts = self.estimates.queue(now)  # the head's, from one walk
        memo: dict[str, str] = {}  # the words every request waiting for busy GPUs shares
        for pos, p in enumerate(self.state.queue, 1):
            lease = leases.get(p.lease_id)
            if lease is None or lease.state != LeaseState.QUEUED:
                continue
            mine = may_see(lease, viewer)
            estimate, estimate_range, estimate_text = self.start(lease.id, starts.get(lease.id), now)
            out.append(
                {
                    "position": pos,
                    "lease_id": lease.id if mine else None,
                    "user": lease.user,
                    "mine": lease.user == viewer.user,
                    "min_gpus": lease.request.min_gpus,
                    "max_gpus": lease.request.max_gpus,
                    "fraction": lease.request.fraction,
                    "gpu_type": lease.request.gpu_type,
                    "gpu_mem": lease.request.gpu_mem,
                    "priority": lease.request.priority,
                    "waited_seconds": max(0.0, now - lease.created_at),
                    "estimated_start": estimate,
                    "estimated_start_range": list(estimate_range) if estimate_range is not None else None,
                    "estimate_text": estimate_text,
                    "wait": self.waits.view(lease, pos, now, memo),
                }
            )
        return out
