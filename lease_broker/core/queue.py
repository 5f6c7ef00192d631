"""The queue of requests waiting for GPUs, kept in scheduling order as requests arrive and leave.

Order: priority class (high first), then the user's fair-share score (lower first), then arrival. The score is
the one the user had when the request arrived; :meth:`Queue.rescore` re-sorts everything with fresh scores (the
broker's full pass does, every ``full_pass_seconds``). Adding and removing a request costs O(log n) comparisons
(and a memmove of the key list); the head, a request's position and the first request of each shape need no
pass over the queue, so an event's cost does not grow with the queue's depth.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Mapping

from .scheduler import Pending

Key = tuple[int, float, int]  # (-priority rank, fair-share score, arrival seq): unique (seq is)
Shape = tuple[bool, int, str, str, int]  # (shared, min GPUs, locality, GPU type, memory per GPU): requests of one
# shape need the same GPUs


def shape_of(p: Pending) -> Shape:
    r = p.request
    return (r.shared, 1 if r.shared else r.min_gpus, r.locality, r.gpu_type, r.gpu_mem)


class Queue:
    def __init__(self, ranks: Callable[[], Mapping[str, int]]) -> None:
        self._ranks = ranks  # the policy's priority ranks (read at each insert: a reload may change them)
        self._keys: list[Key] = []  # sorted
        self._by_seq: dict[int, Pending] = {}
        self._key_of: dict[str, Key] = {}  # lease id -> its key
        self._shapes: dict[Shape, list[Key]] = {}  # sorted keys of each shape

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, lease_id: object) -> bool:
        return lease_id in self._key_of

    def key(self, p: Pending, score: float) -> Key:
        return (-self._ranks().get(p.request.priority, 0), score, p.seq)

    def add(self, p: Pending, score: float) -> None:
        if p.lease_id in self._key_of:
            return
        k = self.key(p, score)
        self._key_of[p.lease_id] = k
        self._by_seq[p.seq] = p
        bisect.insort(self._keys, k)
        bisect.insort(self._shapes.setdefault(shape_of(p), []), k)

    def remove(self, lease_id: str) -> None:
        k = self._key_of.pop(lease_id, None)
        if k is None:
            return
        p = self._by_seq.pop(k[2])
        _discard(self._keys, k)
        shape = shape_of(p)
        keys = self._shapes[shape]
        _discard(keys, k)
        if not keys:
            del self._shapes[shape]

    def get(self, lease_id: str) -> Pending | None:
        k = self._key_of.get(lease_id)
        return None if k is None else self._by_seq[k[2]]

    def in_order(self, pending: list[Pending]) -> list[Pending]:
        """These queued requests (once each) in queue order."""
        unique = {p.lease_id: p for p in pending if p.lease_id in self._key_of}
        return sorted(unique.values(), key=lambda p: self._key_of[p.lease_id])

    def head(self, n: int) -> list[Pending]:
        return [self._by_seq[k[2]] for k in self._keys[:n]]

    def __iter__(self) -> Iterator[Pending]:
        return (self._by_seq[k[2]] for k in self._keys)

    def position(self, lease_id: str) -> int | None:
        """1-based place in the queue, or None when it is not queued."""
        k = self._key_of.get(lease_id)
        return None if k is None else bisect.bisect_left(self._keys, k) + 1

    def shape_heads(self, after: int) -> list[Pending]:
        """The first request of each shape that is not among the first ``after``: the best candidates deeper in
        the queue for GPUs that just freed (if the first of a shape does not fit, the others need the same)."""
        if after >= len(self._keys):
            return []
        last = self._keys[after - 1] if after > 0 else None
        out = []
        for keys in self._shapes.values():
            i = 0 if last is None else bisect.bisect_right(keys, last)
            if i < len(keys):
                out.append(self._by_seq[keys[i][2]])
        return self.in_order(out)

    def smallest_need(self) -> int | None:
        """The fewest whole GPUs any queued request needs (a shared request: 1); None when nothing waits."""
        return min((shape[1] for shape, keys in self._shapes.items() if keys), default=None)

    def rescore(self, score: Callable[[str], float]) -> None:
        """Re-sort every request with its user's current score (and the current priority ranks)."""
        pending = list(self._by_seq.values())
        self._keys, self._key_of, self._shapes = [], {}, {}
        ranks = self._ranks()  # once: the policy's traits cost a lookup each
        keyed = [((-ranks.get(p.request.priority, 0), score(p.user), p.seq), p) for p in pending]
        keyed.sort(key=lambda kp: kp[0])
        for k, p in keyed:
            self._key_of[p.lease_id] = k
            self._keys.append(k)
            self._shapes.setdefault(shape_of(p), []).append(k)


def _discard(keys: list[Key], k: Key) -> None:
    i = bisect.bisect_left(keys, k)
    if i < len(keys) and keys[i] == k:
        del keys[i]
