"""The inputs of a scheduling pass beyond the queue and the GPUs: the policy, fair-share usage, daily budgets,
reservation windows and the incremental leases that may grow."""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import operator
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

from ..core.lease import RESUMED, Change, Lease, LeaseState
from ..core.queue import Queue
from ..core.scheduler import Decision, Grant, Growing, Pending, Reservation, SchedulerPolicy, Slot, SlotIndex, schedule
from ..policy.lease_policy import LeasePolicy
from ..policy.limits import DAY
from .accounting import Accounting
from .quotas import Quotas
from .reservations import Reservations
from .state import LiveState


class Placements(Protocol):
    def placement(self, lease: Lease) -> dict[str, Any] | None: ...


class Planning:
    def __init__(self, *, state: LiveState, policy: LeasePolicy, placements: Placements, quotas: Quotas, accounting: Accounting,
                 reservations: Reservations) -> None:
        self.state, self.policy, self.placements = state, policy, placements
        self.quotas, self.accounting, self.reservations = quotas, accounting, reservations
        self.arrived: list[str] = []  # queued since the last pass: the next event pass looks at them
        self.last_full = -1e18  # when the last full pass ran
        self.full_due = True  # the policy, the reservations or the GPUs changed: the next pass is a full one
        self.plan: dict[str, Reservation] = {}  # the latest pass's reservations: event passes keep what holds
        self.cursor = 0  # where in the queue the next full pass's window (full_pass_depth) starts
        #: queued request -> the suspended leases it asked (``resuming``), in the order they suspended (dicts, not
        #: sets: they queue again in that order, not in the order of their random ids)
        self.held_back: dict[str, dict[str, None]] = {}
        #: a request that held suspended leases back ended (cancelled, timed out): they queued for their GPUs, and the
        #: end asks for a pass (``LeaseManager._ended``) as a release does, not the next tick
        self.requeued = False
        self.same = SamePass()  # a pass that cannot decide anything new is not run

    def decide(self, pending: Iterable[Pending], full: bool, slots: SlotIndex, held: dict[str, float], now: float,
               growable: list[Lease]) -> Decision:
        """The decision of the pass over ``pending`` (``select``) on ``slots``: the scheduler's, or the last pass's
        when this one cannot decide otherwise (``SamePass``)."""
        return self.same.decide(pending, full, slots, held, now, self.options(now, growable))

    def select(self, now: float) -> tuple[Iterable[Pending], bool]:
        """The requests the next pass looks at (``_select``), and whether it is a full pass; with
        ``suspend_grant_asker``, first the requests that leases suspended for (``held_back``): the GPUs a suspension
        freed go to the request it was made for, not to whoever is ahead of it in the queue."""
        pending, full = self._select(now)
        if not self.policy.suspend_grant_asker or not self.held_back:
            return pending, full
        q = self.state.queue
        first = [p for lid in self.held_back if (p := q.get(lid)) is not None]
        return itertools.chain(first, _once(pending, {p.lease_id for p in first})), full

    def _select(self, now: float) -> tuple[Iterable[Pending], bool]:
        """The requests the next pass looks at, in queue order, and whether it is a full pass.

        The event pass (a request, a release, a tick) looks at the head of the queue (``queue_depth``), the first
        request of each shape further back and the requests that arrived since the last pass, and keeps the
        reservations of the last pass that still hold (``plan``): its cost does not grow with the queue. The full
        pass, every ``full_pass_seconds`` and when ``full_due``, gives every user a fresh fair-share score, plans
        the blocked head afresh and also looks at ``full_pass_depth`` requests further back, going on where the
        last full pass stopped (the whole queue when it is that short).
        """
        q = self.state.queue
        arrived, self.arrived = self.arrived, []
        full = self.full_due or now - self.last_full >= self.policy.full_pass_seconds
        depth, window = self.policy.queue_depth, 0
        if full:
            everyone = self.full_due  # (a restore, a retime or a failed write queued requests at 0: all re-scored)
            self.last_full, self.full_due, self.plan = now, False, {}  # plans every reservation afresh
            if len(q):  # (no usage to load for an empty queue: a restart with no request waiting skips it)
                # only users whose usage is not 0, or may have left 0 since the last full pass (a user who never
                # held a GPU scores 0, and decay never makes 0 non-zero): not O(users queued)
                risen = self.accounting.risen(now)
                risen = None if everyone else risen
                users = q.users() if risen is None else {u for u in risen if q.queued_by(u)} | q.scored_users()
                scores = self.scores(now, users)
                q.rescore(lambda u: scores.get(u, 0.0), None if risen is None else users)
            window = self.policy.full_pass_depth
            if not window or len(q) <= depth + window:
                self.cursor = depth
                return iter(q), True
        if len(q) <= depth:
            return q.head(depth), full
        # the head lazily too (``q.window``), known by its last request: a pass over a deep queue reads a few
        # dozen requests of it before it stops (nothing idle); listing all ``queue_depth`` of them (and a set of
        # their ids) at every pass made ``select`` 51.7 us a pass, 39.6 us without, on the 8,000-job version of the
        # overloaded month replay (benchmarks/replay_month.py: 21,280 passes)
        more = _beyond(q, depth, arrived)
        head = q.window(0, depth)
        if not window:
            return itertools.chain(head, more), full
        if self.cursor >= len(q) or self.cursor < depth:
            self.cursor = depth
        start, self.cursor = self.cursor, self.cursor + window
        # lazily, in queue order: a pass that stops early (nothing idle) reads little of the window (which starts
        # after the head: only what ``more`` and it share is seen twice)
        rest = heapq.merge(more, q.window(start, window), key=q.order_key)
        return itertools.chain(head, _once(rest, set())), full

    def resuming(self, lease: Lease) -> None:
        """Keep the queue's entry of a suspended lease current (the owner's commit calls this at each change of a
        suspended lease, or of one that was, and when a request leaves the queue): queued for its GPUs while it wants
        them back (``suspension.resume``), before new requests of its class (``Queue``: ``Pending.resuming``); out
        of the queue once granted or ended. A lease suspended for a request (``by_lease``) queues once that request
        has left the queue: it does not take back the GPUs it gave."""
        q, s = self.state.queue, lease.suspension
        if lease.state != LeaseState.SUSPENDED and lease.id in self.held_back:  # a preempting request was served
            for vid in self.held_back.pop(lease.id):
                victim = self.state.leases.get(vid)
                if victim is not None:
                    self.resuming(victim)
                    self.requeued |= lease.state.terminal and vid in q
        if lease.state == LeaseState.QUEUED:
            return
        wants = lease.state == LeaseState.SUSPENDED and s is not None and s.suspended and s.resume
        if wants and s is not None and s.by_lease:
            by = self.state.leases.get(s.by_lease)
            if by is not None and by.state == LeaseState.QUEUED:
                self.held_back.setdefault(by.id, {})[lease.id] = None
                wants = False
        if wants and lease.id not in q and s is not None and s.why == "preempted" \
                and self.policy.suspend_resume_behind_gangs and self.older_gang(lease, s.since) is not None:
            # not before an older gang (``suspend_resume_behind_gangs``): queued as a request of its user, by its
            # original arrival, not ahead of every user's requests of its class
            q.add(dataclasses.replace(resume_pending(lease), resuming=False),
                  self.scores(s.since, {lease.user}).get(lease.user, 0.0))
            self.arrived.append(lease.id)
        if wants and lease.id not in q:
            q.add(resume_pending(lease), 0.0)
            self.arrived.append(lease.id)
        elif not wants and lease.id in q:
            q.remove(lease.id)
            self.state.planned.pop(lease.id, None)
            self.state.waiting.pop(lease.id, None)

    def older_gang(self, lease: Lease, since: float) -> Lease | None:
        """A queued request of more GPUs than ``lease`` left, with a reservation in the latest pass (``plan``), that
        asked before ``lease`` was suspended: a lease suspended by preemption resumes behind it."""
        n = len(lease.suspension.devices) if lease.suspension is not None else 0
        for lid in self.plan:
            g = self.state.leases.get(lid)
            if (g is not None and g.state == LeaseState.QUEUED and not g.request.shared
                    and g.request.min_gpus > n and g.created_at < since):
                return g
        return None

    def scores(self, now: float, users: set[str]) -> dict[str, float]:
        """The fair-share score of those of ``users`` whose score is not 0 (absent: 0): decayed past usage divided by
        their weight (lower goes first)."""
        weights = self.policy.weight
        return {u: v / weights(u) for u, v in self.accounting.fairshare(now, users).items() if v}

    def growable(self, now: float) -> list[Lease]:
        """Holding incremental leases below their max_gpus whose request says ``grow`` (code that takes added GPUs:
        the incremental API, ``map``; a plain cell keeps what it got at its grant), placed by the broker itself, not
        by an engine."""
        return [lease for lease in self.state.table.growable.values()
                if (lease.expires_at or 0.0) > now and self.placements.placement(lease) is None]

    def options(self, now: float, growable: list[Lease]) -> dict[str, Any]:
        """Keyword arguments of scheduler.schedule() beyond pending (in queue order), slots and held: the policy
        and its inputs, for the users of the queue and of ``growable`` only."""
        cutoff = now - DAY
        growing = [  # an added GPU is charged (daily quota) as the store counts it: from the grant to the end
            Growing(Pending(lease.id, lease.user, lease.request, lease.seq,
                            (lease.expires_at or now) - max(lease.granted_at or now, cutoff)),
                    tuple(lease.devices), lease.expires_at or now)
            for lease in growable]
        grower_users = {g.pending.user for g in growing}
        budget = self.quotas.day_budget(now, self.state.queue.users() | grower_users) \
            if self.policy.quotas_configured() else None  # (the users of a deep queue: only with quotas)
        return {"policy": self.policy.scheduler_policy(), "usage": self.scores(now, grower_users) if growing else {},
                "budget": budget, "reservations": self.reservations.windows(now),
                "growing": growing, "ordered": True, "plan": self.plan,
                "all_exclusive": self.state.queue.all_exclusive(), "shortest": self.state.queue.shortest()}


