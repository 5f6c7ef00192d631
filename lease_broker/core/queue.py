"""The queue of requests waiting for GPUs, kept in scheduling order as requests arrive and leave.

Order: priority class (high first), then the user's fair-share score (lower first), then arrival. The requests
of one user in one class form a *bucket*, which takes its user's score when the user queues a request and at
:meth:`Queue.rescore` (the broker's full pass). The buckets of one class and score form a *tier*; a tier keeps the
arrivals of all its requests in one sorted list (``sortedcontainers.SortedList``), and one per shape, so users
that tie (new users at score 0, a course queued at a deadline) interleave by arrival in one list however many they
are. The tiers are sorted by (class, score), and each shape keeps the sorted keys of the tiers that hold it.

Costs, whatever the queue's depth and however many users tie: adding and removing a request, O(log n); the head,
lazily, O(log n) plus what is read; the first request of each shape after a given one, O(shapes x log n). A score
change moves a bucket: a bucket alone in its tier takes the tier along (O(shapes x log tiers)); one that leaves or
joins a tier of other users moves its own requests (O(its requests x log n)). :meth:`Queue.rescore` moves only the
buckets whose class rank or score changed. A place in the queue and a window deep in it cost O(tiers) to skip the
tiers before them: O(1) when the users waiting tie.

A suspended lease that wants its GPUs back (``Pending.resuming``) is queued like a request, in a bucket of its own
per class and user whose score is fixed at ``RESUMING`` (below every user's): the resuming leases of a class go
before its new requests, by their original arrival, at the same costs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

from sortedcontainers import SortedList

from .scheduler import Pending

Shape = tuple[bool, int, str, str, int]  # (shared, min GPUs, locality, GPU type, memory per GPU): requests of one
# shape need the same GPUs
TierKey = tuple[int, float]  # (-class rank, score)
RESUMING = float("-inf")  # the score of resuming leases' buckets: before every user's requests of their class


def shape_of(p: Pending) -> Shape:
    r = p.request
    shared = r.shared
    return (shared, 1 if shared else r.min_gpus, r.locality, r.gpu_type, r.gpu_mem)


class _Bucket:
    """One user's requests of one priority class (their arrivals, ``seq``), which share the user's score."""

    __slots__ = ("priority", "user", "rank", "score", "seqs", "resuming")

    def __init__(self, priority: str, user: str, rank: int, score: float, resuming: bool = False) -> None:
        self.priority, self.user, self.rank, self.score = priority, user, rank, score
        self.resuming = resuming  # resuming leases (score RESUMING, never re-scored)
        self.seqs: set[int] = set()

    @property
    def key(self) -> tuple[str, str]:
        """Its key in ``Queue._buckets``: (class, user); a resuming bucket's class is marked."""
        return ("\0" + self.priority if self.resuming else self.priority, self.user)

    @property
    def tier(self) -> TierKey:
        return (-self.rank, self.score)


class _Tier:
    """The requests of every bucket of one class and score, by arrival, and by shape and arrival."""

    __slots__ = ("key", "buckets", "seqs", "by_shape")

    def __init__(self, key: TierKey) -> None:
        self.key = key
        self.buckets = 0
        self.seqs = SortedList()
        self.by_shape: dict[Shape, SortedList] = {}


