"""Start estimates of queued requests through the real LeaseManager (virtual clock, in-memory store), and
through a real broker process: the views carry the likely start and its range."""

from __future__ import annotations

import pytest
from waiting import wait_for

from lease_broker.core.clock import VirtualClock
from lease_broker.core.estimate import WIDEN, wait_words
from lease_broker.core.identity import Identity
from lease_broker.core.lease import LeaseState
from lease_broker.inventory.simulated import SimulatedInventory
from lease_broker.manager.manager import LeaseManager
from lease_broker.policy.lease_policy import LeasePolicy
from lease_broker.store.lease_store import Store

ALICE = Identity("alice", uid=1001)
BOB = Identity("bob", uid=1002)


@pytest.fixture
def make():
    def _make(gpus=1, nodes=1, **policy):
        clock = VirtualClock()
        pol = LeasePolicy(**{"heartbeat_timeout": 0.0, "default_idle_timeout_seconds": 600.0, **policy})
        m = LeaseManager(Store(":memory:"), SimulatedInventory(gpus=gpus, nodes=nodes), pol, clock=clock)
        m.restore()
        return m, clock

    return _make


def run_cells(m, clock, who, seconds, labels=None, times=4):
    """``times`` leases of ``who`` that each ran a cell for ``seconds`` and were released: the history."""
    for _ in range(times):
        lease, _ = m.request(who, {"gpus": 1, "labels": labels or {"notebook": "train.ipynb"}})
        assert lease.state == LeaseState.GRANTED
        clock.advance(seconds)
        m.release(lease.id, who)


def test_a_queued_request_waits_for_an_idle_holder_to_reach_its_idle_deadline(make):
    m, clock = make(pressure_idle_timeout_seconds=0)
    held, _ = m.request(ALICE, {"gpus": 1, "duration_seconds": 8 * 3600})
    queued, _ = m.request(BOB, {"gpus": 1})
    clock.advance(120)  # alice does nothing with it: idle since the grant
    view = m.view(queued, BOB)
    deadline = held.last_activity + 600
    assert view["estimated_start"] == deadline  # not the 8 h time limit
    now = clock.now()
    wait = deadline - now
    # the holder's end is known, the person is not (she may come back): the shown range widens the wait by WIDEN
    assert view["estimated_start_range"] == [now + wait / WIDEN[0], now + wait * WIDEN[1]]
    assert view["estimate_text"] == wait_words(wait / WIDEN[0], wait * WIDEN[1]).text == "in 5–30 min"
    assert m.state.planned[queued.id] == held.expires_at  # the time-limit plan, for comparison


def test_a_request_that_just_queued_presses_the_idle_holder_in_its_own_estimate(make):
    """No tick has run since bob queued, so the enforcer's pressure is still none; the estimate counts the
    pressure bob's request makes (2 minutes here), not alice's own 10-minute idle timeout."""
    m, clock = make(pressure_idle_timeout_seconds=120)
    held, _ = m.request(ALICE, {"gpus": 1, "duration_seconds": 8 * 3600})
    clock.advance(40)  # idle for longer than idle_mark_seconds: the estimate goes by its idle deadline
    queued, _ = m.request(BOB, {"gpus": 1})
    assert m.enforcer.pressure is None  # as of the last tick
    assert m.view(queued, BOB)["estimated_start"] == held.last_activity + 120
    assert m.view(held, ALICE)["idle_deadline"] == held.last_activity + 600  # the holder's view: as the tick saw it
    m.tick()
    assert m.view(held, ALICE)["idle_deadline"] == held.last_activity + 120


def test_a_running_holder_is_expected_to_run_as_long_as_similar_cells_did(make):
    m, clock = make()
    run_cells(m, clock, ALICE, 300)  # alice's cells in train.ipynb took 5 min
    held, _ = m.request(ALICE, {"gpus": 1, "labels": {"notebook": "train.ipynb"}})
    queued, _ = m.request(BOB, {"gpus": 1})
    clock.advance(100)
    m.activity(held, clock.now())  # running a cell
    view = m.view(queued, BOB)
    assert view["estimated_start"] == pytest.approx(held.granted_at + 300)
    low, high = view["estimated_start_range"]
    assert low <= view["estimated_start"] <= high
    assert view["estimated_start"] < held.expires_at  # the 1 h time limit is only the upper bound


