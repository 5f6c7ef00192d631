"""Preemption by suspension (``LeasePolicy.preempt_mode = "suspend"``) and the scheduler's resume, through the real
LeaseManager on a virtual clock and an in-memory store: which leases a blocked request asks to suspend (least
suspended time first, then the youngest; never of a higher class; only after their minimum runtime; a node-local
gang's GPUs on one node), and how a suspended lease that wants its GPUs back is granted them again (before new
requests of its class, only on GPUs of its model, its own when free, its time limit restarted)."""

from __future__ import annotations

import pytest
from suspension_setup import ALICE, BOB, CAROL, DAVE, report_suspended, suspending_manager

from lease_broker.core.lease import HOLDING, LeaseRequest, LeaseState
from lease_broker.core.pass_types import Pending
from lease_broker.core.queue import Queue
from lease_broker.manager.preemption import fewest_gpus


@pytest.fixture
def make():
    return suspending_manager


def long_lease(m, clock, who, gpus=1, priority="normal", after=10.0, **more):
    lease, _ = m.request(who, {"gpus": gpus, "duration_seconds": 36000, "suspendable": True, "priority": priority,
                               **more})
    assert lease.state == LeaseState.GRANTED, lease.state
    clock.advance(after)
    return lease


def lease_events(m, change):
    return [e for e in m.events.backlog if e["type"] == "lease" and e["change"] == change]


def asked(m) -> set[str]:
    return {x.id for x in m.leases.values() if x.suspension is not None and not x.suspension.suspended}


def test_the_youngest_lease_is_asked_and_the_request_gets_its_gpu_once_it_reports(make):
    m, clock = make(gpus=2, suspend_max_gpus=1)
    old = long_lease(m, clock, ALICE)
    young = long_lease(m, clock, BOB)
    req, _ = m.request(CAROL, {"gpus": 1, "duration_seconds": 600})
    assert req.state == LeaseState.QUEUED
    assert asked(m) == {young.id}
    s = young.suspension
    assert s is not None and s.why == "preempted" and s.by_lease == req.id and s.resume
    report_suspended(m, young)
    s = young.suspension
    assert young.state == LeaseState.SUSPENDED and not young.devices
    assert req.state == LeaseState.GRANTED and req.devices == list(s.devices)
    assert old.state in HOLDING
    # it waits for a GPU of its model, queued before new requests of its class
    later, _ = m.request(DAVE, {"gpus": 1, "duration_seconds": 600})
    assert [p.lease_id for p in m.state.queue][:2] == [young.id, later.id]
    clock.advance(100)
    m.release(req.id, CAROL)
    assert young.state == LeaseState.GRANTED and young.reason == "resumed"
    assert young.devices == list(s.devices)  # its own GPU, free again
    assert later.state == LeaseState.QUEUED
    assert young.suspension is None and young.suspensions == 1
    assert young.suspended_seconds == pytest.approx(100.0)
    # a preempted lease keeps the time it had left
    assert young.expires_at == pytest.approx(clock.now() + s.remaining)


def test_the_least_suspended_lease_is_asked_before_a_younger_one(make):
    m, clock = make(gpus=2, suspend_max_gpus=1, suspend_max_share=1.0)
    a = long_lease(m, clock, ALICE, after=1000)
    b = long_lease(m, clock, BOB, after=1000)
    r1, _ = m.request(CAROL, {"gpus": 1, "duration_seconds": 600})
    assert asked(m) == {b.id}  # the youngest
    report_suspended(m, b)
    clock.advance(50)
    m.release(r1.id, CAROL)
    assert b.state == LeaseState.GRANTED and b.suspended_seconds > 0
    clock.advance(10)
    m.request(DAVE, {"gpus": 1, "duration_seconds": 600})
    assert asked(m) == {a.id}  # b is younger, but it was suspended already


