"""The inputs of a scheduling pass beyond the queue and the GPUs: the policy, fair-share usage, daily budgets,
reservation windows and the incremental leases that may grow."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

from ..core.lease import Lease
from ..core.scheduler import Growing, Pending, Reservation
from ..policy.lease_policy import LeasePolicy
from ..policy.limits import DAY
from .quotas import Quotas
from .reservations import Reservations
from .state import LiveState
from .usage import Usage


class Placements(Protocol):
    def placement(self, lease: Lease) -> dict[str, Any] | None: ...


class Planning:
    def __init__(self, state: LiveState, policy: LeasePolicy, placements: Placements, quotas: Quotas, usage: Usage,
                 reservations: Reservations) -> None:
        self.state, self.policy, self.placements = state, policy, placements
        self.quotas, self.usage, self.reservations = quotas, usage, reservations
        self.arrived: list[str] = []  # queued since the last pass: the next event pass looks at them
        self.last_full = -1e18  # when the last full pass ran
        self.full_due = True  # the policy, the reservations or the GPUs changed: the next pass is a full one
        self.plan: dict[str, Reservation] = {}  # the latest pass's reservations: event passes keep what holds
        self.cursor = 0  # where in the queue the next full pass's window (full_pass_depth) starts

    def select(self, now: float) -> tuple[Iterable[Pending], bool]:
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
            self.last_full, self.full_due, self.plan = now, False, {}  # plans every reservation afresh
            if len(q):  # (no usage to load for an empty queue: a restart with no request waiting skips it)
                scores = self.scores(now, q.users())
                q.rescore(scores.__getitem__)
            window = self.policy.full_pass_depth
            if not window or len(q) <= depth + window:
                self.cursor = depth
                return iter(q), True
        pending = q.head(depth)
        if len(q) <= depth:
            return pending, full
        seen = {p.lease_id for p in pending}
        more = q.shape_heads(pending[-1]) + [p for lid in arrived if (p := q.get(lid)) is not None]
        more = q.in_order([p for p in more if p.lease_id not in seen])
        if not window:
            return pending + more, full
        if self.cursor >= len(q) or self.cursor < depth:
            self.cursor = depth
        start, self.cursor = self.cursor, self.cursor + window
        # lazily, in queue order: a pass that stops early (nothing idle) reads little of the window
        rest = heapq.merge(more, q.window(start, window), key=q.order_key)
        return itertools.chain(pending, _once(rest, seen)), full

    def scores(self, now: float, users: set[str]) -> dict[str, float]:
        """Each user's fair-share score: decayed past usage divided by their weight (lower goes first)."""
        weights = self.policy.weight
        usage = self.usage.fairshare(now, users)
        return {u: usage.get(u, 0.0) / weights(u) for u in users}

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
        users = self.state.queue.users() | grower_users
        return {"policy": self.policy.scheduler_policy(), "usage": self.scores(now, grower_users) if growing else {},
                "budget": self.quotas.day_budget(now, users), "reservations": self.reservations.windows(now),
                "growing": growing, "ordered": True, "plan": self.plan,
                "all_exclusive": self.state.queue.all_exclusive()}


def _once(pending: Iterable[Pending], seen: set[str]) -> Iterator[Pending]:
    """``pending`` without the requests in ``seen`` or seen before."""
    for p in pending:
        if p.lease_id not in seen:
            seen.add(p.lease_id)
            yield p
