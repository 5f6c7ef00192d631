"""Start estimates of queued requests, from what the holders of GPUs are likely to do (``core.estimate``).

The part keeps a bounded history of how long finished leases held their GPUs (fed by the owner as leases end;
in memory only: a restarted broker learns again, estimating from the Lindy rule and idle deadlines meanwhile)
and, when a view is built, walks the head of the queue over the holders' expected ends: an idle lease ends at
its idle deadline (the enforcer's, pressure included), an active one after the remaining time of similar leases
(same user, notebook and size; else the user's; else everyone's), never past its time limit (a lease renewed
already may be renewed again: then the policy's ceiling for renewals).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import Protocol

from ..core.estimate import INF, Ends, History, Need, Span, calibrated, holder_end, starts
from ..core.gpufit import constrained, fits
from ..core.lease import Lease, LeaseRequest, LeaseState
from ..core.scheduler import Pending
from ..core.small_first import Pressure
from ..policy.lease_policy import LeasePolicy
from .state import LiveState

#: Requests ahead that the walk looks at: a deeper request gets no range (the scheduler's plan stands).
WALK_DEPTH = 16
#: Seconds a walk of the head of the queue is reused while the head stays the same (polling clients).
REUSE_SECONDS = 1.0


class Holders(Protocol):
    """What the estimates ask of the enforcer: which GPUs cannot be granted, and a lease's idle timeout."""

    @property
    def draining(self) -> Mapping[str, object]: ...

    @property
    def unhealthy(self) -> Mapping[str, object]: ...

    def idle_timeout_under(self, lease: Lease, pressure: Pressure | None) -> tuple[float, bool]: ...

    def pressure_now(self, now: float) -> Pressure | None: ...


def history_keys(user: str, labels: Mapping[str, str], size: float) -> tuple[Hashable, ...]:
    """The history's levels for a lease, most specific first: user, notebook and size; the user; everyone."""
    return (("u+n+s", user, labels.get("notebook", ""), size), ("u", user), ("all",))


def _size(req: LeaseRequest) -> float:
    return req.fraction if req.shared else float(req.min_gpus)


class Estimates:
    def __init__(self, *, state: LiveState, policy: LeasePolicy, holders: Holders) -> None:
        self.state, self.policy, self.holders = state, policy, holders
        self.history = History()
        self._nodes: tuple[object, dict[str, list[str]]] = (None, {})  # (the GPU list, node -> its GPU ids)
        self._last: tuple[float, tuple[str, ...], dict[str, Span]] = (-INF, (), {})  # the last walk of the head

    def ended(self, lease: Lease) -> None:
        """A lease ended: how long it held its GPUs joins the history (not a request that never got any)."""
        if lease.granted_at is not None and lease.ended_at is not None:
            self.history.add(self.keys(lease), max(0.0, lease.ended_at - lease.granted_at))

    def keys(self, lease: Lease) -> tuple[Hashable, ...]:
        return history_keys(lease.user, lease.request.labels, _size(lease.request))

    def start(self, lease: Lease, now: float) -> Span | None:
        """A queued lease's likely start as a range; None when it is deeper than WALK_DEPTH or cannot fit."""
        position = self.state.queue.position(lease.id)
        if position is None or position > WALK_DEPTH + 1:
            return None
        return self.queue(now).get(lease.id)

    def queue(self, now: float) -> dict[str, Span]:
        """The likely start of each request at the head of the queue (the first WALK_DEPTH + 1) and the range
        shown for it (``core.estimate.calibrated``), from one walk (reused for REUSE_SECONDS while the head stays
        the same)."""
        head = self.state.queue.head(WALK_DEPTH + 1)
        ids = tuple(p.lease_id for p in head)
        at, last_ids, last = self._last
        if 0.0 <= now - at < REUSE_SECONDS and last_ids == ids:
            return last
        out = {p.lease_id: calibrated(s, now) for p, s in zip(head, self._walk(head, now), strict=True)
               if s is not None}
        self._last = (now, ids, out)
        return out

    # ------------------------------------------------------------------ the walk
    def _walk(self, pending: list[Pending], now: float) -> list[Span | None]:
        if not pending:
            return []
        gpus, nodes = self._nodes
        if gpus is not self.state.gpus:  # a new inventory
            nodes = {}
            for g in self.state.gpus:
                nodes.setdefault(g.node, []).append(g.id)
            self._nodes = (self.state.gpus, nodes)
        ends = _Ends(self, now)
        queue = [Need(1 if p.request.shared else p.request.min_gpus, p.request.locality, self._duration(p, ends),
                      str(p.seq), self._only(p.request)) for p in pending]
        return starts(now, nodes, _Holders(self), ends, queue)

    def _only(self, req: LeaseRequest) -> frozenset[str] | None:
        """The GPUs a request may get when it narrows them (a type, a memory size, no MIG device for several)."""
        gpus = self.state.gpus
        if not constrained(req) and not (req.max_gpus > 1 and not req.shared and any(g.mig for g in gpus)):
            return None
        aliases = self.policy.gpu_type_aliases()
        return frozenset(g.id for g in gpus if fits(g, req, aliases))

    def _duration(self, p: Pending, ends: _Ends) -> Ends:
        """How long a queued request will likely hold its GPUs: similar past leases, within its time limit."""
        keys = history_keys(p.user, p.request.labels, _size(p.request))
        left = self.history.remaining(keys, 0.0, ends.running())
        return (p.duration,) if left is None else tuple(min(d, p.duration) for d in left)

    def lease_end(self, lease: Lease, now: float, running: Mapping[Hashable, Sequence[float]] | None = None,
                  pressure: Pressure | None = None) -> Ends:
        """When a holding lease will likely end (``core.estimate.holder_end``); ``running``: how long the holding
        leases of each history key have run (``History.remaining``); ``pressure``: the waiting requests' (an idle
        lease they press ends at its pressure deadline)."""
        idle_deadline = None
        timeout = self.holders.idle_timeout_under(lease, pressure)[0] if lease.idle_timeout_seconds else 0.0
        if timeout and (lease.state == LeaseState.IDLE or now - lease.last_activity >= self.policy.idle_mark_seconds):
            idle_deadline = lease.last_activity + timeout
        granted = lease.granted_at if lease.granted_at is not None else now
        left = None
        if idle_deadline is None:
            left = self.history.remaining(self.keys(lease), now - granted, running)
        return holder_end(now, granted_at=granted, expires_at=self.limit(lease, granted), idle_deadline=idle_deadline,
                          remaining_time=left)

    def limit(self, lease: Lease, granted: float) -> float | None:
        """The latest a holding lease will likely end: its time limit; once renewed past the limit it was granted
        with, the policy's ceiling for renewals (it may well be renewed again: a notebook's next cells)."""
        if lease.expires_at is None:
            return None
        user, req = lease.user, lease.request
        most = float(self.policy.limit(user, "max_duration_seconds"))
        first = min(req.duration_seconds or float(self.policy.limit(user, "default_duration_seconds")), most)
        return lease.expires_at if lease.expires_at - granted <= first + 1.0 else max(lease.expires_at, granted + most)


