"""Kept GPUs (``LeasePolicy.suspend_keep_gpus``): a gang suspended by preemption for a request keeps its GPUs (a
node, for a whole-node gang). They are lent only to the request it was suspended for ('asker'), or also to other
requests that may suspend others ('small': ``Preemption.may_suspend``); nobody else is granted or planned on them;
the gang resumes on them, before anyone else, as soon as they are free again. With ``suspend_keep_max_seconds`` it
takes them back that long after its suspension: its borrowers are asked to suspend (``run``), and resume when GPUs
of their model are free, like any lease suspended by preemption; without, a borrower starts only if its time limit
ends before the gang could resume.

Without it a gang suspended for one small cell waits for a whole node to come free in the queue, often days on a
crowded cluster; with it its loss is the small cells' time on its GPUs (docs/admin-guide.md, "Preemption by
suspension", with the figures).

How: each pass (``LeaseManager.schedule``) first runs the scheduler once per keeping gang (``passes``) on its GPUs
alone (the rest unavailable), then the main pass with the kept GPUs unavailable (``hide``) and without the keeping
gangs' resumes (``others``). In a gang's own pass: with a deadline, its borrowers in queue order (the asker first),
then its resume, which starts only when none of them took a GPU; past the deadline, its resume alone; without a
deadline its resume first, planned from when its borrowers' limits end, so that backfill lets a borrower in only if
it ends by then: the scheduler's own rules, none of the pass's. Everything is derived from the suspended leases
(their ``suspension``): nothing more to store or restore after a restart.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from ..core.lease import Lease, LeaseState
from ..core.pass_types import Pending
from ..core.slots import SlotIndex
from ..policy.lease_policy import LeasePolicy
from .state import LeaseOps, LiveState

INF = float("inf")


def keeps(lease: Lease, policy: LeasePolicy) -> bool:
    """Whether a lease keeps its GPUs: a gang (more GPUs than a request that may suspend others asks for, and more
    than one) suspended by preemption for a request (``suspend_keep_gpus`` not 'off').
    """
    s = lease.suspension
    return (policy.preempt_mode == "suspend" and policy.suspend_keep_gpus != "off"
            and lease.state == LeaseState.SUSPENDED and s is not None and s.suspended and s.why == "preempted"
            and bool(s.by_lease) and len(s.devices) >= max(2, policy.suspend_keep_min_gpus, policy.suspend_max_gpus + 1))


class Holds:
    def __init__(self, *, state: LiveState, ops: LeaseOps, policy: LeasePolicy,
                 may_suspend: Callable[[Lease], bool]) -> None:
        self.state, self.ops, self.policy, self.may_suspend = state, ops, policy, may_suspend

    def keepers(self) -> list[Lease]:
        """The suspended leases that keep their GPUs, oldest suspension first (a GPU is kept by one lease only)."""
        if self.policy.suspend_keep_gpus == "off" or not self.state.suspended:
            return []
        found = sorted((lease for lease in self.state.suspended.values() if keeps(lease, self.policy)),
                       key=lambda lease: (lease.suspension.since if lease.suspension else 0.0, lease.seq))
        out, seen = [], set[str]()
        for lease in found:
            devices = lease.suspension.devices if lease.suspension is not None else ()
            if not seen.intersection(devices):
                out.append(lease)
                seen.update(devices)
        return out

    def kept(self) -> dict[str, str]:
        """Kept GPU id -> the lease that keeps it."""
        return {gid: lease.id for lease in self.keepers()
                for gid in (lease.suspension.devices if lease.suspension is not None else ())}

    def deadline(self, lease: Lease) -> float:
        """When a keeping lease takes its GPUs back from its borrowers (``suspend_keep_max_seconds`` after its
        suspension; INF: when they end)."""
        limit = self.policy.suspend_keep_max_seconds
        return lease.suspension.since + limit if limit and lease.suspension is not None else INF

    def passes(self, ix: Callable[[], SlotIndex], now: float) -> Iterator[tuple[list[Pending], SlotIndex]]:
        """Per keeping lease: the requests that may use its GPUs and the slots of a pass (``ix()``: the pass's slot
        index, asked afresh as earlier grants change it) where only its GPUs are available. Without a deadline its
        own resume goes first (planned from when its borrowers end, so a borrower starts only if it ends by then);
        with one, its borrowers go first until the deadline (it resumes when none wants its GPUs), then it alone."""
        q, leases, pol = self.state.queue, self.state.leases, self.policy
        for keeper in self.keepers():
            s = keeper.suspension
            if keeper.state != LeaseState.SUSPENDED or s is None:
                continue  # (resumed by an earlier pass of this round)
            mine = set(s.devices)
            slots = ix()
            if not any(slots.by_id[g].idle for g in mine if g in slots.by_id):
                continue  # nothing of it is free: nobody can start on it
            own = [p for p in (q.get(keeper.id),) if p is not None]
            deadline = self.deadline(keeper)
            if now >= deadline:
                if own:
                    yield own, _only(slots, mine)
                continue
            borrowers = []
            asker = q.get(s.by_lease)
            if asker is not None and not asker.request.shared:
                borrowers.append(asker)
            if pol.suspend_keep_gpus == "small":
                for p in q:
                    if p.lease_id in (keeper.id, s.by_lease) or p.request.shared:
                        continue
                    lease = leases.get(p.lease_id)
                    if lease is None or keeps(lease, pol) or not self.may_suspend(lease):
                        continue
                    if deadline < INF and not lease.request.suspendable and now + p.duration > deadline:
                        continue  # (it could not give the GPU back in time)
                    borrowers.append(p)
            pending = own + borrowers if deadline == INF else borrowers + own
            if pending:
                yield pending, _only(slots, mine)

    def others(self, pending: Iterable[Pending]) -> Iterable[Pending]:
        """The main pass's requests: without the keeping leases' resumes (they resume on their own GPUs, in their
        own pass, and plan nothing elsewhere)."""
        keepers = {lease.id for lease in self.keepers()}
        return pending if not keepers else (p for p in pending if p.lease_id not in keepers)

    def hide(self, ix: SlotIndex) -> SlotIndex:
        """The main pass's slots: the kept GPUs unavailable, never free (nobody else is granted or planned on them)."""
        for gid in self.kept():
            if gid in ix.by_id:
                _unavailable(ix, gid)
        return ix

    def run(self, now: float) -> None:
        """After a pass: a keeping lease past its deadline takes its GPUs back: the leases on them are asked to
        suspend (preempted, for no request: they want GPUs back at once and keep none; a holder that cannot is
        revoked as by any preemption)."""
        keepers = [k for k in self.keepers() if self.deadline(k) <= now]
        if not keepers:
            return
        kept = {g for k in keepers for g in (k.suspension.devices if k.suspension is not None else ())}
        for lease in list(self.state.holding()):
            if lease.suspension is None and kept.intersection(lease.devices):
                self.ops.ask_suspend(lease, "preempted", resume=True)


def _only(ix: SlotIndex, mine: set[str]) -> SlotIndex:
    for gid in list(ix.by_id):
        if gid not in mine:
            _unavailable(ix, gid)
    return ix


def _unavailable(ix: SlotIndex, gid: str) -> None:
    s = ix.edit(gid)
    if s.idle:
        ix.note_idle(s.node, -1)
    s.available = False
    s.free_at = INF
