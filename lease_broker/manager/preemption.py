"""Preemption: a priority class allowed to preempt (``LeasePolicy.preempt_grace_seconds``) takes GPUs from
leases of lower classes. The victim is warned (event ``lease.preempting`` with its grace, SIGUSR1 to its
attached processes), may checkpoint during the grace, then is revoked with reason ``preempted``.

Victims are chosen for the first blocked request of a preempting class: on the node where the fewest GPUs
must be taken, lowest class first, youngest lease first. Nothing is taken while an earlier warning is pending
for the same request.

Preemption by suspension (``LeasePolicy.preempt_mode = "suspend"``): a blocked request that may suspend others
(``may_suspend``: its class, size and time limit) asks suspendable leases of no higher class to suspend instead
(``LeaseOps.ask_suspend``, why "preempted", ``resume`` set: they queue for GPUs of their model as soon as they are
suspended, before new requests of their class). A victim has held its GPUs ``suspend_min_runtime_seconds`` since
its grant or resume, and has spent at most ``suspend_max_share`` of its life (since its request) suspended (the
starvation bound); among them the set that frees the GPUs it needs (on one node for a node-local gang) suspending the
fewest GPUs (``fewest_gpus``), then the fewest leases, the least suspended time, the youngest. No new asks while
earlier asks for the same request are pending (``asked``); asks whose request was granted elsewhere or left the
queue are withdrawn (``suspend_withdrawn``) before their holders suspend for nothing; a holder that does not report
in time is revoked as without suspension (the enforcer's fallback). Leases that cannot be suspended are taken only
as ``preempt_grace_seconds`` says. With ``suspend_spare_gangs``, no lease holding a GPU of the latest pass's
reservation (``Planning.plan``) of a bigger request that has waited ``suspend_yield_after_seconds`` is asked
(``spared``): the small request would take the freed GPU and the victim's resume would push the gang back. With
``suspend_keep_gpus``, no suspension takes a GPU that a suspended gang keeps (``kept``: ``holds.py``).
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable, Container, Mapping
from typing import Any

from ..core.gpufit import fits
from ..core.lease import HOLDING, RESUMED, WITHDRAWN, Change, Lease, LeaseState, Preempting
from ..core.reservation_windows import window_slots
from ..core.scheduler import Reservation
from ..host.procs import signal_group
from ..policy.lease_policy import LeasePolicy
from .enforcer import Enforcer
from .reservations import Reservations
from .state import LeaseOps, LiveState

log = logging.getLogger("lease_broker")
REASON = "preempted"
MAX_TRIED = 8  # preempting requests looked at per pass (each costs a pass over the leases)


class Preemption:
    """Warnings given to leases that a blocked request of a higher class will take GPUs from."""

    def __init__(self, *, state: LiveState, ops: LeaseOps, policy: LeasePolicy, enforcer: Enforcer,
                 reservations: Reservations, plan: Callable[[], Mapping[str, Reservation]],
                 kept: Callable[[], Mapping[str, str]] = dict) -> None:
        self.state, self.ops, self.policy = state, ops, policy
        self.enforcer, self.reservations = enforcer, reservations
        self.plan = plan  # the latest pass's reservations for blocked requests (``Planning.plan``)
        #: GPUs suspended gangs keep (``Holds.kept``): no suspension frees them (idle ones are lent in their own pass;
        #: their borrowers are not suspended for others)
        self.kept = kept
        #: holding leases with a warning: an index of ``Lease.preempting``, in the order they were warned (a dict: a
        #: set of lease ids would revoke victims whose grace ends in the same tick in the order of their random ids)
        self.warned: dict[str, None] = {}
        #: holding leases asked to suspend for a request, not yet suspended -> that request: an index of
        #: ``Lease.suspension`` (``by_lease``, ``since`` 0)
        self.asked: dict[str, str] = {}
        self._running = False

    def restored(self, leases: list[Lease]) -> None:
        """The index of warned leases after a restart (their warnings are facts of the leases, stored with them)."""
        self.warned = {lease.id: None for lease in leases if lease.preempting is not None and lease.state in HOLDING}
        self.asked = {lease.id: s.by_lease for lease in leases
                      if (s := lease.suspension) is not None and not s.suspended and s.by_lease
                      and lease.state in HOLDING}

    def choose_victims(self, p: Lease, marked: Container[str], now: float) -> list[Lease] | None:
        """The fewest lower-class leases whose GPUs, with the idle ones, fit ``p``; None if none do."""
        ranks = self.policy.priority_classes
        rank = ranks.get(p.request.priority, 0)
        need = 1 if p.request.shared else p.request.min_gpus
        cap = self.policy.user_cap(p.user)
        held_by = self.state.table.held_by_user
        if cap > 0 and held_by.get(p.user, 0.0) + (p.request.fraction if p.request.shared else need) > cap:
            return None  # waiting on its own cap: taking others' GPUs would not help
        held = {d for lease in self.state.holding() for d in lease.devices}
        blocked = self._blocked(p, now)
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

    def _blocked(self, p: Lease, now: float) -> set[str]:
        """GPUs ``p`` cannot get however many leases are taken: draining, unhealthy, or held by a reservation of
        others before ``p`` would end."""
        blocked = set(self.enforcer.draining) | set(self.enforcer.unhealthy)
        if self.reservations.live:
            end = now + p.duration_seconds
            slots = self.enforcer.slot_index(now).all()
            for gpu_id, ws in window_slots(slots, self.reservations.windows(now), now).items():
                if any(p.user not in w.members and end > w.start for w in ws):
                    blocked.add(gpu_id)
        return blocked

    # ------------------------------------------------------------------ preemption by suspension
    def may_suspend(self, p: Lease) -> bool:
        """Whether the queued request ``p`` may suspend others (``preempt_mode`` "suspend"): its class is in
        ``suspend_classes`` ([] = every class), it asks for at most ``suspend_max_gpus`` GPUs (0 = any) and its
        time limit is at most ``suspend_max_duration_seconds`` (0 = any)."""
        pol, req = self.policy, p.request
        if pol.preempt_mode != "suspend":
            return False
        if pol.suspend_classes and req.priority not in pol.suspend_classes:
            return False
        if pol.suspend_max_gpus and (1 if req.shared else req.min_gpus) > pol.suspend_max_gpus:
            return False
        return not (pol.suspend_max_duration_seconds and p.duration_seconds > pol.suspend_max_duration_seconds)

    def suspendable(self, lease: Lease, rank: int, now: float) -> bool:
        """Whether a holding lease may be asked to suspend for a request of class rank ``rank``: its holder can
        suspend it (``request.suspendable``), it is exclusive, of no higher class, not already asked or warned, has
        held its GPUs ``suspend_min_runtime_seconds`` since its grant or resume, and has spent at most
        ``suspend_max_share`` of its life (since its request) suspended."""
        pol = self.policy
        if not lease.request.suspendable or lease.request.shared or lease.suspension is not None:
            return False
        if lease.preempting is not None or pol.priority_classes.get(lease.request.priority, 0) > rank:
            return False
        if now - (lease.granted_at if lease.granted_at is not None else now) < pol.suspend_min_runtime_seconds:
            return False  # (a resume grants it again: granted_at is when it last got GPUs)
        return lease.suspended_seconds <= pol.suspend_max_share * max(0.0, now - lease.created_at)

    def choose_suspended(self, p: Lease, now: float) -> list[Lease] | None:
        """The leases to ask to suspend for ``p``: those that, with the idle GPUs of its type, free the GPUs it needs
        (on one node for a node-local request) suspending the fewest GPUs (``fewest_gpus``: a 1-GPU cell never
        suspends an 8-GPU lease while a 1-GPU lease would do), then the fewest leases, then the least suspended
        time, then the youngest; among the nodes, the one where the fewest GPUs are suspended. None: no such set."""
        ranks = self.policy.priority_classes
        rank = ranks.get(p.request.priority, 0)
        need = 1 if p.request.shared else p.request.min_gpus
        cap = self.policy.user_cap(p.user)
        if cap > 0 and self.state.table.held_by_user.get(p.user, 0.0) + (
                p.request.fraction if p.request.shared else need) > cap:
            return None  # waiting on its own cap: suspending others would not help
        aliases = self.policy.gpu_type_aliases()
        blocked = self._blocked(p, now) | self.spared(need, now) | self.kept().keys()
        usable = {g.id for g in self.state.gpus if g.id not in blocked and not g.mig and fits(g, p.request, aliases)}
        held = {d for lease in self.state.holding() for d in lease.devices}
        groups: dict[str, set[str]] = {}
        for g in self.state.gpus:
            if g.id in usable:
                groups.setdefault("*" if p.request.locality == "any" else g.node, set()).add(g.id)
        cands = sorted((lease for lease in self.state.holding() if self.suspendable(lease, rank, now)
                        and not any(d in blocked for d in lease.devices)),
                       key=lambda lease: (lease.suspended_seconds, -(lease.granted_at or 0.0), -lease.seq))
        suspended = [lease.suspended_seconds for lease in cands]
        best: tuple[int, int, float, int] | None = None
        chosen: list[Lease] | None = None
        for members in groups.values():
            short = need - len(members - held)
            if short <= 0:
                continue  # (enough idle GPUs here: the request waits for something else, e.g. its own queue place)
            sizes = [(i, n) for i, lease in enumerate(cands) if (n := len([d for d in lease.devices if d in members]))]
            found = fewest_gpus(sizes, short, suspended)
            if found is not None:
                key, picked = found
                if best is None or key < best:
                    best, chosen = key, [cands[i] for i in picked]
        return chosen

    def spared(self, need: int, now: float) -> set[str]:
        """The GPUs no suspension for a request of ``need`` GPUs may take (``suspend_spare_gangs``): those of the
        latest pass's reservations (``Planning.plan``) for queued requests of more GPUs that have waited
        ``suspend_yield_after_seconds``."""
        pol = self.policy
        if not pol.suspend_spare_gangs:
            return set()
        leases, out = self.state.leases, set[str]()
        for lid, r in self.plan().items():
            g = leases.get(lid)
            if (g is not None and g.state == LeaseState.QUEUED and not g.request.shared and g.request.min_gpus > need
                    and now - g.created_at >= pol.suspend_yield_after_seconds):
                out.update(r.gpu_ids)
        return out

    def warn(self, victim: Lease, by: Lease, grace: float, now: float) -> None:
        deadline = now + grace
        cls = by.request.priority
        self.ops.commit(victim, Change(preempting=Preempting(by.id, by.user, cls, now, deadline), event="preempting"))
        self.warned[victim.id] = None
        log.info("Lease %s of %s preempted by class %s (lease %s): grace %g s", victim.id, victim.user, cls, by.id,
                 grace)
        for pid, ticks in victim.processes.items():
            if signal_group(pid, ticks, signal.SIGUSR1):
                log.info("Lease %s: SIGUSR1 to process group of %s (preemption warning)", victim.id, pid)
        self.ops.publish("lease.preempting", lease_id=victim.id, user=victim.user, by_class=cls,
                         grace_seconds=grace, deadline=deadline)

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
        for vid in list(self.warned):
            victim = leases.get(vid)
            w = victim.preempting if victim is not None else None
            if victim is None or w is None or victim.state not in HOLDING:
                self.warned.pop(vid, None)
                continue
            by = leases.get(w.by_lease)
            if by is None or by.state != LeaseState.QUEUED:
                self.warned.pop(vid, None)  # the request was granted elsewhere or cancelled: no need any more
                self.ops.commit(victim, Change(preempting=WITHDRAWN, event="preemption_cancelled"))
                self.ops.publish("lease.preemption_cancelled", lease_id=vid, user=victim.user)
            elif now >= w.deadline:
                self.warned.pop(vid, None)
                self.ops.end(victim, LeaseState.REVOKED, REASON)
        self._withdraw(now)
        suspending = self.policy.preempt_mode == "suspend"
        if not grace_of and not suspending:
            return
        waiting_for = {w.by_lease for vid in self.warned if (v := leases.get(vid)) and (w := v.preempting)}
        waiting_for.update(self.asked.values())  # asks pending (a holder reports within suspend_report_seconds)
        tried = 0
        for q in self.state.queue.head(self.policy.queue_depth):
            lid = q.lease_id
            p = leases.get(lid)
            if p is None or p.state != LeaseState.QUEUED or lid in waiting_for:
                continue
            may_suspend = suspending and self.may_suspend(p)
            if not may_suspend and p.request.priority not in grace_of:
                continue
            if tried == MAX_TRIED:
                return
            tried += 1
            asked = self.choose_suspended(p, now) if may_suspend else None
            if asked:
                for v in asked:
                    log.info("Lease %s of %s asked to suspend for lease %s of %s (preemption by suspension)",
                             v.id, v.user, p.id, p.user)
                    if self.ops.ask_suspend(v, REASON, by=p, resume=True):
                        self.asked[v.id] = p.id
                return  # one request at a time: the next pass sees the new state
            if p.request.priority not in grace_of:
                continue
            victims = self.choose_victims(p, self.warned, now)
            if not victims:
                continue
            grace = float(grace_of[p.request.priority])
            for v in victims:
                self.warn(v, p, grace, now)
            if grace <= 0:
                self._run(now)
            return  # one request at a time: the next pass sees the new state

    def asked_for(self, lease_id: str) -> bool:
        """Whether leases were asked to suspend for this request and have not answered (its end asks for a pass:
        the pass withdraws them before their holders suspend for nothing)."""
        return lease_id in self.asked.values()

    def _withdraw(self, now: float) -> None:
        """Withdraw the asks to suspend whose request was granted elsewhere or left the queue (its holder then sees
        no ``suspend`` in its view and its processes go on; the kernel treats a vanished ask as nothing to do); forget
        those that were answered (suspended, or the lease ended or fell back)."""
        leases = self.state.leases
        for vid, by_id in list(self.asked.items()):
            victim = leases.get(vid)
            s = victim.suspension if victim is not None else None
            if victim is None or s is None or s.suspended or s.by_lease != by_id or victim.state not in HOLDING:
                del self.asked[vid]
                continue
            by = leases.get(by_id)
            if by is None or by.state != LeaseState.QUEUED:
                del self.asked[vid]
                log.info("Lease %s of %s: ask to suspend withdrawn (lease %s no longer waits)", vid, victim.user,
                         by_id)
                # (an asked lease meets no idle check, and its holder may be suspending it still: a checkpoint of a
                # whole node's memory takes minutes, and its report may come until the ask's deadline. Its idle time
                # starts then, not now: else an idle or pressure revocation killed the cell whose state was being
                # saved, on the contended month replay with a 30 s pressure timeout, benchmarks/replay.py)
                self.ops.commit(victim, Change(suspension=RESUMED, event="suspend_withdrawn",
                                               last_activity=max(now, s.deadline)))

    def view(self, lease: Lease, admin: bool) -> dict[str, Any]:
        """A lease's preemption for its view: the class that preempts it (and, for admins, by whom)."""
        w = lease.preempting
        if w is not None and lease.state in HOLDING:
            return {"preempting": {"by_class": w.by_class, "deadline": w.deadline}}
        if lease.reason != REASON:
            return {}
        out: dict[str, Any] = {"priority": w.by_class if w else None}
        if w and admin:
            out.update(user=w.by_user, lease_id=w.by_lease)
        return {"preempted_by": out}


