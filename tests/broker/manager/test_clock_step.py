"""A wall-clock step under the lease manager (VirtualClock): no lease loses or gains time, the times shown move
with the wall clock, and the move is one stored change per lease (issue 30, item 6)."""

from __future__ import annotations

import logging

import pytest
from table_checks import table_diffs

from lease_broker.core.clock import VirtualClock
from lease_broker.core.identity import Identity
from lease_broker.core.lease import HOLDING, LeaseState
from lease_broker.inventory.simulated import SimulatedInventory
from lease_broker.manager.manager import LeaseManager
from lease_broker.policy.lease_policy import LeasePolicy
from lease_broker.store.lease_store import Store

ALICE = Identity("alice", uid=1001)
BOB = Identity("bob", uid=1002)


def make(tmp_path, gpus=1, **policy):
    clock = VirtualClock()
    pol = LeasePolicy(**{"heartbeat_timeout": 30.0, "default_idle_timeout_seconds": 0, "unix_groups": False,
                         **policy})
    m = LeaseManager(Store(str(tmp_path / "leases.db")), SimulatedInventory(gpus=gpus), pol, clock=clock)
    m.restore()
    return m, clock


def test_a_forward_step_revokes_no_heartbeating_lease_and_moves_its_times(tmp_path, caplog):
    m, clock = make(tmp_path, default_idle_timeout_seconds=600)
    a, _ = m.request(ALICE, {"gpus": 1, "duration_seconds": 3600})
    assert a.state == LeaseState.GRANTED
    clock.advance(2)
    m.heartbeat(a.id, ALICE)
    m.tick()
    before = dict(expires=a.expires_at, granted=a.granted_at, created=a.created_at, left=a.expires_at - clock.now())
    clock.step_wall(2000)
    clock.advance(1)
    m.heartbeat(a.id, ALICE)  # between the step and the tick: on the broker's (monotonic) time
    with caplog.at_level(logging.WARNING, logger="lease_broker"):
        m.tick()
    assert a.state in HOLDING
    assert a.expires_at == pytest.approx(before["expires"] + 2000)
    assert (a.granted_at, a.created_at) == pytest.approx((before["granted"] + 2000, before["created"] + 2000))
    assert a.expires_at - clock.wall() == pytest.approx(before["left"] - 1)  # the wall time it will really end
    steps = [r for r in caplog.records if r.levelno == logging.WARNING and "stepped" in r.getMessage()]
    assert len(steps) == 1 and "+2000" in steps[0].getMessage()
    retimed = [e for e in m.events.backlog if e["type"] == "lease" and e.get("change") == "retimed"]
    assert [e["lease"]["expires_at"] for e in retimed] == [pytest.approx(a.expires_at)]
    assert m.store.get(a.id).expires_at == pytest.approx(a.expires_at)  # a restart reads the moved times
    for _ in range(30):  # 60 s of heartbeats every 2 s (the timeout is 30 s)
        clock.advance(2)
        m.heartbeat(a.id, ALICE)
        m.tick()
    assert a.state in HOLDING
    clock.advance(29)
    m.tick()
    assert a.state in HOLDING  # idle only 29 s since its last heartbeat
    clock.advance(2)
    m.tick()
    assert (a.state, a.reason) == (LeaseState.REVOKED, "holder_gone")


def test_a_backward_step_keeps_no_lease_past_its_time(tmp_path):
    m, clock = make(tmp_path)
    a, _ = m.request(ALICE, {"gpus": 1, "duration_seconds": 20, "heartbeat": False})
    granted = clock.monotonic()
    clock.advance(5)
    m.tick()
    expires = a.expires_at
    clock.step_wall(-600)
    m.tick()
    assert a.expires_at == pytest.approx(expires - 600)
    assert a.expires_at - clock.wall() == pytest.approx(15)
    clock.advance(14.9)
    m.tick()
    assert a.state in HOLDING
    clock.advance(0.2)
    m.tick()
    assert (a.state, a.reason) == (LeaseState.EXPIRED, "expired")
    assert clock.monotonic() - granted == pytest.approx(20.1)


def test_a_step_keeps_the_queue_and_the_grace_of_a_preemption(tmp_path):
    m, clock = make(tmp_path, gpus=1, preempt_grace_seconds={"high": 60})
    low, _ = m.request(ALICE, {"gpus": 1, "priority": "low", "heartbeat": False})
    waiting, _ = m.request(BOB, {"gpus": 1, "heartbeat": False})
    high, _ = m.request(BOB, {"gpus": 1, "priority": "high", "heartbeat": False})
    assert m.view(low)["preempting"]["deadline"] == pytest.approx(clock.now() + 60)
    order = [p.lease_id for p in m.state.queue]
    clock.advance(30)
    clock.step_wall(-600)
    m.tick()
    assert [p.lease_id for p in m.state.queue] == order
    assert not table_diffs(m.state.table, m.leases.values(), m.gpus)  # the GPU table saw the moved time limits
    assert m.state.queue.get(waiting.id).queued_at == waiting.created_at == pytest.approx(clock.now() - 30)
    assert m.view(low)["preempting"]["deadline"] == pytest.approx(clock.now() + 30)
    clock.advance(29)
    m.tick()
    assert low.state in HOLDING  # not 630 s: the 60 s grace, no more
    clock.advance(2)
    m.tick()
    assert (low.state, low.reason, high.state) == (LeaseState.REVOKED, "preempted", LeaseState.GRANTED)