class SamePass:
    """The decision of a scheduling pass that cannot differ from the last one's, taken without running it.

    With no GPU idle, and no cap, budget, advance reservation, growing lease, shared request or small-first order, a
    pass only plans the first ``backfill_depth`` requests of the queue (the scheduler stops after them: nothing can
    start), each on the GPUs that free soonest: their holders' time limits, the same whatever ``now`` is while none
    of them is past. So a pass decides what the last one decided when its GPUs are the same slot lists (a change of
    a GPU's holders or time limit makes a new list, ``SlotIndex``; a draining or unhealthy GPU is an edit of the
    pass's own fork, never the same list), its first requests the same ``Pending`` objects in the same order, under
    the same ``SchedulerPolicy``, and: for a full pass (which plans afresh), the last decision was planned afresh
    too; for an event pass (which keeps what holds of the last plan), the plan it keeps is that decision's own (each
    of its reservations holds: the pass that made it booked them in the same order on the same GPUs). Caps and
    budgets aside, who holds how many GPUs (``held``) does not show in such a pass. These are most passes of an
    overloaded queue: a request that queues behind a busy cluster, a tick that revokes nobody. On the overloaded
    month replay (benchmarks/replay_month.py) shortened to 8,000 jobs over 8 days, 8,709 of 21,175 passes decide as
    the last one did; running the scheduler for them cost 1.64 s of CPU (measured in the same run; the whole replay
    takes about 13 s), with the same decisions (the replay's hash at 1,000, 3,000, 8,000 and 31,000 jobs)."""

    def __init__(self) -> None:
        #: (policy, the GPUs' slot lists, the requests looked at, planned afresh, the earliest time limit, decision)
        self.last: tuple[SchedulerPolicy, list[list[Slot]], list[Pending], bool, float, Decision] | None = None

    def decide(self, pending: Iterable[Pending], full: bool, slots: SlotIndex, held: dict[str, float], now: float,
               options: dict[str, Any]) -> Decision:
        policy: SchedulerPolicy = options["policy"]
        if slots.idle_total or not options["all_exclusive"] or options["growing"] or options["reservations"] \
                or options["budget"] is not None or policy.capped or policy.small_first_gpus > 0:
            self.last = None
            return schedule(pending, slots, held, now=now, **options)
        it = iter(pending)
        head = list(itertools.islice(it, policy.backfill_depth + 1))  # (the scheduler reads one past those it plans)
        looked, nodes = head[:policy.backfill_depth], list(slots.nodes.values())
        last = self.last
        if last is not None and last[0] is policy and now <= last[4] and _same(last[1], nodes) \
                and _same(last[2], looked) and (last[3] if full else options["plan"] is last[5].plan):
            return last[5]
        decision = schedule(itertools.chain(head, it), slots, held, now=now, **options)
        self.last = (policy, nodes, looked, full, min((s.free_at for ss in nodes for s in ss), default=0.0), decision)
        return decision


