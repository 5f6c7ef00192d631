"""JSON views of leases, GPUs and the queue, with what a viewer may see of other users' leases.

The view functions are pure (the lease, the viewer, the time and what the broker knows are passed in);
:class:`Views` gathers what they need from the live state and the parts."""

from __future__ import annotations

from typing import Any

from gpulease_protocol.words import clock_text, gpus_text, hours_text

from ..core.estimate import Span, start_text
from ..core.fractional import held_memory, shared_env
from ..core.gpu import GPU, GpuSample
from ..core.identity import Identity
from ..core.lease import HOLDING, Lease, LeaseState
from ..core.words import ended_text, suspend_asked_text, suspended_text
from ..host.procs import mps_running
from ..inventory import Inventory
from ..policy.lease_policy import LeasePolicy
from .enforcer import Enforcer
from .estimates import Estimates
from .holders import Holders
from .preemption import Preemption
from .quotas import Quotas
from .reservations import Reservations
from .state import LiveState


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


def phase(state: LeaseState) -> str:
    """What the state means for clients: queued, holding, suspended or ended."""
    if state.terminal:
        return "ended"
    if state.holding:
        return "holding"
    return "suspended" if state == LeaseState.SUSPENDED else "queued"


def suspension_view(lease: Lease, now: float) -> dict[str, Any]:
    """``suspend`` (an ask pending on a holding lease), ``suspended`` (a SUSPENDED lease) and ``suspended_seconds``
    (in every suspension, the current one so far), with the broker's words."""
    s = lease.suspension
    asked = suspended = None
    total = lease.suspended_seconds
    if s is not None and lease.state in HOLDING and not s.suspended:
        asked = {"why": s.why, "deadline": s.deadline,
                 "text": suspend_asked_text(s.why, s.by_user, s.deadline, now)}
    elif s is not None and lease.state == LeaseState.SUSPENDED:
        total += max(0.0, now - s.since)
        suspended = {"why": s.why, "since": s.since, "resume": s.resume, "devices": list(s.devices), "model": s.model,
                     "how": s.how,
                     "text": suspended_text(s.why, s.by_user, s.since, s.resume, len(s.devices) or
                                            lease.request.min_gpus, s.model, now)}
    return {"suspend": asked, "suspended": suspended, "suspended_seconds": total}


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
        "phase": phase(lease.state),
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

    def __init__(self, *, state: LiveState, policy: LeasePolicy, inventory: Inventory, enforcer: Enforcer,
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
        out.update(suspension_view(lease, now))
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
            if lease is None or lease.state not in (LeaseState.QUEUED, LeaseState.SUSPENDED):
                continue
            s = lease.suspension if lease.state == LeaseState.SUSPENDED else None  # a resume waiting for GPUs
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
                    "waited_seconds": max(0.0, now - (lease.created_at if s is None else s.since)),
                    "resuming": s is not None,
                    "estimated_start": estimate,
                    "estimated_start_range": list(estimate_range) if estimate_range is not None else None,
                    "estimate_text": estimate_text,
                    "wait": self.waits.view(lease, pos, now, memo),
                }
            )
        return out


NAMED_HOLDERS = 3


