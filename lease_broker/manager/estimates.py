"""Start estimates of queued requests, from what the holders of GPUs are likely to do (``core.estimate``).

The part keeps a bounded history of how long finished leases held their GPUs (fed by the owner as leases end;
in memory only: a restarted broker learns again, estimating from the Lindy rule and idle deadlines meanwhile)
and, when a view is built, walks the head of the queue over the holders' expected ends: an idle lease ends at
its idle deadline (the enforcer's, pressure included), an active one after the remaining time of similar leases
(same user, notebook and size; else the user's; else everyone's), never past its time limit.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Mapping
from typing import Protocol

from ..core.estimate import INF, History, Need, Span, holder_end, starts
from ..core.lease import Lease, LeaseRequest, LeaseState
from ..core.scheduler import Pending
from ..policy.lease_policy import LeasePolicy
from .state import LiveState

#: Requests ahead that the walk looks at: a deeper request gets no range (the scheduler's plan stands).
WALK_DEPTH = 32


class Holders(Protocol):
    """What the estimates ask of the enforcer: which GPUs cannot be granted, and a lease's idle timeout."""

    @property
    def draining(self) -> Mapping[str, object]: ...

    @property
    def unhealthy(self) -> Mapping[str, object]: ...

    def idle_timeout(self, lease: Lease) -> tuple[float, bool]: ...


def history_keys(user: str, labels: Mapping[str, str], size: float) -> tuple[Hashable, ...]:
    """The history's levels for a lease, most specific first: user, notebook and size; the user; everyone."""
    return (("u+n+s", user, labels.get("notebook", ""), size), ("u", user), ("all",))


def _size(req: LeaseRequest) -> float:
    return req.fraction if req.shared else float(req.min_gpus)


class Estimates:
    def __init__(self, state: LiveState, policy: LeasePolicy, holders: Holders) -> None:
        self.state, self.policy, self.holders = state, policy, holders
        self.history = History()
        self._nodes: tuple[object, dict[str, list[str]]] = (None, {})  # (the GPU list, node -> its GPU ids)

    def ended(self, lease: Lease) -> None:
        """A lease ended: how long it held its GPUs joins the history (not a request that never got any)."""
        if lease.granted_at is not None and lease.ended_at is not None:
            self.history.add(self.keys(lease), max(0.0, lease.ended_at - lease.granted_at))

    def keys(self, lease: Lease) -> tuple[Hashable, ...]:
        return history_keys(lease.user, lease.request.labels, _size(lease.request))

    def start(self, lease: Lease, now: float) -> Span | None:
        """A queued lease's likely start as a range; None when it is deeper than WALK_DEPTH or cannot fit."""
        q = self.state.queue
        position = q.position(lease.id)
        if position is None or position > WALK_DEPTH + 1:
            return None
        ahead = q.head(position)
        if not ahead or ahead[-1].lease_id != lease.id:
            return None
        return self._walk(ahead, now)[-1]

    def queue(self, now: float) -> dict[str, Span]:
        """The likely start of each request at the head of the queue (the first WALK_DEPTH + 1), from one walk."""
        head = self.state.queue.head(WALK_DEPTH + 1)
        return {p.lease_id: s for p, s in zip(head, self._walk(head, now), strict=True) if s is not None}

    # ------------------------------------------------------------------ the walk
    def _walk(self, pending: list[Pending], now: float) -> list[Span | None]:
        gpus, nodes = self._nodes
        if gpus is not self.state.gpus:  # a new inventory
            nodes = {}
            for g in self.state.gpus:
                nodes.setdefault(g.node, []).append(g.id)
            self._nodes = (self.state.gpus, nodes)
        queue = [Need(1 if p.request.shared else p.request.min_gpus, p.request.locality, self._duration(p))
                 for p in pending]
        return starts(now, nodes, _FreeAt(self, now), queue)

    def _duration(self, p: Pending) -> Span:
        """How long a queued request will likely hold its GPUs: similar past leases, within its time limit."""
        left = self.history.remaining(history_keys(p.user, p.request.labels, _size(p.request)), 0.0)
        if left is None:
            return Span.exactly(p.duration)
        return left.cap(p.duration)

    def lease_end(self, lease: Lease, now: float) -> Span:
        """When a holding lease will likely end (``core.estimate.holder_end``)."""
        idle_deadline = None
        timeout = self.holders.idle_timeout(lease)[0] if lease.idle_timeout_seconds else 0.0
        if timeout and (lease.state == LeaseState.IDLE or now - lease.last_activity >= self.policy.idle_mark_seconds):
            idle_deadline = lease.last_activity + timeout
        granted = lease.granted_at if lease.granted_at is not None else now
        left = None if idle_deadline is not None else self.history.remaining(self.keys(lease), now - granted)
        return holder_end(now, granted_at=granted, expires_at=lease.expires_at, idle_deadline=idle_deadline,
                          remaining_time=left)


class _FreeAt(Mapping[str, Span]):
    """GPU id -> when it frees, for the GPUs that are not free now; computed when the walk asks (and kept)."""

    def __init__(self, estimates: Estimates, now: float) -> None:
        self.e, self.now = estimates, now
        self.table = estimates.state.table
        self.draining, self.unhealthy = estimates.holders.draining, estimates.holders.unhealthy
        self.ends: dict[str, Span] = {}  # lease id -> its end
        self.gpus: dict[str, Span] = {}

    def __contains__(self, gpu_id: object) -> bool:
        return gpu_id in self.table.busy or gpu_id in self.draining or gpu_id in self.unhealthy

    def __getitem__(self, gpu_id: str) -> Span:
        span = self.gpus.get(gpu_id)
        if span is None:
            span = self.gpus[gpu_id] = self._free_at(gpu_id)
        return span

    def _free_at(self, gpu_id: str) -> Span:
        if gpu_id in self.unhealthy:
            return Span.exactly(INF)
        holders = self.table.holders.get(gpu_id, {})
        if not holders:
            if gpu_id in self.draining:
                return Span.exactly(self.now + self.e.policy.term_timeout)
            raise KeyError(gpu_id)
        low = likely = high = 0.0
        for lease in holders.values():  # an exclusive request waits for every holder of a shared GPU
            end = self.ends.get(lease.id)
            if end is None:
                end = self.ends[lease.id] = self.e.lease_end(lease, self.now)
            low, likely, high = max(low, end.low), max(likely, end.likely), max(high, end.high)
        return Span(low, likely, high) if high < INF else Span.exactly(INF)

    def __iter__(self) -> Iterator[str]:
        return iter({*self.table.busy, *self.draining, *self.unhealthy})

    def __len__(self) -> int:
        return len({*self.table.busy, *self.draining, *self.unhealthy})