def _same(a: list[Any], b: list[Any]) -> bool:
    """The same objects in the same order."""
    return len(a) == len(b) and all(map(operator.is_, a, b))


def resume_seconds(lease: Lease) -> float:
    """The time limit a suspended lease gets when it resumes: what it had left when a preemption suspended it (it
    keeps the time it was promised), else its whole duration (an idle, pressure or time-limit suspension, or its
    own: its next cell starts afresh)."""
    s = lease.suspension
    if s is not None and s.why == "preempted":
        return max(s.remaining, 1.0)
    return lease.duration_seconds


def resume_pending(lease: Lease) -> Pending:
    """A suspended lease that wants its GPUs back as a pass sees it: as many GPUs as it left, only of the model it
    left (CUDA restores a checkpoint onto the same chip type only), its own GPUs first (``prefer``), for the time
    limit it resumes with, in its class before new requests (``resuming``), by its original arrival."""
    s = lease.suspension
    assert s is not None
    req = lease.request
    if not req.shared:
        n = len(s.devices) or req.min_gpus
        req = dataclasses.replace(req, min_gpus=n, max_gpus=n, grow=False)
    if s.model:
        req = dataclasses.replace(req, gpu_type=s.model)
    return Pending(lease.id, lease.user, req, lease.seq, resume_seconds(lease), lease.created_at, s.devices,
                   resuming=True)


