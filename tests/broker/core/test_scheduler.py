"""The pure scheduler, table by table: no I/O, no clock, no sleeping."""

from __future__ import annotations

import pytest

from lease_broker.core.lease import LeaseRequest
from lease_broker.core.scheduler import Pending, SchedulerPolicy, Slot, pick_connected, queue_order, schedule

NOW = 1000.0


def slots(layout: dict[str, int], group: int = 4) -> list[Slot]:
    out = []
    for node, n in layout.items():
        for i in range(n):
            out.append(Slot(id=f"{node}/{i}", node=node, index=i, link_group=f"{node}/g{i // group}",
                            memory_total=80 << 30))
    return out


def req(lid: str, n: int | str = 1, user: str = "u", seq: int = 0, duration: float = 600, **kw) -> Pending:
    if isinstance(n, str):
        lo, hi = (int(x) for x in n.split("-"))
    else:
        lo = hi = n
    return Pending(lid, user, LeaseRequest(min_gpus=lo, max_gpus=hi, **kw), seq, duration)


def hold(s: list[Slot], ids: list[str], until: float) -> None:
    for sl in s:
        if sl.id in ids:
            sl.exclusive = True
            sl.free_at = until


def granted(decision) -> dict[str, tuple[str, ...]]:
    return {g.lease_id: g.gpu_ids for g in decision.grants}


def test_grants_in_arrival_order_until_full():
    d = schedule([req("a", 2, seq=1), req("b", 1, seq=2), req("c", 2, seq=3)], slots({"n": 4}), {}, SchedulerPolicy(), NOW)
    g = granted(d)
    assert set(g) == {"a", "b"}
    assert len(set(g["a"]) | set(g["b"])) == 3  # distinct devices


def test_priority_before_arrival():
    pending = [req("low", 1, seq=1, priority="low"), req("high", 1, seq=2, priority="high")]
    d = schedule(pending, slots({"n": 1}), {}, SchedulerPolicy(backfill_depth=0), NOW)
    assert list(granted(d)) == ["high"]
    assert [p.lease_id for p in queue_order(pending, SchedulerPolicy())] == ["high", "low"]


def test_gang_is_all_or_nothing_and_on_one_node():
    # 2 free on each node: a 3-GPU gang fits nowhere with locality=node, holds nothing
    s = slots({"a": 2, "b": 2})
    d = schedule([req("gang", 3, seq=1)], s, {}, SchedulerPolicy(), NOW)
    assert d.grants == []


def test_gang_with_locality_any_spans_nodes():
    d = schedule([req("gang", 3, seq=1, locality="any")], slots({"a": 2, "b": 2}), {}, SchedulerPolicy(), NOW)
    (g,) = d.grants
    assert len(g.gpu_ids) == 3 and {i.split("/")[0] for i in g.gpu_ids} == {"a", "b"}


def test_gang_placed_where_it_fits_per_node_not_by_count():
    s = slots({"a": 4, "b": 4})
    hold(s, ["a/0", "a/1", "b/0"], NOW + 100)  # a has 2 free, b has 3 free
    d = schedule([req("gang", 3, seq=1)], s, {}, SchedulerPolicy(), NOW)
    (g,) = d.grants
    assert all(i.startswith("b/") for i in g.gpu_ids)


def test_best_fit_node_keeps_big_holes():
    s = slots({"a": 4, "b": 4})
    hold(s, ["a/0", "a/1", "a/2"], NOW + 100)  # a has 1 free, b has 4
    d = schedule([req("one", 1, seq=1)], s, {}, SchedulerPolicy(), NOW)
    assert d.grants[0].gpu_ids == ("a/3",)


def test_gang_prefers_one_link_group():
    s = slots({"n": 8}, group=4)
    hold(s, ["n/0"], NOW + 100)  # group 0 has 3 free, group 1 has 4
    d = schedule([req("g", 4, seq=1)], s, {}, SchedulerPolicy(), NOW)
    assert d.grants[0].gpu_ids == ("n/4", "n/5", "n/6", "n/7")


def test_pick_connected_falls_back_to_fewest_groups():
    s = slots({"n": 8}, group=2)
    chosen = pick_connected([x for x in s if x.index in (0, 2, 3, 5, 6, 7)], 3)
    assert {x.link_group for x in chosen} <= {"n/g1", "n/g3"} and len(chosen) == 3


def test_user_cap_skips_without_blocking_others():
    pol = SchedulerPolicy(user_cap=lambda u: 2.0 if u == "greedy" else 0.0)
    d = schedule([req("g1", 2, user="greedy", seq=1), req("g2", 1, user="greedy", seq=2), req("o", 1, user="other", seq=3)],
                 slots({"n": 4}), {}, pol, NOW)
    assert set(granted(d)) == {"g1", "o"}


