"""Small requests first (``SchedulerPolicy.small_first_gpus``), table by table: a one-GPU cell goes before a gang
that waits for a whole node, until the gang has waited ``small_first_timeout``; priority classes still come first."""

from __future__ import annotations

import pytest

from lease_broker.core.lease import LeaseRequest
from lease_broker.core.scheduler import Pending, SchedulerPolicy, Slot, schedule
from lease_broker.core.small_first import small_first, small_need

NOW = 10_000.0
SMALL = SchedulerPolicy(small_first_gpus=1, small_first_timeout=3600.0)


def node(n: int = 4, busy: int = 2, until: float = NOW + 100) -> list[Slot]:
    out = [Slot(id=f"n/{i}", node="n", index=i, memory_total=80 << 30) for i in range(n)]
    for s in out[:busy]:
        s.exclusive, s.free_at = True, until
    return out


def req(lid: str, n: int, seq: int, queued_at: float = NOW, duration: float = 600, **kw) -> Pending:
    return Pending(lid, "u" + lid, LeaseRequest(min_gpus=n, max_gpus=n, **kw), seq, duration, queued_at)


def test_off_the_gang_keeps_the_gpus_it_waits_for():
    # two GPUs busy until +100: the 4-GPU gang reserves all four from +100; a 1-GPU cell of 600 s would delay it
    pend = [req("gang", 4, 1), req("cell", 1, 2)]
    d = schedule(pend, node(), {}, SchedulerPolicy(), NOW)
    assert d.grants == []
    assert d.planned_start["gang"] == pytest.approx(NOW + 100)


def test_small_cell_goes_before_a_gang_that_has_not_waited_long():
    pend = [req("gang", 4, 1, queued_at=NOW - 60), req("cell", 1, 2)]
    d = schedule(pend, node(), {}, SMALL, NOW)
    assert [g.lease_id for g in d.grants] == ["cell"]
    # the gang is planned after the cell: the GPUs that free last bound its start
    assert d.planned_start["gang"] == pytest.approx(NOW + 600)


def test_a_gang_that_waited_small_first_timeout_keeps_its_place():
    pend = [req("gang", 4, 1, queued_at=NOW - 3600), req("cell", 1, 2)]
    d = schedule(pend, node(), {}, SMALL, NOW)
    assert d.grants == []
    assert d.planned_start["gang"] == pytest.approx(NOW + 100)


def test_priority_class_comes_before_size():
    pend = [req("gang", 4, 1, priority="high"), req("cell", 1, 2, priority="normal")]
    d = schedule(pend, node(), {}, SMALL, NOW)
    assert d.grants == []  # a normal cell never passes a high gang
    order = [p.lease_id for p in small_first([req("g", 4, 1), req("c", 1, 2, priority="low"), req("d", 1, 3)],
                                             SMALL, NOW)]
    assert order == ["d", "g", "c"]


def test_small_first_keeps_arrival_order_within_each_tier():
    pend = [req("g1", 4, 1), req("c1", 1, 2), req("g2", 8, 3, queued_at=NOW - 7200), req("c2", 1, 4),
            req("s", 1, 5, fraction=0.5)]
    order = [p.lease_id for p in small_first(pend, SMALL, NOW)]
    assert order == ["c1", "g2", "c2", "s", "g1"]  # the aged gang g2 keeps its place among the small ones
    assert [p.lease_id for p in small_first(pend, SchedulerPolicy(), NOW)] == ["g1", "c1", "g2", "c2", "s"]


def test_only_the_first_gang_that_waited_long_keeps_its_place():
    pend = [req("g1", 4, 1, queued_at=NOW - 7200), req("g2", 8, 2, queued_at=NOW - 7200), req("c", 1, 3)]
    assert [p.lease_id for p in small_first(pend, SMALL, NOW)] == ["g1", "c", "g2"]
    # once g1 started, g2 is the one that keeps its place
    assert [p.lease_id for p in small_first(pend[1:], SMALL, NOW)] == ["g2", "c"]


@pytest.mark.parametrize(
    ("head", "smallest", "need"),
    [
        (req("g", 8, 1), 1, 1),  # a one-GPU cell goes first: an idle lease's GPU serves it
        (req("g", 8, 1, queued_at=NOW - 3600), 1, 8),  # the gang waited long enough: it is the one served
        (req("g", 8, 1), 4, 8),  # nothing small waits
        (req("c", 1, 1), 1, 1),
        (req("g", 8, 1), None, 8),
    ],
)
def test_the_need_the_pressure_idle_timeout_serves(head: Pending, smallest: int | None, need: int):
    assert small_need(head, smallest, SMALL.small_first_gpus, SMALL.small_first_timeout, NOW) == need
    assert small_need(head, smallest, 0, 3600.0, NOW) == (1 if head.request.min_gpus == 1 else 8)


def _gang_start(timeout: float, horizon: float = 6 * 3600.0) -> float | None:
    """A 4-GPU gang queued at NOW on one 4-GPU node while a one-GPU cell of 600 s arrives every 150 s (enough to
    keep the node busy for ever): passes at every arrival and end, grants applied. When the gang started, or None."""
    policy = SchedulerPolicy(small_first_gpus=1, small_first_timeout=timeout)
    gpus = node(4, busy=0)
    ends: dict[str, float] = {}  # GPU -> when its cell ends
    queue = [req("gang", 4, 0, queued_at=NOW)]
    t, seq = NOW, 1
    while t <= NOW + horizon:
        for s in gpus:
            if s.id in ends and ends[s.id] <= t:
                del ends[s.id]
                s.exclusive, s.free_at = False, 0.0
        queue.append(req(f"c{seq}", 1, seq, queued_at=t))
        seq += 1
        d = schedule(queue, [s.clone() for s in gpus], {}, policy, t)
        for g in d.grants:
            if g.lease_id == "gang":
                return t
            for gid in g.gpu_ids:
                s = next(x for x in gpus if x.id == gid)
                s.exclusive, s.free_at = True, t + 600
                ends[gid] = t + 600
        granted_ids = {g.lease_id for g in d.grants}
        queue = [p for p in queue if p.lease_id not in granted_ids]
        t += 150
    return None


def test_a_gang_passed_over_by_a_stream_of_cells_still_starts():
    start = _gang_start(timeout=1800.0)
    assert start is not None and start - NOW <= 1800 + 600 + 150  # the timeout, one cell's limit, one step
    assert _gang_start(timeout=1e9) is None  # without the timeout the stream would starve it
