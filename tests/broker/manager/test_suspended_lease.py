"""The suspended lease in the broker (issue 33): the ask, the holder's report, the fallback, heartbeats, the time
bound, a restart, the views and their words, accounting and notifications, through the real LeaseManager on a
virtual clock (the scheduler's resume and preemption by suspension: test_suspend_preemption.py)."""

from __future__ import annotations

import pytest

from lease_broker.core.clock import VirtualClock
from lease_broker.core.errors import BadRequest, Forbidden, InvalidTransition
from lease_broker.core.identity import Identity
from lease_broker.core.lease import LeaseState
from lease_broker.inventory.simulated import SimulatedInventory
from lease_broker.manager.manager import LeaseManager
from lease_broker.notify.messages import message
from lease_broker.policy.lease_policy import LeasePolicy
from lease_broker.store.lease_store import Store

ALICE = Identity("alice", uid=1001)
BOB = Identity("bob", uid=1002)
ADMIN = Identity("root", uid=0, admin=True)


@pytest.fixture
def make():
    def _make(gpus=1, db=":memory:", **policy):
        clock = VirtualClock()
        pol = LeasePolicy(**{"heartbeat_timeout": 1e9, "default_idle_timeout_seconds": 0, "unix_groups": False,
                             "suspend_report_seconds": 60.0, **policy})
        m = LeaseManager(Store(db), SimulatedInventory(gpus=gpus, nodes=1), pol, clock=clock)
        m.restore()
        return m, clock

    return _make


def idle_lease(m, clock, who=ALICE, idle=100.0, **more):
    """A suspendable lease with an idle timeout, granted, then idle past it (the tick asks it to suspend)."""
    lease, _ = m.request(who, {"gpus": 1, "suspendable": True, "idle_timeout_seconds": idle,
                               "duration_seconds": 3600, **more})
    assert lease.state == LeaseState.GRANTED
    clock.advance(idle + 1)
    m.tick()
    return lease


def lease_events(m, change):
    return [e for e in m.events.backlog if e["type"] == "lease" and e["change"] == change]


def test_an_idle_suspendable_lease_is_asked_reports_and_its_gpu_goes_to_the_queue(make):
    m, clock = make()
    a = idle_lease(m, clock)
    assert a.state in (LeaseState.GRANTED, LeaseState.IDLE) and a.suspension is not None  # asked, not revoked
    view = m.view(a, ALICE)
    assert view["suspend"]["why"] == "idle" and view["suspend"]["deadline"] == a.suspension.deadline
    assert "asked to suspend" in view["suspend"]["text"] and view["suspended"] is None
    assert lease_events(m, "suspend_asked")[-1]["lease"]["suspend"]["why"] == "idle"
    b, _ = m.request(BOB, {"gpus": 1})
    assert b.state == LeaseState.QUEUED
    gpu = a.devices[0]
    m.suspended(a.id, ALICE, {"ok": True, "how": "checkpoint", "host_bytes": 1 << 30})
    assert a.state == LeaseState.SUSPENDED and a.reason == "idle" and a.devices == [] and a.suspensions == 1
    assert b.state == LeaseState.GRANTED and b.devices == [gpu]  # its GPU went to the waiting request
    clock.advance(30)
    view = m.view(a, ALICE)
    assert view["phase"] == "suspended" and view["suspend"] is None
    s = view["suspended"]
    assert s["why"] == "idle" and s["devices"] == [gpu] and s["how"] == "checkpoint" and not s["resume"]
    assert s["model"] and "resumes with its next cell" in s["text"] and "(idle)" in s["text"]
    assert view["suspended_seconds"] == pytest.approx(30.0)
    assert [h["to"] for h in m.store.history(a.id)][-1] == "suspended"


def test_a_lease_not_suspendable_is_revoked_as_before(make):
    m, clock = make()
    a, _ = m.request(ALICE, {"gpus": 1, "idle_timeout_seconds": 100})
    clock.advance(101)
    m.tick()
    assert a.state == LeaseState.REVOKED and a.reason == "idle" and a.suspension is None


def test_with_suspend_idle_off_a_suspendable_lease_is_revoked(make):
    m, clock = make(suspend_idle=False)
    a = idle_lease(m, clock)
    assert a.state == LeaseState.REVOKED and a.reason == "idle"


