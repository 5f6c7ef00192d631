"""When a queued request will likely start, from what the holders of GPUs are likely to do.

Pure: the holders' likely ends, the GPUs, the requests ahead and the time are passed in; no I/O, no clock.

A holding lease's end is a small distribution (sorted possible end times), never past its time limit: an idle
lease ends at its idle deadline; an active one after the remaining time of similar leases that ran at least as
long as it has (:func:`remaining`: ``d - elapsed`` over the past durations ``d > elapsed``); with no such history,
the Lindy rule (about as long again as it has run). A queued request's start then comes from a greedy walk
(:func:`starts`) over samples of those ends: in each sample every holder ends at one of its possible ends and
every request ahead, in queue order, takes the GPUs where it can start first on one node (any GPUs with locality
``any``) for one of its possible durations, then the request itself; a short request may start on GPUs a request
ahead takes later if it ends first (the scheduler's backfill). Sampling each holder on its own matters: a gang
waits for the last of several holders to end, one GPU for the first. The samples give the range (10th to 90th
percentile) and the likely start: one within 2x of the most samples.

The walk knows the holders, not the people: a holder renews, comes back from a pause, a request ahead is
cancelled. :func:`calibrated` widens the walk's range by factors fitted on the replay so that the real start falls
inside the range shown in most cases (``WIDEN``), and :func:`wait_words` says that range in words, rounded outward,
once for every client (the view's ``estimate_text``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import zlib
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable, Mapping, Sequence

INF = math.inf
#: Past durations (beyond the elapsed time) a history level needs before it is used.
MIN_SAMPLES = 4
#: Samples of the holders' ends and the durations ahead that each estimate walks.
SAMPLES = 16
#: The quantiles of the sampled starts shown as the range.
RANGE = (0.1, 0.9)
#: Waits shorter than this many seconds are all "now" to a user (no estimate is finer).
TINY_WAIT = 30.0
#: The shown range: the walk's low wait divided by the first, its high wait times the second. Fitted on the replay
#: (``benchmarks/replay.py: estimates``; 2x8, idle 10m, default limits; the trace and 8 jittered copies pooled,
#: judged on the words shown): the narrowest factors tried with at least 80 % of real starts inside the words
#: (pooled 81 %, median width 22x; the trace alone 82 %, 20x). The walk's own 10th-90th percentile range held
#: 56 % (width 4x): the wait depends on people (renewals, pauses), which no holder model here foresees.
WIDEN = (1.5, 3.0)

Ends = tuple[float, ...]  # possible end times (or durations), sorted; one value: known


@dataclasses.dataclass(frozen=True)
class Span:
    """A time as a range: ``low <= likely <= high``."""

    low: float
    likely: float
    high: float

    @classmethod
    def exactly(cls, t: float) -> Span:
        return cls(t, t, t)


def remaining(durations: Iterable[float], elapsed: float, min_samples: int = MIN_SAMPLES) -> Ends | None:
    """How much longer something that has run ``elapsed`` seconds will run, from the durations of similar past
    ones that ran longer (the conditional remaining time); None when fewer than ``min_samples`` did."""
    left = tuple(sorted(d - elapsed for d in durations if d > elapsed))
    return left if len(left) >= max(1, min_samples) else None


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

    def remaining(self, keys: Iterable[Hashable], elapsed: float,
                  running: Mapping[Hashable, Sequence[float]] | None = None) -> Ends | None:
        """The remaining time from the most specific key with enough durations beyond ``elapsed``. ``running``:
        how long the leases of each key that still hold have run so far; they count as durations at least that
        long (otherwise the long ones, still running, would be missing and every estimate too short)."""
        for key in keys:
            now_running = running.get(key, ()) if running is not None else ()
            left = remaining([*self.get(key), *now_running], elapsed)
            if left is not None:
                return left
        return None

    def __len__(self) -> int:
        return len(self._by_key)


def holder_end(now: float, *, granted_at: float, expires_at: float | None, idle_deadline: float | None,
               remaining_time: Ends | None) -> Ends:
    """When a holding lease will likely end: its idle deadline while it is idle; else ``now`` plus the
    remaining time of similar leases (None, none ran as long: as long again as it has run, the Lindy rule,
    from half that to twice that, at least a minute); never past its time limit ``expires_at``, never before ``now``."""
    if idle_deadline is not None:
        ends: Iterable[float] = (idle_deadline,)
    elif remaining_time is not None:
        ends = (now + r for r in remaining_time)
    else:
        ran = max(now - granted_at, 60.0)
        ends = (now + ran / 2, now + ran, now + 2 * ran)
    limit = INF if expires_at is None else expires_at
    return tuple(sorted(max(now, min(t, limit)) for t in ends))


@dataclasses.dataclass(frozen=True)
class Need:
    """A queued request as the walk sees it: whole GPUs (``gpus``; a shared request counts as one), on one
    node (``locality`` "node") or any, held for one of ``durations`` once started; ``key`` names it in the
    sampling (a stable id); ``only``: the GPUs it may get (a GPU type or memory size; None: any)."""

    gpus: int
    locality: str = "node"
    durations: Ends = (0.0,)
    key: str = ""
    only: frozenset[str] | None = None


def starts(now: float, nodes: Mapping[str, Sequence[str]], holders: Mapping[str, Sequence[str]],
           ends: Mapping[str, Ends], queue: Sequence[Need], samples: int = SAMPLES) -> list[Span | None]:
    """The likely start of each request of ``queue`` (in queue order), None where it cannot fit.

    ``nodes``: node -> its GPU ids; ``holders``: GPU id -> the ids of what holds it (absent: free now);
    ``ends``: holder id -> its possible ends (``(INF,)``: never). ``ends`` is read only for GPUs a walk must
    compare (a node with enough GPUs free now needs none), so it may compute lazily. The samples are
    stratified: each holder and each request gets every quantile once, in its own order (from its id), so the
    result depends on the inputs only."""
    n = max(1, samples)
    free_now = {node: [g for g in members if g not in holders] for node, members in nodes.items()}
    held = _held(nodes, holders)
    walks = [_walk(now, nodes, free_now, held, ends, queue, j, n) for j in range(n)]
    out: list[Span | None] = []
    for i in range(len(queue)):
        got = sorted(w[i] - now for w in walks)
        if got[-1] == INF:  # it cannot fit in some samples (a GPU that never frees): no estimate
            out.append(None)
            continue
        low, likely, high = _quantile(got, RANGE[0]), likely_wait(got), _quantile(got, RANGE[1])
        out.append(Span(now + min(low, likely), now + likely, now + max(high, likely)))
    return out


def calibrated(span: Span, now: float, widen: tuple[float, float] = WIDEN) -> Span:
    """The range to show for a walk's ``span``: its waits from ``now`` widened by ``widen`` (``WIDEN``); the likely
    start stays."""
    low, high = max(0.0, span.low - now), max(0.0, span.high - now)
    return Span(now + low / widen[0], span.likely, now + high * widen[1])


#: The rungs a wait in words is rounded to, in seconds: minutes, then hours, then days.
_MIN, _HOUR, _DAY = 60.0, 3600.0, 86400.0
RUNGS = (*(m * _MIN for m in (1, 2, 3, 4, 5, 6, 8, 10, 15, 20, 30, 45)),
         *(h * _HOUR for h in (1, 1.5, 2, 3, 4, 5, 6, 8, 10, 12, 18)),
         *(d * _DAY for d in (1, 1.5, 2, 3, 4, 5, 7, 10, 14, 21, 30)))


@dataclasses.dataclass(frozen=True)
class Words:
    """A wait in words and the range of seconds the words say (``high`` INF: open-ended)."""

    text: str
    low: float
    high: float


def _rung(seconds: float) -> str:
    if seconds < _HOUR:
        return f"{seconds / _MIN:g} min"
    if seconds < 1.5 * _DAY:
        return f"{seconds / _HOUR:g} h"
    return f"{seconds / _DAY:g} days"


def _unit(text: str) -> tuple[str, str]:
    number, unit = text.split(" ")
    return number, unit


def wait_words(low: float, high: float) -> Words:
    """A wait of ``low`` to ``high`` seconds from now in words, rounded outward to ``RUNGS`` so that the words
    hold the whole range: "in 1–3 min", "in 45 min–2 h", "within 5 min" (from now), "in under a minute", "in about
    20 min" (a point: a known time, the nearest rung), "in over 30 days"; "unknown" when it may be any time."""
    low, high = max(0.0, low), max(0.0, low, high)
    if high == low:  # a point: the nearest rung
        if high < TINY_WAIT:
            return Words("now", 0.0, 0.0)
        near = min(RUNGS, key=lambda r: abs(r - high))
        return Words(f"in about {_rung(near)}", high, high)
    if high > RUNGS[-1]:
        below = max((r for r in RUNGS if r <= low), default=0.0)
        return Words(f"in over {_rung(below)}" if below else "unknown", below, INF)
    up = min(r for r in RUNGS if r >= high)
    down = max((r for r in RUNGS if r <= low), default=0.0)
    if down == 0.0:
        return Words("in under a minute" if up == _MIN else f"within {_rung(up)}", 0.0, up)
    (lo, lo_unit), (hi, hi_unit) = _unit(_rung(down)), _unit(_rung(up))
    text = f"in {lo}–{hi} {hi_unit}" if lo_unit == hi_unit else f"in {lo} {lo_unit}–{hi} {hi_unit}"
    return Words(text, down, up)


