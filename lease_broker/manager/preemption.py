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
from typing import Any

from ..core.lease import HOLDING, Lease, LeaseState
from ..core.reservation_windows import window_slots
from ..host.procs import signal_group
from ..policy.lease_policy import LeasePolicy
from ..store.admin_store import AdminStore
from .enforcer import Enforcer
from .events import EventBus
from .ports import LeaseOps
from .reservations import Reservations
from .state import LiveState

log = logging.getLogger("lease_broker")
REASON = "preempted"
MAX_TRIED = 8  # preempting requests looked at per pass (each costs a pass over the leases)


@dataclasses.dataclass
class Warning_:
    by_lease: str
    by_class: str
    deadline: float


class Preemption:
    """Warnings given to leases that a blocked request of a higher class will take GPUs from."""

    def __init__(self, state: LiveState, ops: LeaseOps, policy: LeasePolicy, store: AdminStore, events: EventBus,
                 enforcer: Enforcer, reservations: Reservations) -> None:
        self.state, self.ops, self.policy, self.store, self.events = state, ops, policy, store, events
        self.enforcer, self.reservations = enforcer, reservations
        self.warnings: dict[str, Warning_] = {}  # victim lease id -> its warning
        self._running = False

    def choose_victims(self, p: Lease, marked: set[str], now: float) -> list[Lease] | None:
        """The fewest lower-class leases whose GPUs, with the idle ones, fit ``p``; None if none do."""
        ranks = self.policy.priority_classes
        rank = ranks.get(p.request.priority, 0)
        need = 1 if p.request.shared else p.request.min_gpus
        cap = self.policy.user_cap(p.user)
        held_by = self.state.table.held_by_user
        if cap > 0 and held_by.get(p.user, 0.0) + (p.request.fraction if p.request.shared else need) > cap:
            return None  # waiting on its own cap: taking others' GPUs would not help
        held = {d for lease in self.state.holding() for d in lease.devices}
        blocked = set(self.enforcer.draining) | set(self.enforcer.unhealthy)
        if self.reservations.live:  # GPUs a reservation of others needs before p would end
            end = now + p.duration_seconds
            slots = self.enforcer.slot_index(now).all()
            for gpu_id, ws in window_slots(slots, self.reservations.windows(now), now).items():
                if any(p.user not in w.members and end > w.start for w in ws):
                    blocked.add(gpu_id)
        groups: dict[str, list[str]] = {}
        for g in self.state.gpus:
            groups.setdefault("*" if p.request.locality == "any" else g.node, []).append(g.id)
        cands = sorted(
            (lease for lease in self.state.holding()
             if not lease.request.shared and lease.id not in marked and ranks.get(lease.request.priority, 0) < rank),
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

    def warn(self, victim: Lease, by: Lease, grace: float, now: float) -> None:
        deadline = now + grace
        cls = by.request.priority
        self.warnings[victim.id] = Warning_(by.id, cls, deadline)
        self.store.preempting(victim.id, by.id, by.user, cls, now, deadline)
        log.info("Lease %s of %s preempted by class %s (lease %s): grace %g s", victim.id, victim.user, cls, by.id,
                 grace)
        for pid, ticks in self.enforcer.proc_ticks.get(victim.id, {}).items():
            if signal_group(pid, ticks, signal.SIGUSR1):
                log.info("Lease %s: SIGUSR1 to process group of %s (preemption warning)", victim.id, pid)
        self.events.publish("lease.preempting", lease_id=victim.id, user=victim.user, by_class=cls,
                            grace_seconds=grace, deadline=deadline)

    def retime(self, step: float) -> None:
        """The wall clock stepped ``step`` seconds: each warned lease keeps the rest of its grace."""
        for w in self.warnings.values():
            w.deadline += step

    def run(self, now: float) -> None:
        """After a pass: revoke victims whose grace is over; warn new victims for blocked preempting requests.
        Not re-entered from the passes its own revocations cause."""
        if self._running:
            return
        self._running = True
        try:
            self._run(now)
        finally:
            self._running = False

    def _run(self, now: float) -> None:
        leases = self.state.leases
        grace_of = self.policy.preempt_grace_seconds
        for vid, w in list(self.warnings.items()):
            victim, by = leases.get(vid), leases.get(w.by_lease)
            if victim is None or victim.state not in HOLDING:
                self.warnings.pop(vid, None)
            elif by is None or by.state != LeaseState.QUEUED:
                self.warnings.pop(vid, None)  # the request was granted elsewhere or cancelled: no need any more
                self.store.drop_preemption(vid)
                self.events.publish("lease.preemption_cancelled", lease_id=vid, user=victim.user)
            elif now >= w.deadline:
                self.warnings.pop(vid, None)
                self.ops.end(victim, LeaseState.REVOKED, REASON)
        if not grace_of:
            return
        waiting_for = {w.by_lease for w in self.warnings.values()}
        tried = 0
        for q in self.state.queue.head(self.policy.queue_depth):
            lid = q.lease_id
            p = leases.get(lid)
            if p is None or p.state != LeaseState.QUEUED or p.request.priority not in grace_of or lid in waiting_for:
                continue
            if tried == MAX_TRIED:
                return
            tried += 1
            victims = self.choose_victims(p, set(self.warnings), now)
            if not victims:
                continue
            grace = float(grace_of[p.request.priority])
            for v in victims:
                self.warn(v, p, grace, now)
            if grace <= 0:
                self._run(now)
            return  # one request at a time: the next pass sees the new state

    def view(self, lease: Lease, admin: bool) -> dict[str, Any]:
        """A lease's preemption for its view: the class that preempts it (and, for admins, by whom)."""
        w = self.warnings.get(lease.id)
        if w is not None:
            return {"preempting": {"by_class": w.by_class, "deadline": w.deadline}}
        if lease.reason != REASON:
            return {}
        info = self.store.preemption(lease.id)
        out: dict[str, Any] = {"priority": info["by_class"] if info else None}
        if info and admin:
            out.update(user=info["by_user"], lease_id=info["by_lease"])
        return {"preempted_by": out}