def test_a_holder_that_cannot_suspend_is_revoked_at_once_with_its_words(make):
    m, clock = make()
    a = idle_lease(m, clock)
    m.suspended(a.id, ALICE, {"ok": False, "why": "CUDA_ERROR_NOT_SUPPORTED from cuCheckpointProcessLock"})
    assert a.state == LeaseState.REVOKED and a.reason.split(";")[0] == "idle"
    text = m.view(a, ALICE)["reason_text"]
    assert "idle for" in text and "could not be suspended" in text and "CUDA_ERROR_NOT_SUPPORTED" in text


def test_a_holder_that_does_not_report_by_the_deadline_gets_what_the_ask_replaced(make):
    m, clock = make()
    a = idle_lease(m, clock)
    clock.advance(59)
    m.tick()
    assert a.state in (LeaseState.GRANTED, LeaseState.IDLE)
    clock.advance(2)
    m.tick()
    assert a.state == LeaseState.REVOKED and a.reason == "idle"


def test_a_time_limit_asks_before_it_runs_out_and_is_kept_to_the_second(make):
    m, clock = make()
    a, _ = m.request(ALICE, {"gpus": 1, "suspendable": True, "duration_seconds": 100})
    clock.advance(39)
    m.tick()
    assert a.suspension is None
    clock.advance(2)  # 59 s left: within suspend_report_seconds of its time limit
    m.tick()
    assert a.suspension is not None and a.suspension.why == "expired" and a.suspension.deadline == a.expires_at
    clock.advance(59)
    m.tick()
    assert a.state == LeaseState.EXPIRED and a.reason == "expired"


def test_a_time_limit_jumped_over_expires_at_once(make):
    m, clock = make()
    a, _ = m.request(ALICE, {"gpus": 1, "suspendable": True, "duration_seconds": 100})
    clock.advance(500)
    m.tick()
    assert a.state == LeaseState.EXPIRED


def test_the_report_is_checked(make):
    m, clock = make()
    a = idle_lease(m, clock)
    for body, field in (({"ok": "yes"}, "ok"), ({"ok": True, "how": "freeze"}, "how"),
                        ({"ok": True, "host_bytes": -1}, "host_bytes")):
        with pytest.raises(BadRequest) as e:
            m.suspended(a.id, ALICE, body)
        assert field in e.value.message
    plain, _ = m.request(ALICE, {"gpus": 1})
    with pytest.raises(BadRequest):
        m.suspended(plain.id, ALICE, {"ok": True})


def test_another_user_can_neither_report_nor_resume(make):
    m, clock = make()
    a = idle_lease(m, clock)
    with pytest.raises(Forbidden):
        m.suspended(a.id, BOB, {"ok": True})
    m.suspended(a.id, ALICE, {"ok": True, "how": "stop"})
    with pytest.raises(Forbidden):
        m.resume(a.id, BOB)
    m.resume(a.id, ADMIN)  # an admin may (its GPU is free: the pass resumes it at once)
    assert a.state == LeaseState.GRANTED and a.reason == "resumed"


def test_resume_is_for_suspended_leases_and_restarts_the_time_limit(make):
    m, clock = make(gpus=2)
    a = idle_lease(m, clock)
    with pytest.raises(InvalidTransition):
        m.resume(a.id, ALICE)
    left = tuple(a.devices)
    m.suspended(a.id, ALICE, {"ok": True})
    clock.advance(500)
    m.resume(a.id, ALICE)
    assert a.state == LeaseState.GRANTED
    # the scheduler's pass resumes it on the GPU it left (free): test_suspend_preemption.py tests its choices
    assert a.state == LeaseState.GRANTED and a.reason == "resumed" and tuple(a.devices) == left
    assert a.expires_at == pytest.approx(clock.now() + 3600) and a.suspension is None
    assert a.suspended_seconds == pytest.approx(500.0) and a.granted_at == clock.now()


def test_a_resume_waits_in_the_queue_views_while_its_gpus_are_held(make):
    m, clock = make()
    a = idle_lease(m, clock)
    m.suspended(a.id, ALICE, {"ok": True})
    b, _ = m.request(BOB, {"gpus": 1})
    assert b.state == LeaseState.GRANTED
    m.resume(a.id, ALICE)
    assert a.state == LeaseState.SUSPENDED and a.suspension.resume
    view = m.view(a, ALICE)["suspended"]
    assert view["resume"] and "resumes when 1 GPU of its model" in view["text"]
    assert [(q["lease_id"], q["resuming"]) for q in m.queue_view(ALICE)] == [(a.id, True)]