def start_text(span: Span | None, planned: float | None, now: float) -> str:
    """The words every client shows for a queued request's start (the view's ``estimate_text``): its shown range
    (``calibrated``) when the broker walked it; else the scheduler's plan from the holders' time limits, a point;
    else "unknown"."""
    if span is not None:
        return wait_words(span.low - now, span.high - now).text
    if planned is not None:
        return wait_words(planned - now, planned - now).text
    return "unknown"


def likely_wait(waits: Sequence[float], tiny: float = TINY_WAIT) -> float:
    """The wait within 2x of the most of these sorted sample waits (waits under ``tiny`` count as ``tiny``, and a
    likely wait that short is 0): in the fullest window [w, 4w], its last sample or 2w if sooner, the latest wait
    within 2x of all of it (the samples lean early: holders renew, later requests may go first)."""
    xs = [max(w, tiny) for w in waits]
    best, at, j = 0, xs[0], 0
    for i, x in enumerate(xs):
        j = max(j, i)
        while j + 1 < len(xs) and xs[j + 1] <= 4 * x:
            j += 1
        if j - i + 1 > best:
            best, at = j - i + 1, min(2 * x, xs[j])
    return 0.0 if at <= tiny and waits[len(waits) // 2] < tiny else at


def _quantile(xs: Sequence[float], q: float) -> float:
    pos = (len(xs) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _pick(values: Ends, key: str, j: int, n: int) -> float:
    """Sample ``j`` of ``n`` of ``values``: stratum ``j``, rotated by an offset of the key's own (stable across
    runs, unlike ``hash``), so that holders are not all at the same quantile in one sample."""
    if len(values) == 1:
        return values[0]
    u = ((j + 0.5) / n + _offset(key)) % 1.0
    return values[min(int(u * len(values)), len(values) - 1)]


@functools.lru_cache(maxsize=4096)
def _offset(key: str) -> float:
    """A key's own rotation of the strata (``_pick``), computed once per key rather than once per sample."""
    return (zlib.crc32(key.encode()) % 1009) / 1009.0


def _held(nodes: Mapping[str, Sequence[str]], holders: Mapping[str, Sequence[str]]) -> dict[str, Sequence[str]]:
    """``holders`` read once into a plain dict for all the samples of a walk (``starts``): the broker's holders
    are a Mapping that computes every lookup, and the walk looks up the same GPUs in each sample. With the
    inlined GPU test of ``_walk`` (and its bound: no start before k GPUs are ready) and ``_offset``, the walks of
    the 3,000-job version of the overloaded month replay (benchmarks/replay_month.py) went from 0.83 s to 0.58 s
    of CPU on the same inputs, every estimate the same (the month itself walks 63 times: 0.6 s)."""
    return {g: holders.get(g, ()) for members in nodes.values() for g in members if g in holders}


def _walk(now: float, nodes: Mapping[str, Sequence[str]], free_now: Mapping[str, Sequence[str]],
          holders: Mapping[str, Sequence[str]], ends: Mapping[str, Ends], queue: Sequence[Need], j: int,
          n: int) -> list[float]:
    """One sample: each request in turn gets the GPUs where it can start first and run its duration without
    overlapping what the requests before it got. ``free_now``: each node's GPUs that nothing holds."""
    busy: dict[str, list[tuple[float, float]]] = {}  # GPU -> the (start, end) the walk gave it to so far
    touched: set[str] = set()  # nodes with GPUs the walk gave away
    ended: dict[str, float] = {}  # holder -> its end in this sample
    base: dict[str, float] = {}
    kth: dict[str, list[float]] = {}  # an untouched node's GPUs' free times, sorted

    def ready(g: str) -> float:
        r = base.get(g)
        if r is None:
            r = now
            for h in holders.get(g, ()):
                t = ended.get(h)
                if t is None:
                    t = ended[h] = max(now, _pick(ends[h], h, j, n))
                r = max(r, t)
            base[g] = r
        return r

    out = []
    for need in queue:
        k, d = max(1, need.gpus), max(_pick(need.durations, need.key or "?", j, n), 0.0)
        groups: Iterable[tuple[str, Sequence[str]]] = nodes.items()
        if need.locality == "any":
            groups = [("", [g for members in nodes.values() for g in members])]
        best: tuple[float, Sequence[str], str] = (INF, (), "")
        for node, members in groups:
            if need.only is not None:
                members = [g for g in members if g in need.only]
            if len(members) < k:
                continue
            # the walk gave none of the node's GPUs away yet (and the request may have any of them)
            untouched = bool(node) and node not in touched and need.only is None
            # a GPU nothing holds is ready now: free now unless a request ahead has it then (inlined: hot)
            until = now + d
            now_free = free_now[node] if untouched else [
                g for g in members if g not in holders
                and ((b := busy.get(g)) is None or all(e <= now or s >= until for s, e in b))]
            if len(now_free) >= k:  # nothing starts sooner: the other GPUs' ends need not be known
                best = (now, now_free[:k], node)
                break
            if untouched:  # the k-th GPU to free
                times = kth.get(node)
                if times is None:
                    times = kth[node] = sorted(ready(g) for g in members)
                if times[k - 1] < best[0]:
                    best = (times[k - 1], sorted(members, key=ready)[:k], node)
                continue
            readies = [ready(g) for g in members]
            first = sorted(readies)[k - 1]  # no start before k of its GPUs are ready
            if first >= best[0]:
                continue
            for t in sorted({*readies} | {e for g in members for _, e in busy.get(g, ())}):
                if t < first:
                    continue
                if t >= best[0]:
                    break
                until = t + d  # free at t for d: ready by t, and no request ahead has it in [t, t + d)
                fit = [g for g, r in zip(members, readies, strict=True) if r <= t
                       and ((b := busy.get(g)) is None or all(e <= t or s >= until for s, e in b))]
                if len(fit) >= k:
                    best = (t, fit[:k], node)
                    break
        start, chosen, node = best
        out.append(start)
        for g in chosen:
            busy.setdefault(g, []).append((start, start + d))
        if chosen:
            touched.update(_nodes_of(nodes, chosen) if not node else (node,))
    return out


def _nodes_of(nodes: Mapping[str, Sequence[str]], gpus: Sequence[str]) -> set[str]:
    """The nodes of these GPUs."""
    want = set(gpus)
    return {node for node, members in nodes.items() if want.intersection(members)}