def test_user_cap_counts_what_is_already_held():
    pol = SchedulerPolicy(user_cap=lambda u: 2.0)
    d = schedule([req("x", 1, user="u", seq=1)], slots({"n": 4}), {"u": 2.0}, pol, NOW)
    assert d.grants == []


def test_incremental_gets_what_is_free_up_to_max():
    s = slots({"n": 4})
    hold(s, ["n/0"], NOW + 100)
    d = schedule([req("inc", "1-4", seq=1)], s, {}, SchedulerPolicy(), NOW)
    assert len(d.grants[0].gpu_ids) == 3


def test_incremental_waits_below_min():
    s = slots({"n": 4})
    hold(s, ["n/0", "n/1", "n/2"], NOW + 100)
    d = schedule([req("inc", "2-4", seq=1)], s, {}, SchedulerPolicy(), NOW)
    assert d.grants == []


def test_backfill_small_job_that_ends_before_reservation():
    s = slots({"n": 4})
    hold(s, ["n/0", "n/1"], NOW + 100)  # two busy until +100; big gang of 4 must wait
    pend = [req("big", 4, seq=1, duration=600), req("short", 1, seq=2, duration=50), req("long", 1, seq=3, duration=500)]
    d = schedule(pend, s, {}, SchedulerPolicy(), NOW)
    assert set(granted(d)) == {"short"}  # long would delay the big gang
    assert d.planned_start["big"] == pytest.approx(NOW + 100)


def test_no_backfill_means_plain_priority_order_can_starve():
    s = slots({"n": 4})
    hold(s, ["n/0", "n/1"], NOW + 100)
    pend = [req("big", 4, seq=1), req("long", 1, seq=2, duration=500)]
    d = schedule(pend, s, {}, SchedulerPolicy(backfill_depth=0), NOW)
    assert set(granted(d)) == {"long"}


def test_draining_gpu_is_not_granted():
    s = slots({"n": 1})
    s[0].available = False
    s[0].free_at = NOW + 5
    d = schedule([req("a", 1, seq=1)], s, {}, SchedulerPolicy(), NOW)
    assert d.grants == [] and d.planned_start["a"] == NOW + 5


def test_shared_leases_pack_onto_one_gpu_within_limits():
    pend = [Pending(f"f{i}", "u", LeaseRequest(fraction=0.25), i, 600) for i in range(5)]
    d = schedule(pend, slots({"n": 2}), {}, SchedulerPolicy(max_leases_per_shared_gpu=4), NOW)
    gpus = [g.gpu_ids[0] for g in d.grants]
    assert len(gpus) == 5 and gpus.count(gpus[0]) == 4  # 4 on the first GPU, the 5th on the other


def test_shared_never_on_exclusive_gpu():
    s = slots({"n": 1})
    hold(s, ["n/0"], NOW + 100)
    d = schedule([Pending("f", "u", LeaseRequest(fraction=0.5), 1, 60)], s, {}, SchedulerPolicy(), NOW)
    assert d.grants == []


def test_exclusive_never_on_shared_gpu():
    s = slots({"n": 1})
    s[0].n_shared, s[0].shares = 1, 0.25
    d = schedule([req("x", 1, seq=1)], s, {}, SchedulerPolicy(), NOW)
    assert d.grants == []


def test_shared_memory_limit():
    pend = [Pending(f"m{i}", "u", LeaseRequest(fraction=0.25, mem_bytes=50 << 30), i, 60) for i in range(2)]
    d = schedule(pend, slots({"n": 1}), {}, SchedulerPolicy(), NOW)
    assert len(d.grants) == 1  # 2 x 50 GiB do not fit in 80 GiB


def test_fair_share_orders_within_priority():
    d = schedule([req("heavy", 1, user="heavy", seq=1), req("light", 1, user="light", seq=2)],
                 slots({"n": 1}), {}, SchedulerPolicy(backfill_depth=0), NOW, usage={"heavy": 10.0, "light": 1.0})
    assert list(granted(d)) == ["light"]


def test_no_gpu_is_granted_twice_in_one_pass():
    pend = [req(f"r{i}", 1 + i % 3, seq=i) for i in range(50)]
    d = schedule(pend, slots({"a": 8, "b": 8}), {}, SchedulerPolicy(), NOW)
    ids = [i for g in d.grants for i in g.gpu_ids]
    assert len(ids) == len(set(ids)) <= 16