def test_no_lease_of_a_higher_class_and_none_before_its_minimum_runtime(make):
    m, clock = make(gpus=2, suspend_min_runtime_seconds=300.0)
    high = long_lease(m, clock, ALICE, priority="high", after=1000)
    fresh = long_lease(m, clock, BOB, after=100)
    r, _ = m.request(CAROL, {"gpus": 1, "duration_seconds": 600})
    assert r.state == LeaseState.QUEUED and not asked(m)  # high: a higher class; fresh: held 100 s < 300 s
    clock.advance(200)
    m.tick()
    assert asked(m) == {fresh.id}
    assert high.suspension is None


def test_no_new_asks_while_one_for_the_request_is_pending_and_leases_that_cannot_suspend_are_left(make):
    m, clock = make(gpus=3, suspend_max_gpus=2)
    plain, _ = m.request(ALICE, {"gpus": 1, "duration_seconds": 36000})  # not suspendable
    a = long_lease(m, clock, BOB)
    b = long_lease(m, clock, DAVE)
    r, _ = m.request(CAROL, {"gpus": 1, "duration_seconds": 600})
    assert asked(m) == {b.id}
    clock.advance(5)
    m.tick()
    assert asked(m) == {b.id} and a.suspension is None  # still waiting for b's report
    assert plain.suspension is None and plain.state in HOLDING
    assert r.state == LeaseState.QUEUED


def test_a_request_that_may_not_suspend_others_waits(make):
    m, clock = make(gpus=1, suspend_max_gpus=1, suspend_max_duration_seconds=3600, suspend_classes=["normal"])
    long_lease(m, clock, ALICE)
    for body in ({"gpus": 1, "duration_seconds": 7200}, {"gpus": 1, "duration_seconds": 600, "priority": "low"}):
        m.request(BOB, body)
        assert not asked(m), body


def test_a_gang_gets_its_gpus_on_one_node(make):
    m, clock = make(gpus=4, nodes=2, suspend_max_gpus=2)
    big = long_lease(m, clock, ALICE, gpus=2)  # one node: the oldest lease
    y1 = long_lease(m, clock, BOB)  # the other node: two younger leases of one GPU
    y2 = long_lease(m, clock, DAVE)
    assert y1.node == y2.node != big.node
    r, _ = m.request(CAROL, {"gpus": 2, "duration_seconds": 600})
    assert r.state == LeaseState.QUEUED
    assert asked(m) == {big.id}  # the fewest asks that free two GPUs on one node
    report_suspended(m, big)
    assert r.state == LeaseState.GRANTED
    assert {m.gpu_by_id[d].node for d in r.devices} == {m.gpu_by_id[big.suspension.devices[0]].node}


def test_a_suspended_lease_resumes_only_on_gpus_of_its_model_its_own_when_free(make):
    m, clock = make(cluster="1x2:A100-40GB,1x2:H100", suspend_max_gpus=1)
    a = long_lease(m, clock, ALICE, gpu_type="A100")
    other_a100 = long_lease(m, clock, BOB, gpu_type="A100")
    r, _ = m.request(CAROL, {"gpus": 1, "duration_seconds": 600, "gpu_type": "A100"})
    assert asked(m) == {other_a100.id}
    mine = tuple(other_a100.devices)
    report_suspended(m, other_a100)
    assert r.state == LeaseState.GRANTED and tuple(r.devices) == mine
    model = m.gpu_by_id[mine[0]].name
    assert other_a100.suspension is not None and other_a100.suspension.model == model
    # two H100s are idle: it does not resume there
    m.schedule()
    assert other_a100.state == LeaseState.SUSPENDED
    clock.advance(60)
    m.release(a.id, ALICE)  # another A100 frees: it resumes there, remapped
    assert other_a100.state == LeaseState.GRANTED
    assert m.gpu_by_id[other_a100.devices[0]].name == model and tuple(other_a100.devices) != mine


