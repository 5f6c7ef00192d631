"""Preemption: a priority class allowed to preempt (``LeasePolicy.preempt_grace_seconds``) takes GPUs from
leases of lower classes. The victim is warned (event ``lease.preempting`` with its grace, SIGUSR1 to its
attached processes), may checkpoint during the grace, then is revoked with reason ``preempted``.

Victims are chosen for the first blocked request of a preempting class: on the node where the fewest GPUs
must be taken, lowest class first, youngest lease first. Nothing is taken while an earlier warning is pending
for the same request.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
from typing import TYPE_CHECKING

from ..core.lease import HOLDING, Lease, LeaseState
from ..core.reservation_windows import window_slots
from ..host.procs import signal_group
from . import reservations

if TYPE_CHECKING:
    from .manager import LeaseManager

log = logging.getLogger("lease_broker")
REASON = "preempted"
MAX_TRIED = 8  # preempting requests looked at per pass (each costs a pass over the leases)


@dataclasses.dataclass
class Warning_:
    by_lease: str
    by_class: str
    deadline: float


def choose_victims(m: LeaseManager, p: Lease, marked: set[str]) -> list[Lease] | None:
    """The fewest lower-class leases whose GPUs, with the idle ones, fit ``p``; None if none do."""
    ranks = m.policy.priority_classes
    rank = ranks.get(p.request.priority, 0)
    need = 1 if p.request.shared else p.request.min_gpus
    cap = m.policy.user_cap(p.user)
    if cap > 0 and m.held_by_user().get(p.user, 0.0) + (p.request.fraction if p.request.shared else need) > cap:
        return None  # waiting on its own cap: taking others' GPUs would not help
    held: set[str] = set()
    for lease in m.leases.values():
        if lease.state in HOLDING:
            held.update(lease.devices)
    blocked = set(m.enforcer.draining) | set(m.enforcer.unhealthy)
    if m.reservation_list(now := m.clock.now()):  # GPUs a reservation of others needs before p would end
        end = now + p.duration_seconds
        for gpu_id, ws in window_slots(m.slots(), reservations.windows(m, now), now).items():
            if any(p.user not in w.members and end > w.start for w in ws):
                blocked.add(gpu_id)
    groups: dict[str, list[str]] = {}
    for g in m.gpus:
        groups.setdefault("*" if p.request.locality == "any" else g.node, []).append(g.id)
    cands = sorted(
        (lease for lease in m.leases.values()
         if lease.state in HOLDING and not lease.request.shared and lease.id not in marked
         and ranks.get(lease.request.priority, 0) < rank),
        key=lambda lease: (ranks.get(lease.request.priority, 0), -(lease.granted_at or 0.0), lease.seq),
    )
    best: list[Lease] | None = None
    for ids in groups.values():
        members = set(ids)
        free = len([g for g in ids if g not in held and g not in blocked])
        taken: list[Lease] = []
        for lease in cands:
            if free >= need:
                break
            on = [d for d in lease.devices if d in members and d not in blocked]
            if on:
                taken.append(lease)
                free += len(on)
        if free >= need and (best is None or len(taken) < len(best)):
            best = taken
    return best if best else None


def warn(m: LeaseManager, victim: Lease, by: Lease, grace: float, now: float) -> None:
    deadline = now + grace
    cls = by.request.priority
    m.preempting[victim.id] = Warning_(by.id, cls, deadline)
    m.admin_store.preempting(victim.id, by.id, by.user, cls, now, deadline)
    log.info("Lease %s of %s preempted by class %s (lease %s): grace %g s", victim.id, victim.user, cls, by.id, grace)
    for pid, ticks in m.enforcer.proc_ticks.get(victim.id, {}).items():
        if signal_group(pid, ticks, signal.SIGUSR1):
            log.info("Lease %s: SIGUSR1 to process group of %s (preemption warning)", victim.id, pid)
    m.events.publish("lease.preempting", lease_id=victim.id, user=victim.user, by_class=cls,
                     grace_seconds=grace, deadline=deadline)


def run(m: LeaseManager, now: float) -> None:
    """Revoke victims whose grace is over; warn new victims for blocked preempting requests."""
    grace_of = m.policy.preempt_grace_seconds
    for vid, w in list(m.preempting.items()):
        victim, by = m.leases.get(vid), m.leases.get(w.by_lease)
        if victim is None or victim.state not in HOLDING:
            m.preempting.pop(vid, None)
        elif by is None or by.state != LeaseState.QUEUED:
            m.preempting.pop(vid, None)  # the request was granted elsewhere or cancelled: no need any more
            m.admin_store.drop_preemption(vid)
            m.events.publish("lease.preemption_cancelled", lease_id=vid, user=victim.user)
        elif now >= w.deadline:
            m.preempting.pop(vid, None)
            m.end(victim, LeaseState.REVOKED, REASON)
    if not grace_of:
        return
    waiting_for = {w.by_lease for w in m.preempting.values()}
    tried = 0
    for lid in list(m.order):
        p = m.leases.get(lid)
        if p is None or p.state != LeaseState.QUEUED or p.request.priority not in grace_of or lid in waiting_for:
            continue
        if tried == MAX_TRIED:
            return
        tried += 1
        victims = choose_victims(m, p, set(m.preempting))
        if not victims:
            continue
        grace = float(grace_of[p.request.priority])
        for v in victims:
            warn(m, v, p, grace, now)
        if grace <= 0:
            run(m, now)
        return  # one request at a time: the next pass sees the new state
