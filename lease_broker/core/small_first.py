"""Small requests first: within a priority class, requests of at most ``small_first_gpus`` GPUs go before bigger
ones, until a bigger one has waited ``small_first_timeout``: from then on the first such one keeps its place in
the queue (fair share, then arrival), so a gang is passed over for a bounded time, never starved.

Why (BENCHMARKS.md, the contended 2x8 replay): on a cluster the same people contend for, a one-GPU cell that
queues behind gangs waits for them (the GPUs that free go to the gangs' reservations), and a notebook's next cell
after a revocation queues again. Letting the small cells that the waiting gangs cannot use yet go first cuts their
wait without delaying the gangs: a gang starts when a whole node frees, which small cells hardly move.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

from .pass_types import Pending, SchedulerPolicy


def small_first(pending: Iterable[Pending], policy: SchedulerPolicy, now: float) -> Iterable[Pending]:
    """``pending`` (in queue order) with the small requests of each priority class first; the first bigger request
    of a class that has waited ``small_first_timeout`` keeps its place among them (one at a time, as EASY backfill
    protects the head: the next one keeps its place once that one started). A stable reorder: ``pending`` as it
    is when ``small_first_gpus`` is 0."""
    small = policy.small_first_gpus
    if small <= 0:
        return pending
    ranks, timeout = policy.priority_ranks, policy.small_first_timeout
    kept: set[int] = set()  # the classes whose first waited-long bigger request has been seen
    keyed: list[tuple[int, bool, int, Pending]] = []
    for i, p in enumerate(pending):
        req = p.request
        rank = ranks.get(req.priority, 0)
        first = req.shared or req.min_gpus <= small
        if not first and rank not in kept and now - p.queued_at >= timeout:
            kept.add(rank)
            first = True
        keyed.append((-rank, not first, i, p))
    keyed.sort(key=lambda k: k[:3])
    return [k[3] for k in keyed]


@dataclasses.dataclass(frozen=True)
class Pressure:
    """What waiting requests press idle leases with (``manager.enforcer``): the GPUs the first request of a pass
    needs (``small_need``), the GPUs it may get (None: any; a GPU type or memory narrows them), and how many of
    those are free on each node."""

    need: int
    free: Mapping[str, int]
    usable: frozenset[str] | None = None

    def serves(self, devices: Sequence[str], node: str) -> bool:
        """Whether a lease's GPUs (``devices``, on ``node``) would serve that request, with its node's free ones:
        a lease on GPUs it may not get is not pressed (an idle A100 lease stays while an H100 request waits)."""
        if self.usable is not None and not self.usable.issuperset(devices):
            return False
        return len(devices) + self.free.get(node, 0) >= self.need


def small_need(head: Pending, smallest: int | None, small_gpus: int, timeout: float, now: float) -> int:
    """The GPUs the first request of a pass needs, from the queue's head and the fewest any queued request needs
    (``Queue.smallest_need``): a small one goes first while the head is bigger and has waited less than
    ``timeout`` (``small_gpus``, ``timeout``: the policy's small_first_*; approximate across priority classes: it
    is the enforcer's hint of whom a freed GPU serves, not a grant)."""
    req = head.request
    need = 1 if req.shared else req.min_gpus
    if small_gpus and need > small_gpus and smallest is not None and smallest <= small_gpus \
            and now - head.queued_at < timeout:
        return smallest
    return need