class Queue:
    def __init__(self, ranks: Callable[[], Mapping[str, int]]) -> None:
        self._ranks = ranks  # the policy's priority ranks (read for a new bucket and at rescore: a reload may change)
        self._by_seq: dict[int, Pending] = {}
        self._where: dict[str, tuple[_Bucket, Shape, int]] = {}  # lease id -> its bucket, shape and seq
        self._buckets: dict[tuple[str, str], _Bucket] = {}  # (priority, user) -> bucket
        self._tiers: dict[TierKey, _Tier] = {}
        self._order = SortedList()  # the tiers' keys
        self._shapes: dict[Shape, SortedList] = {}  # shape -> the keys of the tiers that hold requests of it
        self._users: dict[str, int] = {}  # user -> requests queued
        self._scored: set[tuple[str, str]] = set()  # the buckets whose score is not 0
        self._durations = SortedList()  # the queued requests' durations (``shortest``)
        self._ranks_seen: dict[str, int] = {}  # the ranks of the last rescore

    def __len__(self) -> int:
        return len(self._by_seq)

    def __contains__(self, lease_id: object) -> bool:
        return lease_id in self._where

    # ------------------------------------------------------------------ changes
    def add(self, p: Pending, score: float) -> None:
        """Queue ``p``; ``score``: its user's fair-share score now (its bucket takes it)."""
        if p.lease_id in self._where:
            return
        if p.resuming:
            score = RESUMING
        b = self._buckets.get(("\0" + p.request.priority if p.resuming else p.request.priority, p.user))
        if b is None:
            b = _Bucket(p.request.priority, p.user, self._ranks().get(p.request.priority, 0), score, p.resuming)
            self._buckets[b.key] = b
            self._tier(b.tier).buckets += 1
            if score and not p.resuming:
                self._scored.add(b.key)
        elif b.score != score:
            self._move(b, b.rank, score)
        shape = shape_of(p)
        b.seqs.add(p.seq)
        self._where[p.lease_id] = (b, shape, p.seq)
        self._by_seq[p.seq] = p
        self._durations.add(p.duration)
        self._put(self._tiers[b.tier], p.seq, shape)
        self._users[p.user] = self._users.get(p.user, 0) + 1

    def remove(self, lease_id: str) -> None:
        where = self._where.pop(lease_id, None)
        if where is None:
            return
        b, shape, seq = where
        p = self._by_seq.pop(seq)
        self._durations.remove(p.duration)
        t = self._tiers[b.tier]
        self._take(t, seq, shape)
        b.seqs.discard(seq)
        if not b.seqs:
            del self._buckets[b.key]
            self._scored.discard(b.key)
            self._leave(t)
        n = self._users[p.user]
        if n > 1:
            self._users[p.user] = n - 1
        else:
            del self._users[p.user]

    def rescore(self, score: Callable[[str], float], users: Iterable[str] | None = None) -> None:
        """Give the buckets their users' current scores (``score``) and the current
        priority ranks: only the buckets whose key changed move. ``users``: whose score may have left 0 since the
        last rescore (None: anyone's); the buckets of the others with a score of 0 keep it unread, so a full pass
        over many users who never used a GPU costs O(users with a score), not O(users)."""
        ranks = self._ranks()  # once: the policy's traits cost a lookup each
        buckets: Iterable[_Bucket]
        if users is None or ranks != self._ranks_seen:
            buckets = list(self._buckets.values())
        else:
            keys = {*self._scored, *((prio, u) for u in users for prio in ranks)}
            buckets = [b for k in keys if (b := self._buckets.get(k)) is not None]
        self._ranks_seen = dict(ranks)
        for b in buckets:
            rank, s = ranks.get(b.priority, 0), RESUMING if b.resuming else score(b.user)
            if rank != b.rank or s != b.score:
                self._move(b, rank, s)

    def _move(self, b: _Bucket, rank: int, score: float) -> None:
        old, new = b.tier, (-rank, score)
        t = self._tiers[old]
        b.rank, b.score = rank, score
        if score and not b.resuming:
            self._scored.add(b.key)
        else:
            self._scored.discard(b.key)
        if t.buckets == 1 and new not in self._tiers:  # alone: its tier moves along, its requests stay in it
            del self._tiers[old]
            self._order.remove(old)
            for shape in t.by_shape:
                self._shapes[shape].remove(old)
                self._shapes[shape].add(new)
            t.key, self._tiers[new] = new, t
            self._order.add(new)
            return
        to = self._tier(new)
        to.buckets += 1
        for seq in b.seqs:
            shape = self._where[self._by_seq[seq].lease_id][1]
            self._take(t, seq, shape)
            self._put(to, seq, shape)
        self._leave(t)

    def _tier(self, key: TierKey) -> _Tier:
        t = self._tiers.get(key)
        if t is None:
            t = self._tiers[key] = _Tier(key)
            self._order.add(key)
        return t

    def _leave(self, t: _Tier) -> None:
        """One bucket fewer in ``t`` (its requests gone): the tier goes with its last bucket."""
        t.buckets -= 1
        if not t.buckets:
            del self._tiers[t.key]
            self._order.remove(t.key)

    def _put(self, t: _Tier, seq: int, shape: Shape) -> None:
        t.seqs.add(seq)
        seqs = t.by_shape.get(shape)
        if seqs is None:
            seqs = t.by_shape[shape] = SortedList()
            self._shapes.setdefault(shape, SortedList()).add(t.key)
        seqs.add(seq)

    def _take(self, t: _Tier, seq: int, shape: Shape) -> None:
        t.seqs.remove(seq)
        seqs = t.by_shape[shape]
        seqs.remove(seq)
        if not seqs:
            del t.by_shape[shape]
            tiers = self._shapes[shape]
            tiers.remove(t.key)
            if not tiers:
                del self._shapes[shape]

    # ------------------------------------------------------------------ reading
    def get(self, lease_id: str) -> Pending | None:
        where = self._where.get(lease_id)
        return None if where is None else self._by_seq[where[2]]

    def users(self) -> set[str]:
        """Who has requests queued: O(users), not O(queue)."""
        return set(self._users)

    def scored_users(self) -> set[str]:
        """Who has requests queued at a score other than 0: O(them)."""
        return {user for _, user in self._scored}

    def queued_by(self, user: str) -> int:
        """How many requests ``user`` has queued: O(1)."""
        return self._users.get(user, 0)

    def all_exclusive(self) -> bool:
        """Whether no queued request is shared (each needs whole idle GPUs)."""
        return not any(shape[0] for shape in self._shapes)

    def shortest(self) -> float:
        """The shortest duration of any queued request (inf when nothing waits): O(1)."""
        return self._durations[0] if self._durations else float("inf")

    def smallest_need(self) -> int | None:
        """The fewest whole GPUs any queued request needs (a shared request: 1); None when nothing waits."""
        return min((shape[1] for shape in self._shapes), default=None)

    def __iter__(self) -> Iterator[Pending]:
        """Every request in queue order, lazily (a pass that stops early pays only for what it read; nothing changes
        the queue while a pass reads it: the manager applies grants after)."""
        by_seq, tiers = self._by_seq, self._tiers
        for key in self._order:
            for seq in tiers[key].seqs:
                yield by_seq[seq]

    def head(self, n: int) -> list[Pending]:
        out: list[Pending] = []
        for key in self._order:
            if len(out) >= n:
                break
            out.extend(self._by_seq[seq] for seq in self._tiers[key].seqs.islice(0, n - len(out)))
        return out

    def window(self, start: int, n: int) -> Iterator[Pending]:
        """The requests at places ``start`` to ``start + n - 1`` (0-based) in queue order, lazily; the tiers before
        ``start`` are skipped by their sizes: O(tiers) plus what is read."""
        skip = start
        for key in self._order:
            if n <= 0:
                return
            seqs = self._tiers[key].seqs
            if skip >= len(seqs):
                skip -= len(seqs)
                continue
            for seq in seqs.islice(skip, skip + n):
                n -= 1
                yield self._by_seq[seq]
            skip = 0

    def order_key(self, p: Pending) -> tuple[int, float, int]:
        """Sorts queued requests in queue order (as ``in_order`` does)."""
        b, _, seq = self._where[p.lease_id]
        return (-b.rank, b.score, seq)

    def position(self, lease_id: str) -> int | None:
        """1-based place in the queue, or None when it is not queued: O(tiers + log n)."""
        where = self._where.get(lease_id)
        if where is None:
            return None
        b, _, seq = where
        key = b.tier
        ahead = sum(len(self._tiers[k].seqs) for k in self._order.islice(0, self._order.bisect_left(key)))
        return ahead + self._tiers[key].seqs.bisect_left(seq) + 1

    def in_order(self, pending: list[Pending]) -> list[Pending]:
        """These queued requests (once each) in queue order."""
        unique = {p.lease_id: p for p in pending if p.lease_id in self._where}
        return sorted(unique.values(), key=self.order_key)

    def shape_heads(self, after: Pending | None) -> list[Pending]:
        """The first request of each shape that comes after ``after`` (None: from the start), in queue order: the
        best candidates deeper in the queue for GPUs that just freed (if the first of a shape does not fit, the
        others need the same). O(shapes x log n), whatever the queue's depth and the number of users."""
        where = None if after is None else self._where.get(after.lease_id)
        if after is not None and where is None:
            return []
        found: list[tuple[int, float, int]] = []
        for shape, tiers in self._shapes.items():
            i = 0
            if where is not None:
                key, seq = where[0].tier, where[2]
                seqs = self._tiers[key].by_shape.get(shape)
                if seqs is not None:
                    j = seqs.bisect_right(seq)
                    if j < len(seqs):
                        found.append((*key, seqs[j]))
                        continue
                i = tiers.bisect_right(key)
            if i < len(tiers):
                key = tiers[i]
                found.append((*key, self._tiers[key].by_shape[shape][0]))
        return [self._by_seq[k[2]] for k in sorted(found)]
