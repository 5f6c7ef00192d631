"""When a queued request will likely start, from what the holders of GPUs are likely to do.

Pure: the holders' expected ends, the GPUs, the requests ahead and the time are passed in; no I/O, no clock.

A holding lease's end is a :class:`Span` (low, likely, high), never past its time limit: an idle lease ends at its
idle deadline; an active one after the remaining time of similar finished leases that ran at least as long as it
has (:func:`remaining`: quantiles of ``d - elapsed`` over the past durations ``d > elapsed``). A queued request's
start is then a greedy walk (:func:`starts`), once for each of the three scenarios: each request ahead, in queue
order, takes the GPUs where it can start first on one node (any GPUs with locality ``any``) and holds them for
its own duration in that scenario (similar past leases, within its time limit); then the request itself. A short
request may start on GPUs a request ahead will take later, if it ends first (the scheduler's backfill).
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable, Mapping, Sequence

INF = math.inf

#: Quantiles of the remaining time read as the range's low, likely and high ends.
QUANTILES = (0.25, 0.5, 0.75)
#: Past durations (beyond the elapsed time) a history level needs before its quantiles are trusted.
MIN_SAMPLES = 4


@dataclasses.dataclass(frozen=True)
class Span:
    """A time (or a duration) as a range: ``low <= likely <= high``."""

    low: float
    likely: float
    high: float

    @classmethod
    def exactly(cls, t: float) -> Span:
        return cls(t, t, t)

    def __getitem__(self, i: int) -> float:
        return (self.low, self.likely, self.high)[i]

    def shift(self, by: float) -> Span:
        return Span(self.low + by, self.likely + by, self.high + by)

    def cap(self, limit: float | None) -> Span:
        """Never past ``limit`` (None: no limit)."""
        if limit is None:
            return self
        return Span(min(self.low, limit), min(self.likely, limit), min(self.high, limit))

    def floor(self, at: float) -> Span:
        """Never before ``at``."""
        return Span(max(self.low, at), max(self.likely, at), max(self.high, at))


def quantile(xs: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks of sorted ``xs`` (numpy's default)."""
    pos = (len(xs) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def remaining(durations: Iterable[float], elapsed: float, min_samples: int = MIN_SAMPLES) -> Span | None:
    """How much longer something that has run ``elapsed`` seconds will run, from the durations of similar past
    ones that ran longer (the conditional remaining time); None when fewer than ``min_samples`` did."""
    left = sorted(d - elapsed for d in durations if d > elapsed)
    if len(left) < max(1, min_samples):
        return None
    return Span(*(quantile(left, q) for q in QUANTILES))


class History:
    """Durations of finished leases, per key (e.g. user, notebook and size), bounded: at most ``per_key``
    durations per key (the latest) and ``max_keys`` keys (the least recently fed go first)."""

    def __init__(self, per_key: int = 64, max_keys: int = 4096) -> None:
        self.per_key, self.max_keys = per_key, max_keys
        self._by_key: OrderedDict[Hashable, deque[float]] = OrderedDict()

    def add(self, keys: Iterable[Hashable], duration: float) -> None:
        """Record one duration under each of ``keys`` (its levels, most specific first)."""
        for key in keys:
            past = self._by_key.get(key)
            if past is None:
                past = self._by_key[key] = deque(maxlen=self.per_key)
                if len(self._by_key) > self.max_keys:
                    self._by_key.popitem(last=False)
            else:
                self._by_key.move_to_end(key)
            past.append(duration)

    def get(self, key: Hashable) -> Sequence[float]:
        return self._by_key.get(key, ())

    def remaining(self, keys: Iterable[Hashable], elapsed: float) -> Span | None:
        """The remaining time from the most specific key with enough durations beyond ``elapsed``."""
        for key in keys:
            left = remaining(self.get(key), elapsed)
            if left is not None:
                return left
        return None

    def __len__(self) -> int:
        return len(self._by_key)


def holder_end(now: float, *, granted_at: float, expires_at: float | None, idle_deadline: float | None,
               remaining_time: Span | None) -> Span:
    """When a holding lease will likely end: its idle deadline while it is idle; else ``now`` plus the
    remaining time of similar leases (None, none ran as long: as long again as it has run, the Lindy rule,
    from half that to twice that); never past its time limit ``expires_at``, never before ``now``."""
    if idle_deadline is not None:
        end = Span.exactly(idle_deadline)
    elif remaining_time is not None:
        end = remaining_time.shift(now)
    else:
        ran = max(now - granted_at, 0.0)
        end = Span(now + ran / 2, now + ran, now + 2 * ran)
    return end.cap(expires_at).floor(now)


@dataclasses.dataclass(frozen=True)
class Need:
    """A queued request as the walk sees it: whole GPUs (``gpus``; a shared request counts as one), on one
    node (``locality`` "node") or any, held for ``duration`` once started."""

    gpus: int
    locality: str = "node"
    duration: Span = Span(0.0, 0.0, 0.0)


def starts(now: float, nodes: Mapping[str, Sequence[str]], free_at: Mapping[str, Span],
           queue: Sequence[Need]) -> list[Span | None]:
    """The likely start of each request of ``queue`` (in queue order) as a Span, None where it cannot fit.

    ``nodes``: node -> its GPU ids; ``free_at``: GPU id -> when it frees (absent: free now; INF: never). It is
    read only for GPUs the walk must compare (a node with enough GPUs free now needs none), so it may compute
    lazily. Each scenario (low, likely, high ends and durations) is walked on its own; the range is then made
    to hold the likely start (a greedy walk is not monotone in every case)."""
    walks = [_walk(now, nodes, free_at, queue, scenario) for scenario in range(3)]
    out: list[Span | None] = []
    for low, likely, high in zip(*walks, strict=True):
        out.append(None if likely == INF else Span(min(low, likely), likely, max(high, likely)))
    return out


def _walk(now: float, nodes: Mapping[str, Sequence[str]], free_at: Mapping[str, Span], queue: Sequence[Need],
          scenario: int) -> list[float]:
    """One scenario: each request in turn gets the GPUs where it can start first and run its duration without
    overlapping what the requests before it got (so a short one may go before a gang that waits: backfill)."""
    busy: dict[str, list[tuple[float, float]]] = {}  # GPU -> the (start, end) the walk gave it to so far
    base: dict[str, float] = {}

    def ready(g: str) -> float:
        r = base.get(g)
        if r is None:
            r = base[g] = max(now, free_at[g][scenario]) if g in free_at else now
        return r

    def free_for(g: str, t: float, d: float) -> bool:
        return ready(g) <= t and all(e <= t or s >= t + d for s, e in busy.get(g, ()))

    out = []
    for need in queue:
        k, d = max(1, need.gpus), max(need.duration[scenario], 0.0)
        groups: Iterable[Sequence[str]] = nodes.values()
        if need.locality == "any":
            groups = [[g for members in nodes.values() for g in members]]
        best: tuple[float, Sequence[str]] = (INF, ())
        for members in groups:
            if len(members) < k:
                continue
            now_free = [g for g in members if g not in free_at and free_for(g, now, d)]
            if len(now_free) >= k:  # nothing starts sooner: the other GPUs' ends need not be known
                best = (now, now_free[:k])
                break
            times = sorted({ready(g) for g in members} | {e for g in members for _, e in busy.get(g, ())})
            for t in times:
                if t >= best[0] or t == INF:
                    break
                fit = [g for g in members if free_for(g, t, d)]
                if len(fit) >= k:
                    best = (t, fit[:k])
                    break
        start, chosen = best
        out.append(start)
        for g in chosen:
            busy.setdefault(g, []).append((start, start + d))
    return out
