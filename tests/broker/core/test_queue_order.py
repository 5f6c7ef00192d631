"""The queue's one ordered structure against the order by definition: a plain sort of every queued request by
(class, its user's score, arrival), after any sequence of adds, removes and rescores (hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from lease_broker.core.lease import LeaseRequest
from lease_broker.core.queue import Queue, shape_of
from lease_broker.core.scheduler import Pending

RANKS = {"low": 0, "normal": 10, "high": 20}
USERS = [f"u{i}" for i in range(12)]
SCORES = st.sampled_from([0.0, 0.0, 1.0, 2.5])  # ties are the point: many users at one score

add = st.tuples(st.just("add"), st.sampled_from(USERS), st.sampled_from(list(RANKS)), st.sampled_from([1, 2, 8]),
                st.booleans(), SCORES)
remove = st.tuples(st.just("remove"), st.integers(0, 10_000))
rescore = st.tuples(st.just("rescore"), st.lists(SCORES, min_size=len(USERS), max_size=len(USERS)))


def pending(seq: int, user: str, priority: str, gpus: int, shared: bool) -> Pending:
    req = LeaseRequest(min_gpus=gpus, max_gpus=gpus, priority=priority, fraction=0.5 if shared else 1.0)
    return Pending(f"l{seq}", user, req, seq, 600.0)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(add, add, remove, rescore), max_size=80), st.data())
def test_every_read_matches_a_plain_sort(ops: list[tuple], data: st.DataObject) -> None:
    q = Queue(lambda: RANKS)
    live: dict[str, Pending] = {}
    score: dict[tuple[str, str], float] = {}  # (class, user) -> the score its bucket holds
    for seq, op in enumerate(ops):
        if op[0] == "add":
            _, user, priority, gpus, shared, s = op
            p = pending(seq, user, priority, gpus, shared)
            q.add(p, s)
            live[p.lease_id], score[(priority, user)] = p, s
        elif op[0] == "remove" and live:
            lid = sorted(live)[op[1] % len(live)]
            q.remove(lid)
            del live[lid]
        elif op[0] == "rescore":
            new = dict(zip(USERS, op[1], strict=True))
            q.rescore(new.__getitem__)
            score = {(c, u): new[u] for c, u in score}
    expected = sorted(live.values(), key=lambda p: (-RANKS[p.request.priority],
                                                    score[(p.request.priority, p.user)], p.seq))
    ids = [p.lease_id for p in expected]
    assert [p.lease_id for p in q] == ids and len(q) == len(ids)
    n = data.draw(st.integers(0, len(ids) + 2))
    assert [p.lease_id for p in q.head(n)] == ids[:n]
    start = data.draw(st.integers(0, len(ids) + 1))
    assert [p.lease_id for p in q.window(start, n)] == ids[start:start + n]
    assert [q.position(lid) for lid in ids] == list(range(1, len(ids) + 1))
    assert [p.lease_id for p in q.in_order(list(reversed(expected)))] == ids
    after = data.draw(st.sampled_from([None, *expected])) if expected else None
    rest = expected if after is None else expected[expected.index(after) + 1:]
    firsts: dict[object, str] = {}
    for p in rest:
        firsts.setdefault(shape_of(p), p.lease_id)
    assert [p.lease_id for p in q.shape_heads(after)] == list(firsts.values())
    assert q.users() == {p.user for p in expected}