def test_the_history_is_fed_by_lease_ends_and_kept_per_user_notebook_and_size(make):
    m, clock = make()
    run_cells(m, clock, ALICE, 300, times=2)
    keys = m.estimates.keys(m.list_leases(ALICE, include_ended=1)[0])
    assert [list(m.estimates.history.get(k)) for k in keys] == [[300.0, 300.0]] * 3


def test_a_range_shows_how_unsure_the_estimate_is(make):
    m, clock = make()
    for seconds in (60, 120, 600, 1800, 3000):  # alice's cells: anything from 1 to 50 minutes
        run_cells(m, clock, ALICE, seconds, times=1)
    held, _ = m.request(ALICE, {"gpus": 1, "labels": {"notebook": "train.ipynb"}})
    queued, _ = m.request(BOB, {"gpus": 1})
    m.activity(held, clock.now())
    view = m.view(queued, BOB)
    low, high = view["estimated_start_range"]
    now = clock.now()
    assert now + 60 / WIDEN[0] <= low <= view["estimated_start"] <= high <= now + 3000 * WIDEN[1]
    assert high - low >= 1000


def test_the_queue_carries_every_head_requests_range_and_events_carry_the_plan(make):
    m, clock = make(gpus=2)
    for who in (ALICE, ALICE):
        m.request(who, {"gpus": 1})
    first, _ = m.request(BOB, {"gpus": 1})
    second, _ = m.request(BOB, {"gpus": 1})
    clock.advance(60)
    queue = m.views.queue(BOB, clock.now())
    assert [q["lease_id"] for q in queue] == [first.id, second.id]
    for q in queue:
        assert q["estimated_start_range"] is not None
        assert q["estimated_start_range"][0] <= q["estimated_start"] <= q["estimated_start_range"][1]
    assert queue[0]["estimated_start"] <= queue[1]["estimated_start"]
    queued_event = next(e for e in m.events.backlog if e["type"] == "lease" and e["lease"]["id"] == second.id)
    assert queued_event["lease"]["estimated_start_range"] is None  # a request's own event stays cheap
    assert queued_event["lease"]["estimate_text"] is None  # and says no other words than the view's
    assert queue[1]["estimate_text"] == m.view(second, BOB)["estimate_text"]  # one walk: the same words


def test_a_gang_estimate_needs_its_gpus_on_one_node(make):
    m, clock = make(gpus=4, nodes=2, pressure_idle_timeout_seconds=0)
    small, _ = m.request(ALICE, {"gpus": 1, "idle_timeout_seconds": 300})  # node 0, idle until +300
    big, _ = m.request(ALICE, {"gpus": 2, "idle_timeout_seconds": 900})  # node 1, idle until +900
    gang, _ = m.request(BOB, {"gpus": 2})
    assert gang.state == LeaseState.QUEUED  # three GPUs free in all, but not two on one node
    clock.advance(60)
    assert m.view(gang, BOB)["estimated_start"] == small.last_activity + 300  # node 0 frees first


def test_a_real_broker_answers_with_the_range(broker_factory):
    broker = broker_factory(gpus=1, args=["--tick=0.1", "--LeasePolicy.default_idle_timeout_seconds=600"])
    c = broker.client()
    held = c.request_lease(1, heartbeat=False)
    queued = c.request_lease(1, heartbeat=False)
    assert held["state"] == "granted" and queued["state"] == "queued"
    low, high = queued["estimated_start_range"]
    assert low <= queued["estimated_start"] <= high <= held["expires_at"]
    (entry,) = c.queue()
    assert entry["lease_id"] == queued["id"] and entry["estimated_start_range"] is not None