class _Holders(Mapping[str, Sequence[str]]):
    """GPU id -> what holds it: its leases (by arrival number: the sampling depends on the ids), or a drain (``drain:`` + GPU id), or nothing ever (``down:`` + GPU
    id, unhealthy); GPUs free now are absent."""

    def __init__(self, estimates: Estimates) -> None:
        self.table = estimates.state.table
        self.draining, self.unhealthy = estimates.holders.draining, estimates.holders.unhealthy

    def __contains__(self, gpu_id: object) -> bool:
        return gpu_id in self.table.busy or gpu_id in self.draining or gpu_id in self.unhealthy

    def __getitem__(self, gpu_id: str) -> Sequence[str]:
        if gpu_id in self.unhealthy:
            return ("down:" + gpu_id,)
        held = self.table.holders.get(gpu_id)
        if held:
            return tuple(str(lease.seq) for lease in held.values())
        if gpu_id in self.draining:
            return ("drain:" + gpu_id,)
        raise KeyError(gpu_id)

    def __iter__(self) -> Iterator[str]:
        return iter({*self.table.busy, *self.draining, *self.unhealthy})

    def __len__(self) -> int:
        return len({*self.table.busy, *self.draining, *self.unhealthy})


class _Ends(Mapping[str, Ends]):
    """Holder id (``_Holders``) -> its possible ends, computed when the walk first asks."""

    def __init__(self, estimates: Estimates, now: float) -> None:
        self.e, self.now = estimates, now
        # the pressure as the queue stands now: a request that has just queued presses already (the last tick's
        # pressure predates it)
        self.pressure = estimates.holders.pressure_now(now)
        self._by_seq: dict[str, Lease] | None = None
        self.ends: dict[str, Ends] = {}
        self._running: dict[Hashable, list[float]] | None = None

    def running(self) -> dict[Hashable, list[float]]:
        """How long the holding leases of each history key have run so far (once per walk)."""
        if self._running is None:
            self._running = {}
            for lease in self.e.state.holding():
                if lease.granted_at is not None:
                    for key in self.e.keys(lease):
                        self._running.setdefault(key, []).append(self.now - lease.granted_at)
        return self._running

    def __getitem__(self, holder: str) -> Ends:
        got = self.ends.get(holder)
        if got is None:
            got = self.ends[holder] = self._end(holder)
        return got

    def _end(self, holder: str) -> Ends:
        if holder.startswith("down:"):
            return (INF,)
        if holder.startswith("drain:"):
            return (self.now + self.e.policy.term_timeout,)
        if self._by_seq is None:
            self._by_seq = {str(lease.seq): lease for lease in self.e.state.holding()}
        return self.e.lease_end(self._by_seq[holder], self.now, self.running(), self.pressure)

    def __iter__(self) -> Iterator[str]:
        return iter(self.ends)

    def __len__(self) -> int:
        return len(self.ends)