# ----------------------------------------------------------------------------- warm re-grants (Pending.prefer)
def warm(lid: str, prefer: tuple[str, ...], n: int = 1, user: str = "u", seq: int = 0, duration: float = 600,
         **kw) -> Pending:
    return Pending(lid, user, LeaseRequest(min_gpus=n, max_gpus=n, **kw), seq, duration, prefer=prefer)


def test_a_request_gets_the_gpus_its_notebook_gave_back_when_they_are_free():
    """Best fit would put a 1-GPU request on the node with one GPU left (b); the notebook's last GPU was a/2."""
    s = slots({"a": 4, "b": 2})
    hold(s, ["b/0"], NOW + 3600)
    assert granted(schedule([req("x")], s, {}, SchedulerPolicy(), NOW)) == {"x": ("b/1",)}
    assert granted(schedule([warm("x", ("a/2",))], s, {}, SchedulerPolicy(), NOW)) == {"x": ("a/2",)}
    # a smaller request than the last lease: the first of its GPUs; a bigger one: placed as any request
    assert granted(schedule([warm("x", ("a/2", "a/3"))], s, {}, SchedulerPolicy(), NOW)) == {"x": ("a/2",)}
    assert granted(schedule([warm("x", ("a/2",), n=2)], s, {}, SchedulerPolicy(), NOW)) == {"x": ("a/0", "a/1")}


def test_no_warm_regrant_when_the_gpu_is_taken_or_planned_for_an_earlier_request():
    s = slots({"a": 2, "b": 2})
    hold(s, ["a/1"], NOW + 3600)  # someone else holds the notebook's GPU now
    assert granted(schedule([warm("x", ("a/1",))], s, {}, SchedulerPolicy(), NOW)) == {"x": ("a/0",)}
    # an earlier request got it in this pass: the later one gets another
    s = slots({"a": 2, "b": 2})
    d = schedule([warm("first", ("a/1",), seq=1), warm("x", ("a/1",), seq=2)], s, {}, SchedulerPolicy(), NOW)
    assert granted(d) == {"first": ("a/1",), "x": ("a/0",)}
    # a blocked gang waits for node a (b is held longer): a/1 is reserved for it from when a/0 frees, so a warm
    # request that would end after that start does not take it
    s = slots({"a": 2, "b": 2})
    hold(s, ["a/0"], NOW + 100)
    hold(s, ["b/0", "b/1"], NOW + 3600)
    d = schedule([req("gang", 2, seq=1), warm("x", ("a/1",), seq=2, duration=600)], s, {}, SchedulerPolicy(), NOW)
    assert granted(d) == {} and set(d.plan["gang"].gpu_ids) == {"a/0", "a/1"}
    d = schedule([req("gang", 2, seq=1), warm("x", ("a/1",), seq=2, duration=60)], s, {}, SchedulerPolicy(), NOW)
    assert granted(d) == {"x": ("a/1",)}  # it ends before the gang's start: backfilled on its own GPU


def test_a_warm_regrant_keeps_to_the_requests_type_and_locality():
    s = slots({"a": 2, "b": 2})
    s[0].name = "NVIDIA H100 80GB HBM3"  # a/0 is an H100, the rest (no name) are not
    d = schedule([warm("x", ("b/0",), gpu_type="H100")], s, {}, SchedulerPolicy(), NOW)
    assert granted(d) == {"x": ("a/0",)}
    d = schedule([warm("x", ("a/1", "b/1"), n=2)], s, {}, SchedulerPolicy(), NOW)  # locality node: one node
    assert granted(d)["x"] in (("a/0", "a/1"), ("b/0", "b/1"))


def test_every_request_left_waiting_says_why_also_deep_in_the_queue():
    """Each request a pass looks at and does not grant gets its reason (``Decision.waiting``), past backfill_depth
    too, where the pass only skips it: a cap before anything, then whom it waits behind."""
    s = slots({"n0": 2})
    hold(s, ["n0/0", "n0/1"], NOW + 600)
    pol = SchedulerPolicy(backfill_depth=1, user_cap=lambda u: 1.0 if u == "capped" else 0.0)
    pending = [req("a", user="x", seq=1), req("b", user="y", seq=5), req("c", user="x", seq=2),
               req("d", user="capped", seq=3), req("e", user="y", seq=4, priority="low")]
    d = schedule(pending, s, {"capped": 1.0}, pol, NOW, ordered=True)
    assert not d.grants
    assert d.waiting == {"a": "gpus_busy", "b": "queue", "c": "fair_share", "d": "quota", "e": "priority"}