def fewest_gpus(sizes: list[tuple[int, int]], short: int, suspended: list[float]) -> tuple[tuple[int, int, float, int],
                                                                                          list[int]] | None:
    """The set of candidates (``sizes``: (index in preference order, GPUs it frees here)) that frees at least
    ``short`` GPUs suspending the fewest GPUs, then the fewest leases, then the least suspended time (``suspended``,
    by index), then the earliest in preference order (the youngest); with its key (GPUs, leases, suspended time, sum
    of indexes). None: all of them together free too few. A 0/1 knapsack over the totals below ``short`` plus the
    largest size (a set at or above that total frees enough without one of its leases, so it is never the fewest):
    O(candidates x (short + largest))."""
    if sum(n for _, n in sizes) < short:
        return None
    top = short + max(n for _, n in sizes)
    Key = tuple[int, float, int]
    reach: list[tuple[Key, tuple[int, ...]] | None] = [None] * top
    reach[0] = ((0, 0.0, 0), ())
    for i, n in sizes:
        for total in range(short - 1, -1, -1):  # (downwards: each candidate at most once)
            at = reach[total]
            if at is None:
                continue
            (count, susp, order), picked = at
            new = ((count + 1, susp + suspended[i], order + i), (*picked, i))
            old = reach[total + n]
            if old is None or new[0] < old[0]:
                reach[total + n] = new
    for total in range(short, top):
        at = reach[total]
        if at is not None:
            return (total, *at[0]), list(at[1])
    return None
