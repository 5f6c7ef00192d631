"""The queue of requests waiting for GPUs, kept in scheduling order as requests arrive and leave.

Order: priority class (high first), then the user's fair-share score (lower first), then arrival. The requests
of one user in one class wait in a *bucket*, in arrival order; the buckets are kept sorted by (class, score), and
buckets that tie (users with the same score, e.g. new users at 0) interleave by arrival. A bucket takes its user's
score when the user queues a request and at :meth:`Queue.rescore` (the broker's full pass, every
``full_pass_seconds``), which re-sorts the buckets, O(users log users), never the requests. Adding and removing a
request costs O(log n) plus O(users) when a bucket moves; the head and the first request of each shape are read
without a pass over the queue, and iterating is lazy, so an event's cost does not grow with the queue's depth.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Callable, Iterator, Mapping

from .scheduler import Pending

Shape = tuple[bool, int, str, str, int]  # (shared, min GPUs, locality, GPU type, memory per GPU): requests of one
# shape need the same GPUs


def shape_of(p: Pending) -> Shape:
    r = p.request
    shared = r.shared
    return (shared, 1 if shared else r.min_gpus, r.locality, r.gpu_type, r.gpu_mem)


class _Bucket:
    """One user's requests of one priority class, by arrival (``seq``), and by shape."""

    __slots__ = ("priority", "user", "rank", "score", "seqs", "by_shape")

    def __init__(self, priority: str, user: str, rank: int, score: float) -> None:
        self.priority, self.user, self.rank, self.score = priority, user, rank, score
        self.seqs: list[int] = []
        self.by_shape: dict[Shape, list[int]] = {}

    @property
    def key(self) -> tuple[int, float, str, str]:
        return (-self.rank, self.score, self.user, self.priority)