def test_a_real_broker_says_the_same_words_in_the_view_and_the_queue(broker_factory):
    """One estimate: the lease's view and GET /queue carry the broker's words for the one range."""
    broker = broker_factory(gpus=1, args=["--tick=0.1", "--LeasePolicy.default_idle_timeout_seconds=600",
                                          "--LeasePolicy.pressure_idle_timeout_seconds=0"])
    c = broker.client()
    c.request_lease(1, heartbeat=False)
    queued = c.request_lease(1, heartbeat=False)
    (entry,) = c.queue()
    view = c.lease(queued["id"])
    assert view["estimate_text"] == entry["estimate_text"] == queued["estimate_text"]
    assert view["estimate_text"].startswith(("in ", "within ")) and view["estimate_text"].endswith("min")
    low, high = view["estimated_start_range"]
    assert low < view["estimated_start"] < high


def test_a_busy_lease_has_no_idle_countdown(broker_factory):
    """A running cell's heartbeats keep its lease active: no idle deadline to count down to (it would be put off at
    every beat); once it is idle (idle_mark_seconds after the last activity), the countdown is back."""
    broker = broker_factory(gpus=1, args=["--tick=0.1", "--LeasePolicy.default_idle_timeout_seconds=600",
                                          "--LeasePolicy.idle_mark_seconds=1"])
    c = broker.client()
    lease = c.request_lease(1, heartbeat=True)
    assert lease["state"] == "granted" and lease["idle_deadline"] is not None  # not used yet: the clock runs
    busy = c.heartbeat(lease["id"], active=True)
    assert busy["state"] == "active" and busy["idle_deadline"] is None
    idle = wait_for(lambda: (v := c.lease(lease["id"]))["state"] == "idle" and v, 10.0, "the lease marked idle")
    assert idle["idle_deadline"] == pytest.approx(idle["last_activity"] + 600)


def test_the_time_limit_bounds_a_holder_until_it_was_renewed(make):
    m, clock = make(max_duration_seconds=8 * 3600)
    run_cells(m, clock, ALICE, 3 * 3600)  # alice's leases held their GPUs for 3 h: longer than 1 h limits
    held, _ = m.request(ALICE, {"gpus": 1, "duration_seconds": 3600, "labels": {"notebook": "train.ipynb"}})
    queued, _ = m.request(BOB, {"gpus": 1})
    m.activity(held, clock.now())
    assert m.view(queued, BOB)["estimated_start"] == held.expires_at  # the limit bounds it
    clock.advance(1800)
    m.renew(held.id, ALICE, 3600)  # renewed: it may be again, as alice's were
    m.activity(held, clock.now())
    assert m.view(queued, BOB)["estimated_start"] == pytest.approx(held.granted_at + 3 * 3600)


def test_a_request_for_a_gpu_type_waits_for_a_gpu_of_that_type():
    clock = VirtualClock()
    m = LeaseManager(Store(":memory:"), SimulatedInventory(cluster="1x1:A100-40GB,1x1:H100"),
                     LeasePolicy(heartbeat_timeout=0.0, default_idle_timeout_seconds=600.0,
                                 pressure_idle_timeout_seconds=200.0), clock=clock)
    m.restore()
    h100, _ = m.request(ALICE, {"gpus": 1, "gpu_type": "H100", "idle_timeout_seconds": 900})
    a100, _ = m.request(ALICE, {"gpus": 1, "gpu_type": "A100", "idle_timeout_seconds": 300})
    queued, _ = m.request(BOB, {"gpus": 1, "gpu_type": "H100"})
    clock.advance(40)
    # the H100 lease is pressed by bob's request (200 s), the A100 lease is not: bob cannot use its GPU
    assert m.view(queued, BOB)["estimated_start"] == h100.last_activity + 200  # not the A100's +300
    m.tick()
    assert m.view(a100, ALICE)["idle_deadline"] == a100.last_activity + 300
    assert m.view(h100, ALICE)["idle_deadline"] == h100.last_activity + 200