def test_the_queue_puts_resuming_leases_before_new_requests_of_their_class():
    q = Queue(lambda: {"low": 0, "normal": 10, "high": 20})
    normal, high = LeaseRequest(), LeaseRequest(priority="high")
    q.add(Pending("new", "bob", normal, 1, 60.0), 0.0)
    q.add(Pending("high", "bob", high, 3, 60.0), 5.0)
    q.add(Pending("back", "alice", normal, 7, 60.0, resuming=True), 0.0)
    q.add(Pending("back-early", "carol", normal, 2, 60.0, resuming=True), 0.0)
    assert [p.lease_id for p in q] == ["high", "back-early", "back", "new"]
    q.rescore(lambda u: 100.0)  # a rescore leaves resuming leases first in their class
    assert [p.lease_id for p in q] == ["high", "back-early", "back", "new"]
    assert q.users() == {"alice", "bob", "carol"} and q.scored_users() == {"bob"}
    q.remove("back")
    q.remove("back-early")
    assert [p.lease_id for p in q] == ["high", "new"]


def test_an_ask_is_withdrawn_when_its_request_leaves_and_a_late_report_suspends_by_the_holder(make):
    m, clock = make(gpus=1)
    a = long_lease(m, clock, ALICE)
    r, _ = m.request(BOB, {"gpus": 1, "duration_seconds": 600})
    assert asked(m) == {a.id} and m.view(a)["suspend"]["why"] == "preempted"
    m.release(r.id, BOB)  # cancelled before a's holder reported
    assert not asked(m) and a.state in HOLDING and m.view(a)["suspend"] is None
    assert lease_events(m, "suspend_withdrawn")[-1]["lease"]["id"] == a.id
    clock.advance(120)  # past the report deadline: nothing falls back, it was withdrawn
    m.tick()
    assert a.state in HOLDING
    # a holder that was suspending already reports anyway: its own suspension, until it asks for its GPUs back
    left = tuple(a.devices)
    report_suspended(m, a)
    assert a.state == LeaseState.SUSPENDED and a.suspension is not None and a.suspension.why == "user"
    m.resume(a.id, ALICE)
    assert a.state == LeaseState.GRANTED and a.reason == "resumed" and tuple(a.devices) == left


def test_a_withdrawn_ask_leaves_its_holder_until_the_deadline_to_report_before_any_idle_revocation(make):
    """An ask withdrawn while its holder may be checkpointing (minutes for a whole node's memory): no idle (or
    pressure) revocation before the ask's report deadline, so a late report still suspends the lease instead of
    the broker killing the cell whose state was being saved."""
    m, clock = make(gpus=1, suspend_report_seconds=60, suspend_idle=False)  # (idleness revokes, as interactive-first)
    a = long_lease(m, clock, ALICE, idle_timeout_seconds=30)
    r, _ = m.request(BOB, {"gpus": 1, "duration_seconds": 600})
    deadline = a.suspension.deadline
    clock.advance(5)
    m.release(r.id, BOB)  # withdrawn 5 s into the ask
    assert a.suspension is None and lease_events(m, "suspend_withdrawn")[-1]["lease"]["id"] == a.id
    clock.advance(40)  # past its 30 s idle timeout since the withdrawal, before the report deadline
    m.tick()
    assert a.state in HOLDING, a.reason
    report_suspended(m, a)  # the checkpoint finished: the holder reports
    assert a.state == LeaseState.SUSPENDED and a.suspension is not None and a.suspension.why == "user"
    b = long_lease(m, clock, CAROL, idle_timeout_seconds=30)  # (the GPU it gave)
    clock.advance(deadline + 31 - clock.now())
    m.tick()
    assert b.state == LeaseState.REVOKED and b.reason == "idle"  # idleness itself still ends leases


def test_an_ask_is_withdrawn_when_its_request_is_granted_elsewhere(make):
    m, clock = make(gpus=2)
    a = long_lease(m, clock, ALICE)
    b = long_lease(m, clock, DAVE)
    r, _ = m.request(BOB, {"gpus": 1, "duration_seconds": 600})
    assert asked(m) == {b.id}
    m.release(a.id, ALICE)  # a GPU frees before b's holder reports: r gets it
    assert r.state == LeaseState.GRANTED and tuple(r.devices) != tuple(b.devices)
    assert not asked(m) and b.state in HOLDING and b.suspension is None
    assert m.view(b)["suspend"] is None