def test_a_suspended_lease_takes_heartbeats_and_ends_when_they_stop(make):
    m, clock = make(heartbeat_timeout=30.0)
    a, _ = m.request(ALICE, {"gpus": 1, "suspendable": True})
    m.ask_suspend(a, "user")
    m.suspended(a.id, ALICE, {"ok": True})
    assert a.state == LeaseState.SUSPENDED and a.reason == "user"
    for _ in range(4):
        clock.advance(20)
        m.heartbeat(a.id, ALICE)
        m.tick()
    assert a.state == LeaseState.SUSPENDED  # 80 s, beating: never idle, never expired
    clock.advance(31)
    m.tick()
    assert a.state == LeaseState.REVOKED and a.reason == "holder_gone"


def test_a_lease_suspended_too_long_ends(make):
    m, clock = make(suspend_max_seconds=1000.0)
    a = idle_lease(m, clock)
    m.suspended(a.id, ALICE, {"ok": True})
    clock.advance(999)
    m.tick()
    assert a.state == LeaseState.SUSPENDED
    clock.advance(2)
    m.tick()
    assert a.state == LeaseState.REVOKED and a.reason == "suspended_too_long"
    assert "suspended longer" in m.view(a, ALICE)["reason_text"]
    assert a.suspended_seconds == pytest.approx(1001.0)


def test_a_restart_keeps_a_suspended_lease(make, tmp_path):
    db = str(tmp_path / "s.db")
    m, clock = make(db=db)
    a = idle_lease(m, clock)
    m.suspended(a.id, ALICE, {"ok": True, "how": "checkpoint"})
    m.store.close()
    m2, _ = make(db=db)
    b = m2.leases[a.id]
    assert b.state == LeaseState.SUSPENDED and b.suspension == a.suspension and b.suspensions == 1
    assert a.id in m2.state.suspended and a.id not in m2.state.queue
    c, _ = m2.request(BOB, {"gpus": 1})
    assert c.state == LeaseState.GRANTED  # the suspended lease holds no GPU


def test_suspended_time_is_not_charged(make):
    m, clock = make()
    a, _ = m.request(ALICE, {"gpus": 1, "suspendable": True})
    clock.advance(3600)
    m.ask_suspend(a, "user")
    m.suspended(a.id, ALICE, {"ok": True})
    clock.advance(7200)  # suspended 2 h
    fair = m.accounting.fairshare(clock.now(), {"alice"})["alice"]
    assert fair == pytest.approx(3600.0, rel=0.05)  # the hour it held, not three
    m.release(a.id, ALICE)
    report = m.usage_report(ALICE, 86400)
    assert report[0]["gpu_hours_held"] == pytest.approx(1.0, rel=0.01)
    charged, _ = m.quotas.charged(clock.now())
    assert charged["alice"] == pytest.approx(3600.0, rel=0.01)


def test_time_held_before_a_suspension_stays_charged_after_the_resume(make):
    m, clock = make()
    a, _ = m.request(ALICE, {"gpus": 1, "suspendable": True, "duration_seconds": 7200})
    clock.advance(1800)  # held 30 min
    m.ask_suspend(a, "user")
    m.suspended(a.id, ALICE, {"ok": True})
    clock.advance(3600)  # suspended 1 h: not charged
    m.resume(a.id, ALICE)
    assert a.state == LeaseState.GRANTED
    clock.advance(600)
    m.release(a.id, ALICE)  # held 10 min more
    charged, _ = m.quotas.charged(clock.now())
    assert charged["alice"] == pytest.approx(2400.0, rel=0.01)  # 30 + 10 min, whatever granted_at says now
    fair = m.accounting.fairshare(clock.now(), {"alice"})["alice"]
    assert fair == pytest.approx(2400.0, rel=0.05)


def test_the_holder_is_told_when_suspended_and_when_resumed(make):
    m, clock = make()
    a = idle_lease(m, clock)
    m.suspended(a.id, ALICE, {"ok": True})
    m.resume(a.id, ALICE)  # (its GPU is free: the scheduler's pass resumes it)
    kinds = {}
    for e in m.events.backlog:
        msg = message(e, clock.now())
        if msg is not None:
            kinds[msg.subject] = msg
    told = kinds[f"GPU lease {a.id} suspended"]
    assert told.user == "alice" and "suspended since" in told.text
    assert f"GPU lease {a.id} resumed" in kinds