class Waits:
    def __init__(self, *, state: LiveState, policy: LeasePolicy, quotas: Quotas, reservations: Reservations,
                 estimates: Estimates) -> None:
        self.state, self.policy, self.quotas = state, policy, quotas
        self.reservations, self.estimates = reservations, estimates

    def reason(self, lease: Lease, position: int | None) -> str:
        """The latest pass's reason; a request no pass has looked at yet waits behind the ones ahead of it (or,
        first in line, for the GPUs to free up)."""
        found = self.state.waiting.get(lease.id)
        if found is not None:
            return found
        return "queue" if position is not None and position > 1 else "gpus_busy"

    def view(self, lease: Lease, position: int | None, now: float, memo: dict[str, str] | None = None
             ) -> dict[str, str]:
        """``{"reason": slug, "text": words}``; ``memo``: words shared by the requests of one queue view."""
        slug = self.reason(lease, position)
        memo = {} if memo is None else memo
        if slug == "gpus_busy":
            if "busy" not in memo:
                memo["busy"] = self.busy_text(lease.user, now)
            text = memo["busy"]
        elif slug == "quota":
            text = self.quota_text(lease)
        elif slug == "budget":
            text = self.budget_text(lease, now)
        elif slug == "reservation":
            text = self.reservation_text(lease, now)
        elif slug == "whole_node":
            text = f"it needs {gpus_text(lease.request.min_gpus)} on one node, and no node has that many free now"
        elif slug == "no_gpu_type":
            req = lease.request
            what = " ".join(x for x in (req.gpu_type, f"with at least {req.gpu_mem / 2**30:g}G of memory"
                                        if req.gpu_mem else "") if x)
            text = f"no GPU {what} is free now"
        elif slug == "priority":
            text = "requests of a higher priority class wait ahead of it"
        elif slug == "fair_share":
            text = "requests of users who used fewer GPU-hours lately wait ahead of it (fair share)"
        else:
            ahead = (position or 1) - 1
            text = (f"{ahead} earlier request{'s' if ahead != 1 else ''} wait{'' if ahead != 1 else 's'} ahead of it"
                    if ahead else "earlier requests wait ahead of it")
        return {"reason": slug, "text": text}

    def busy_text(self, user: str, now: float) -> str:
        """Who holds the GPUs and when each is expected to end, soonest first: 'every GPU it could use is held:
        your 1 GPU expected to end around 14:05, bob's 2 GPUs around 14:20, and 3 more leases'."""
        ends = []
        for lease in self.state.holding():
            likely = self.estimates.lease_end(lease, now)
            end = likely[len(likely) // 2] if likely else (lease.expires_at or now)
            ends.append((end, lease))
        if not ends:
            return "every GPU it could use is held"
        ends.sort(key=lambda e: e[0])
        parts = []
        for i, (end, lease) in enumerate(ends[:NAMED_HOLDERS]):
            whose = "your" if lease.user == user else f"{lease.user}'s"
            parts.append(f"{whose} {gpus_text(lease.gpu_count)} " + ("expected to end around " if i == 0 else "around ")
                         + clock_text(max(end, now), now))
        more = len(ends) - NAMED_HOLDERS
        return "every GPU it could use is held: " + ", ".join(parts) + (
            f", and {more} more lease{'s' if more > 1 else ''}" if more > 0 else "")

    def quota_text(self, lease: Lease) -> str:
        """Which at-once limit binds: the user's own, else a group's."""
        pol, held = self.policy, self.state.table.held_by_user
        need = lease.request.fraction if lease.request.shared else lease.request.min_gpus
        cap = pol.user_cap(lease.user)
        mine = held.get(lease.user, 0.0)
        if cap > 0 and cap - mine + 1e-9 < need:
            return (f"you hold {mine:g} of your {gpus_text(cap)} at once; it starts when enough of your leases end "
                    f"to leave room for {gpus_text(need)}")
        for g in pol.groups_of(lease.user):
            gcap = pol.group_cap(g)
            theirs = sum(n for u, n in held.items() if g in pol.groups_of(u))
            if gcap > 0 and gcap - theirs + 1e-9 < need:
                return f"group {g} holds {theirs:g} of its {gpus_text(gcap)} at once"
        return "a limit of GPUs at once keeps it waiting"

    def budget_text(self, lease: Lease, now: float) -> str:
        """What the request needs of the daily GPU-hours, what is left, and when they start to refill."""
        charged, refills = self.quotas.charged(now)
        need = (lease.request.fraction if lease.request.shared else lease.request.min_gpus) * lease.duration_seconds
        for key, quota in self.policy.day_quotas(lease.user).items():
            left = quota - charged.get(key, 0.0)
            if left + 1e-6 < need:
                whose = f"group {key[1:]}'s" if key.startswith("@") else "your"
                text = (f"it needs {hours_text(need)} and {whose} daily {hours_text(quota)} have "
                        f"{hours_text(left)} left in the last 24 h")
                refill = refills.get(key)
                return text + (f"; they refill from {clock_text(refill, now)}" if refill is not None else "")
        return "the daily GPU-hours keep it waiting"

    def reservation_text(self, lease: Lease, now: float) -> str:
        """The reservation that holds the free GPUs over the request's time (the earliest one, if several)."""
        end = now + lease.duration_seconds
        rs = sorted((r for r in self.reservations.live if r.start < end and r.end > now), key=lambda r: r.start)
        if not rs:
            return "the free GPUs are held for a reservation"
        r = rs[0]
        who = r.user or f"group {r.group}"
        return (f"the free GPUs are reserved for {who} from {clock_text(r.start, now)} to {clock_text(r.end, now)} "
                f"({gpus_text(r.gpus)})")


def ended_facts(lease: Lease) -> dict[str, Any]:
    """What the sentence of an ended lease may say (``core.words.ended_text``'s keywords)."""
    end = lease.ended_at or lease.last_activity
    s = lease.suspension
    since = s.since if s is not None and s.suspended else end
    return {"idle_seconds": max(0.0, end - lease.last_activity),
            "held_seconds": max(0.0, min(end, since) - lease.granted_at) if lease.granted_at is not None else 0.0,
            "silent_seconds": max(0.0, end - lease.last_heartbeat),
            "suspended_seconds": max(0.0, end - since)}