def resumed(lease: Lease, grant: Grant, now: float) -> Change:
    """The one change that grants a suspended lease its GPUs again: granted (reason "resumed") on the pass's
    devices, its time limit restarted (``resume_seconds``), its suspension cleared and its suspended time added to
    ``suspended_seconds`` (not charged: fair share, budgets and usage count the held time only)."""
    s = lease.suspension
    since = s.since if s is not None and s.since else now
    return Change(state=LeaseState.GRANTED, reason="resumed", devices=grant.gpu_ids, node=grant.node,
                  granted_at=now,  # (its held time so far was charged when it was suspended: GpuTable.sync)
                  expires_at=now + resume_seconds(lease), suspension=RESUMED,
                  suspended_seconds=lease.suspended_seconds + max(0.0, now - since), last_activity=now,
                  last_heartbeat=max(lease.last_heartbeat, now))


def _beyond(q: Queue, depth: int, arrived: list[str]) -> Iterator[Pending]:
    """The first request of each shape behind the head (the first ``depth``), and those of ``arrived`` there, in
    queue order, worked out when a pass first reads past the head (the queue does not change while a pass reads it):
    a pass over a busy cluster stops within the head, and one whose decision is the last one's (``SamePass``) reads
    none of it. On the 8,000-job version of the overloaded month replay (benchmarks/replay_month.py) ``select``
    took 1.03 s of CPU over its 21,280 passes, 0.69 s with this (the best of three runs each)."""
    last = next(q.window(depth - 1, 1))
    edge = q.order_key(last)
    more = q.shape_heads(last) + [p for lid in arrived if (p := q.get(lid)) is not None]
    yield from q.in_order([p for p in more if q.order_key(p) > edge])  # (those in the head come with it)


def _once(pending: Iterable[Pending], seen: set[str]) -> Iterator[Pending]:
    """``pending`` without the requests in ``seen`` or seen before."""
    for p in pending:
        if p.lease_id not in seen:
            seen.add(p.lease_id)
            yield p


KEEP = 10_000  # at most this many notebooks remembered (the oldest forgotten first)


class WarmRegrants:
    def __init__(self, *, policy: LeasePolicy) -> None:
        self.policy = policy  # its warm_regrant_seconds: the window (0 = off), read at each use
        self._last: dict[tuple[str, str], tuple[tuple[str, ...], float]] = {}  # (user, notebook) -> GPUs, end

    def ended(self, lease: Lease) -> None:
        """A lease that held GPUs ended: its notebook's next request may get them again."""
        notebook = lease.request.labels.get("notebook")
        if not self.policy.warm_regrant_seconds or not notebook or not lease.devices or lease.ended_at is None:
            return
        key = (lease.user, notebook)
        self._last.pop(key, None)  # re-inserted last: the dict stays in order of ends
        self._last[key] = (tuple(lease.devices), lease.ended_at)
        if len(self._last) > KEEP:
            del self._last[next(iter(self._last))]

    def prefer(self, lease: Lease) -> tuple[str, ...]:
        """The GPUs a new request's notebook gave back within the window before it asked; () if none."""
        notebook = lease.request.labels.get("notebook")
        window = self.policy.warm_regrant_seconds
        if not window or not notebook:
            return ()
        last = self._last.get((lease.user, notebook))
        if last is None:
            return ()
        devices, ended_at = last
        return devices if 0.0 <= lease.created_at - ended_at <= window else ()