class Queue:
    def __init__(self, ranks: Callable[[], Mapping[str, int]]) -> None:
        self._ranks = ranks  # the policy's priority ranks (read for a new bucket and at rescore: a reload may change)
        self._by_seq: dict[int, Pending] = {}
        self._where: dict[str, tuple[_Bucket, Shape, int]] = {}  # lease id -> its bucket, shape and seq
        self._buckets: dict[tuple[str, str], _Bucket] = {}  # (priority, user) -> bucket
        self._order: list[_Bucket] = []  # sorted by key
        self._keys: list[tuple[int, float, str, str]] = []  # their keys
        self._groups: list[tuple[int, int]] | None = None  # (start, end) in _order of buckets that tie; None: stale
        self._group_of: dict[int, int] = {}  # id(bucket) -> index of its group (with _groups)
        self._shapes: dict[Shape, int] = {}  # shape -> requests queued
        self._users: dict[str, int] = {}  # user -> requests queued

    def __len__(self) -> int:
        return len(self._by_seq)

    def __contains__(self, lease_id: object) -> bool:
        return lease_id in self._where

    # ------------------------------------------------------------------ changes
    def add(self, p: Pending, score: float) -> None:
        """Queue ``p``; ``score``: its user's fair-share score now (its bucket takes it)."""
        if p.lease_id in self._where:
            return
        b = self._buckets.get((p.request.priority, p.user))
        if b is None:
            b = _Bucket(p.request.priority, p.user, self._ranks().get(p.request.priority, 0), score)
            self._buckets[(b.priority, b.user)] = b
            self._place(b)
        elif b.score != score:
            self._unplace(b)
            b.score = score
            self._place(b)
        shape = shape_of(p)
        _insort(b.seqs, p.seq)
        _insort(b.by_shape.setdefault(shape, []), p.seq)
        self._where[p.lease_id] = (b, shape, p.seq)
        self._by_seq[p.seq] = p
        self._shapes[shape] = self._shapes.get(shape, 0) + 1
        self._users[p.user] = self._users.get(p.user, 0) + 1

    def remove(self, lease_id: str) -> None:
        where = self._where.pop(lease_id, None)
        if where is None:
            return
        b, shape, seq = where
        p = self._by_seq.pop(seq)
        _discard(b.seqs, seq)
        seqs = b.by_shape[shape]
        _discard(seqs, seq)
        if not seqs:
            del b.by_shape[shape]
        if not b.seqs:
            self._unplace(b)
            del self._buckets[(b.priority, b.user)]
        _count_down(self._shapes, shape)
        _count_down(self._users, p.user)

    def rescore(self, score: Callable[[str], float]) -> None:
        """Give every bucket its user's current score (and the current priority ranks) and re-sort the buckets."""
        ranks = self._ranks()  # once: the policy's traits cost a lookup each
        for b in self._order:
            b.rank, b.score = ranks.get(b.priority, 0), score(b.user)
        self._order.sort(key=lambda b: b.key)
        self._keys = [b.key for b in self._order]
        self._groups = None

    def _place(self, b: _Bucket) -> None:
        k = b.key
        i = bisect.bisect_left(self._keys, k)
        self._keys.insert(i, k)
        self._order.insert(i, b)
        self._groups = None

    def _unplace(self, b: _Bucket) -> None:
        i = bisect.bisect_left(self._keys, b.key)
        del self._keys[i], self._order[i]
        self._groups = None

    # ------------------------------------------------------------------ reading
    def get(self, lease_id: str) -> Pending | None:
        where = self._where.get(lease_id)
        return None if where is None else self._by_seq[where[2]]

    def users(self) -> set[str]:
        """Who has requests queued: O(users), not O(queue)."""
        return set(self._users)

    def queued_by(self, user: str) -> int:
        """How many requests ``user`` has queued: O(1)."""
        return self._users.get(user, 0)

    def all_exclusive(self) -> bool:
        """Whether no queued request is shared (each needs whole idle GPUs)."""
        return not any(shape[0] for shape in self._shapes)

    def smallest_need(self) -> int | None:
        """The fewest whole GPUs any queued request needs (a shared request: 1); None when nothing waits."""
        return min((shape[1] for shape in self._shapes), default=None)

    def __iter__(self) -> Iterator[Pending]:
        """Every request in queue order, lazily (a pass that stops early pays only for what it read)."""
        by_seq = self._by_seq
        for start, end in self._tied():
            # (not copied: nothing changes the queue while a pass reads it; the manager applies grants after)
            if end - start == 1:
                seqs: Iterator[int] = iter(self._order[start].seqs)
            else:
                seqs = heapq.merge(*(b.seqs for b in self._order[start:end]))
            for seq in seqs:
                yield by_seq[seq]

    def head(self, n: int) -> list[Pending]:
        out: list[Pending] = []
        by_seq = self._by_seq
        for start, end in self._tied():
            if len(out) >= n:
                break
            if end - start == 1:  # one user's bucket: a slice
                out.extend(by_seq[seq] for seq in self._order[start].seqs[:n - len(out)])
                continue
            for seq in heapq.merge(*(b.seqs for b in self._order[start:end])):
                out.append(by_seq[seq])
                if len(out) >= n:
                    break
        return out

    def window(self, start: int, n: int) -> Iterator[Pending]:
        """The requests at places ``start`` to ``start + n - 1`` (0-based) in queue order, lazily; the users'
        buckets before ``start`` are skipped by their sizes, so the cost is O(users) plus what is read."""
        by_seq, skip = self._by_seq, start
        for first, end in self._tied():
            if n <= 0:
                return
            size = sum(len(b.seqs) for b in self._order[first:end])
            if skip >= size:
                skip -= size
                continue
            if end - first == 1:
                seqs: Iterator[int] = iter(self._order[first].seqs[skip:skip + n])
            else:
                seqs = itertools.islice(heapq.merge(*(b.seqs for b in self._order[first:end])), skip, skip + n)
            skip = 0
            for seq in seqs:
                n -= 1
                yield by_seq[seq]

    def order_key(self, p: Pending) -> tuple[int, int]:
        """Sorts queued requests in queue order (as ``in_order`` does)."""
        self._tied()
        return self._order_key(p)

    def position(self, lease_id: str) -> int | None:
        """1-based place in the queue, or None when it is not queued: O(users)."""
        where = self._where.get(lease_id)
        if where is None:
            return None
        b, _, seq = where
        groups = self._tied()
        gi = self._group_of[id(b)]
        ahead = sum(len(x.seqs) for x in self._order[:groups[gi][0]])
        start, end = groups[gi]
        ahead += sum(bisect.bisect_left(x.seqs, seq) for x in self._order[start:end])
        return ahead + 1

    def in_order(self, pending: list[Pending]) -> list[Pending]:
        """These queued requests (once each) in queue order."""
        self._tied()
        unique = {p.lease_id: p for p in pending if p.lease_id in self._where}
        return sorted(unique.values(), key=self._order_key)

    def shape_heads(self, after: Pending | None) -> list[Pending]:
        """The first request of each shape that comes after ``after`` (None: from the start), in queue order: the
        best candidates deeper in the queue for GPUs that just freed (if the first of a shape does not fit, the
        others need the same). O(users x shapes), whatever the queue's depth."""
        groups = self._tied()
        if after is None:
            gi, last = 0, -1
        else:
            where = self._where.get(after.lease_id)
            if where is None:
                return []
            gi, last = self._group_of[id(where[0])], where[2]
        missing = set(self._shapes)
        out: list[Pending] = []
        for start, end in groups[gi:]:
            found: dict[Shape, int] = {}
            for b in self._order[start:end]:
                for shape in missing.intersection(b.by_shape):
                    seqs = b.by_shape[shape]
                    i = bisect.bisect_right(seqs, last)
                    if i < len(seqs) and seqs[i] < found.get(shape, 1 << 62):
                        found[shape] = seqs[i]
            out.extend(self._by_seq[seq] for seq in found.values())
            missing.difference_update(found)
            last = -1  # later groups come after ``after`` entirely
            if not missing:
                break
        return sorted(out, key=self._order_key)

    def _order_key(self, p: Pending) -> tuple[int, int]:
        return (self._group_of[id(self._where[p.lease_id][0])], p.seq)

    def _tied(self) -> list[tuple[int, int]]:
        """(start, end) in the bucket order of each run of buckets with the same class and score."""
        if self._groups is None:
            groups: list[tuple[int, int]] = []
            self._group_of = {}
            keys = self._keys
            start = 0
            for i in range(1, len(keys) + 1):
                if i == len(keys) or keys[i][:2] != keys[start][:2]:
                    for b in self._order[start:i]:
                        self._group_of[id(b)] = len(groups)
                    groups.append((start, i))
                    start = i
            self._groups = groups
        return self._groups


def _insort(seqs: list[int], seq: int) -> None:
    if not seqs or seqs[-1] < seq:
        seqs.append(seq)  # the common case: requests arrive in seq order
    else:
        bisect.insort(seqs, seq)


def _discard(seqs: list[int], seq: int) -> None:
    i = bisect.bisect_left(seqs, seq)
    if i < len(seqs) and seqs[i] == seq:
        del seqs[i]


def _count_down(counts: dict[str, int] | dict[Shape, int], key: object) -> None:
    n = counts[key]  # type: ignore[index]
    if n > 1:
        counts[key] = n - 1  # type: ignore[index]
    else:
        del counts[key]  # type: ignore[arg-type]
