"""The queue's order, kept per (class, user) bucket: what every pass reads (head, shape heads, positions)."""

from __future__ import annotations

import random

from lease_broker.core.lease import LeaseRequest
from lease_broker.core.queue import Queue, shape_of
from lease_broker.core.scheduler import Pending

RANKS = {"low": 0, "normal": 10, "high": 20}


def pending(seq: int, user: str, gpus: int = 1, priority: str = "normal", fraction: float = 1.0) -> Pending:
    req = LeaseRequest(min_gpus=gpus, max_gpus=gpus, priority=priority, fraction=fraction)
    return Pending(f"l{seq}", user, req, seq, 600.0)


def reference(items: list[tuple[Pending, float]]) -> list[str]:
    """The order by definition: class, then the user's score, then arrival."""
    return [p.lease_id for p, s in sorted(items, key=lambda ps: (-RANKS[ps[0].request.priority], ps[1], ps[0].seq))]


def test_order_is_class_then_score_then_arrival_and_ties_interleave():
    q = Queue(lambda: RANKS)
    items = [(pending(1, "a"), 5.0), (pending(2, "b"), 0.0), (pending(3, "c"), 0.0), (pending(4, "b"), 0.0),
             (pending(5, "a", priority="high"), 5.0), (pending(6, "c"), 0.0), (pending(7, "d", priority="low"), 0.0)]
    for p, s in items:
        q.add(p, s)
    assert [p.lease_id for p in q] == reference(items) == ["l5", "l2", "l3", "l4", "l6", "l1", "l7"]
    assert [q.position(p.lease_id) for p, _ in items] == [6, 2, 3, 4, 1, 5, 7]
    assert q.position("l5") == 1 and q.position("l2") == 2 and q.position("l6") == 5 and q.position("l7") == 7
    assert q.head(3) == [q.get("l5"), q.get("l2"), q.get("l3")]
    assert len(q) == 7 and q.users() == {"a", "b", "c", "d"}


def test_rescore_moves_users_not_requests_and_a_new_request_takes_its_users_score():
    q = Queue(lambda: RANKS)
    for seq, user in enumerate(["a", "b", "a", "b"], 1):
        q.add(pending(seq, user), {"a": 1.0, "b": 2.0}[user])
    assert [p.lease_id for p in q] == ["l1", "l3", "l2", "l4"]
    q.rescore({"a": 3.0, "b": 2.0}.__getitem__)
    assert [p.lease_id for p in q] == ["l2", "l4", "l1", "l3"]
    q.add(pending(5, "a"), 0.5)  # a's usage decayed: all of a's requests go first, in arrival order
    assert [p.lease_id for p in q] == ["l1", "l3", "l5", "l2", "l4"]
    assert q.position("l4") == 5


def test_shape_heads_are_the_first_of_each_shape_after_the_head():
    q = Queue(lambda: RANKS)
    q.add(pending(1, "a", gpus=8), 0.0)
    q.add(pending(2, "a", gpus=8), 0.0)
    q.add(pending(3, "b", gpus=1), 1.0)
    q.add(pending(4, "c", gpus=4), 2.0)
    q.add(pending(5, "b", gpus=1), 1.0)
    q.add(pending(6, "c", fraction=0.5), 0.0)  # shared: c's score is now 0 (c moves ahead, tied with a)
    head = q.head(1)
    assert [p.lease_id for p in q] == ["l1", "l2", "l4", "l6", "l3", "l5"]
    assert [p.lease_id for p in q.shape_heads(head[-1])] == ["l2", "l4", "l6", "l3"]
    assert [p.lease_id for p in q.shape_heads(q.get("l6"))] == ["l3"]
    assert q.smallest_need() == 1 and not q.all_exclusive()
    q.remove("l6")
    assert q.all_exclusive() and shape_of(q.get("l4")) == (False, 4, "node", "", 0)


def test_random_changes_keep_the_order_by_definition():
    rng = random.Random(5)
    q = Queue(lambda: RANKS)
    live: dict[str, tuple[Pending, float]] = {}
    scores = {u: 0.0 for u in "abcdef"}
    for seq in range(1, 3000):
        roll = rng.random()
        if roll < 0.55 or not live:
            user = rng.choice("abcdef")
            scores[user] = rng.choice([0.0, 1.0, 2.0, rng.random()])
            p = pending(seq, user, gpus=rng.choice([1, 2, 4, 8]), priority=rng.choice(list(RANKS)))
            q.add(p, scores[user])
            live[p.lease_id] = (p, scores[user])
            for lid, (other, _) in live.items():  # a bucket takes its user's latest score
                if other.user == user and other.request.priority == p.request.priority:
                    live[lid] = (other, scores[user])
        elif roll < 0.95:
            lid = rng.choice(sorted(live))
            q.remove(lid)
            del live[lid]
        else:
            scores = {u: rng.choice([0.0, 1.0, rng.random()]) for u in scores}
            q.rescore(scores.__getitem__)
            live = {lid: (p, scores[p.user]) for lid, (p, _) in live.items()}
        if seq % 97 == 0:
            expected = reference(list(live.values()))
            assert [p.lease_id for p in q] == expected
            assert [p.lease_id for p in q.head(10)] == expected[:10]
            start = rng.randrange(len(expected) + 1)
            assert [p.lease_id for p in q.window(start, 25)] == expected[start:start + 25]
            for lid in rng.sample(expected, min(5, len(expected))):
                assert q.position(lid) == expected.index(lid) + 1
    assert len(q) == len(live)