def test_a_lease_suspended_for_a_request_that_left_resumes_on_its_own_gpu(make):
    m, clock = make(gpus=1)
    a = long_lease(m, clock, ALICE)
    left = tuple(a.devices)
    # a request that suspends it starts first
    clock.advance(1000)
    r2, _ = m.request(BOB, {"gpus": 1, "duration_seconds": 600})
    assert asked(m) == {a.id}
    report_suspended(m, a)
    assert r2.state == LeaseState.GRANTED and a.state == LeaseState.SUSPENDED
    assert [p.lease_id for p in m.state.queue] == [a.id]  # queued again once the request that asked it started
    m.release(r2.id, BOB)
    assert a.state == LeaseState.GRANTED and tuple(a.devices) == left


def test_by_default_nothing_is_suspended_for_others(make):
    m, clock = make(gpus=1, preempt_mode="revoke")
    a = long_lease(m, clock, ALICE, after=10_000)
    r, _ = m.request(BOB, {"gpus": 1, "duration_seconds": 600, "priority": "high"})
    assert r.state == LeaseState.QUEUED and not asked(m) and a.state in HOLDING


def test_a_lease_held_back_for_a_request_resumes_when_that_request_is_cancelled(make):
    m, clock = make(gpus=2)
    a = long_lease(m, clock, ALICE)
    b = long_lease(m, clock, DAVE)
    r, _ = m.request(BOB, {"gpus": 2, "duration_seconds": 600})
    assert asked(m) == {a.id, b.id}
    report_suspended(m, b)
    assert r.state == LeaseState.QUEUED and b.state == LeaseState.SUSPENDED
    assert b.id not in m.state.queue  # it does not take back the GPU it gave while the request waits for a's
    m.release(r.id, BOB)  # the cancel asks for a pass at once (not the next tick): b takes its GPU back
    assert b.state == LeaseState.GRANTED and b.reason == "resumed"
    assert a.suspension is None and a.state in HOLDING  # the ask that r made of a is withdrawn
    assert not len(m.state.queue)


def test_a_one_gpu_request_suspends_a_one_gpu_lease_not_a_younger_gang(make):
    m, clock = make(gpus=10, suspend_max_gpus=2)
    one = long_lease(m, clock, ALICE)
    other = long_lease(m, clock, CAROL)
    gang = long_lease(m, clock, BOB, gpus=8)  # the youngest
    r, _ = m.request(DAVE, {"gpus": 1, "duration_seconds": 600})
    assert asked(m) == {other.id}  # the fewest GPUs suspended, then the youngest of the 1-GPU leases
    report_suspended(m, other)
    assert r.state == LeaseState.GRANTED
    assert gang.state in HOLDING and one.state in HOLDING
    clock.advance(5)
    m.release(r.id, DAVE)
    assert other.state == LeaseState.GRANTED  # (it resumed on its GPU)
    clock.advance(10)
    r2, _ = m.request(DAVE, {"gpus": 2, "duration_seconds": 600})
    assert r2.state == LeaseState.QUEUED
    assert asked(m) == {one.id, other.id}  # two 1-GPU leases, not the gang's eight GPUs


def test_fewest_gpus_picks_the_smallest_set_that_frees_enough():
    # (index in preference order, GPUs it frees)
    assert fewest_gpus([(0, 8), (1, 1), (2, 1)], 2, [0.0, 0.0, 0.0]) == ((2, 2, 0.0, 3), [1, 2])
    assert fewest_gpus([(0, 8), (1, 1)], 2, [0.0, 0.0]) == ((8, 1, 0.0, 0), [0])
    assert fewest_gpus([(0, 2), (1, 1), (2, 1)], 2, [0.0, 0.0, 0.0])[1] == [0]  # the fewest leases for as many GPUs
    assert fewest_gpus([(0, 1), (1, 1)], 1, [50.0, 0.0])[1] == [1]  # the least suspended
    assert fewest_gpus([(0, 1), (1, 1)], 1, [0.0, 0.0])[1] == [0]  # then the first in preference order
    assert fewest_gpus([(0, 1), (1, 1)], 3, [0.0, 0.0]) is None
