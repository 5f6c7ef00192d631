"""LeaseManager with a virtual clock and an in-memory store: time moves only when told."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import store_helpers

from lease_broker.core.clock import VirtualClock
from lease_broker.core.errors import BadRequest, Forbidden, InvalidTransition, NotFound
from lease_broker.core.identity import Identity
from lease_broker.core.lease import LeaseState
from lease_broker.inventory.simulated import SimulatedInventory
from lease_broker.manager.manager import LeaseManager
from lease_broker.policy.lease_policy import LeasePolicy
from lease_broker.store.lease_store import Store

ALICE = Identity("alice", uid=1001)
BOB = Identity("bob", uid=1002)
CAROL = Identity("carol", uid=1003)
ADMIN = Identity("root", uid=0, admin=True)


@pytest.fixture
def make(tmp_path):
    def _make(gpus=4, nodes=1, db=":memory:", **policy):
        clock = VirtualClock()
        pol = LeasePolicy(**{"heartbeat_timeout": 30.0, "default_idle_timeout_seconds": 0, **policy})
        m = LeaseManager(Store(db), SimulatedInventory(gpus=gpus, nodes=nodes), pol, clock=clock)
        m.restore()
        return m, clock

    return _make


def events_of(m, type_="lease"):
    return [e for e in m.events.backlog if e["type"] == type_]


def test_grant_release_hands_gpu_to_next(make):
    m, clock = make(gpus=1)
    a, _ = m.request(ALICE, {"gpus": 1})
    b, _ = m.request(BOB, {"gpus": 1})
    assert a.state == LeaseState.GRANTED and b.state == LeaseState.QUEUED
    assert m.view(b)["position"] == 1
    m.release(a.id, ALICE)
    assert a.state == LeaseState.RELEASED and b.state == LeaseState.GRANTED
    assert b.devices == a.devices


def test_every_transition_is_persisted_with_reason_and_event(make):
    m, clock = make(gpus=1)
    a, _ = m.request(ALICE, {"gpus": 1})
    m.release(a.id, ALICE)
    hist = m.store.history(a.id)
    assert [(h["from"], h["to"], h["reason"]) for h in hist] == [
        (None, "queued", "requested"), ("queued", "granted", "granted"), ("granted", "released", "released")]
    assert [e["change"] for e in events_of(m)] == ["queued", "granted", "released"]


def test_gang_waits_for_all_gpus_and_never_holds_part(make):
    m, clock = make(gpus=4)
    small, _ = m.request(ALICE, {"gpus": 2})
    gang, _ = m.request(BOB, {"gpus": 4})
    assert gang.state == LeaseState.QUEUED and gang.devices == []
    # nothing is held for the gang while it waits
    assert m.summary()["free"] == 2
    m.release(small.id, ALICE)
    assert gang.state == LeaseState.GRANTED and len(gang.devices) == 4


def test_expiry_with_warning(make):
    m, clock = make(gpus=1, default_duration_seconds=100, warn_before_seconds=10)
    a, _ = m.request(ALICE, {"gpus": 1, "heartbeat": False})
    clock.advance(91)
    m.tick()
    warnings = events_of(m, "warning")
    assert [w["kind"] for w in warnings] == ["expiry"] and warnings[0]["lease_id"] == a.id
    assert a.state != LeaseState.EXPIRED
    clock.advance(10)
    m.tick()
    assert a.state == LeaseState.EXPIRED and a.reason == "expired"


def test_heartbeat_loss_revokes_holder_gone(make):
    m, clock = make(gpus=1, heartbeat_timeout=30)
    a, _ = m.request(ALICE, {"gpus": 1})
    clock.advance(20)
    m.heartbeat(a.id, ALICE)
    clock.advance(20)
    m.tick()
    assert a.state in (LeaseState.GRANTED, LeaseState.IDLE)
    clock.advance(31)
    m.tick()
    assert a.state == LeaseState.REVOKED and a.reason == "holder_gone"


def test_idle_revocation_after_warning_and_activity_resets(make):
    m, clock = make(gpus=1, default_idle_timeout_seconds=60, warn_before_seconds=10, idle_mark_seconds=5)
    a, _ = m.request(ALICE, {"gpus": 1})
    clock.advance(30)
    m.heartbeat(a.id, ALICE, active=True)
    assert a.state == LeaseState.ACTIVE
    clock.advance(6)
    m.heartbeat(a.id, ALICE)
    m.tick()
    assert a.state == LeaseState.IDLE
    clock.advance(45)  # 51 s idle: warned, not revoked
    m.heartbeat(a.id, ALICE)
    m.tick()
    assert [w["kind"] for w in events_of(m, "warning")] == ["idle"]
    assert a.state == LeaseState.IDLE
    clock.advance(10)
    m.heartbeat(a.id, ALICE)
    m.tick()
    assert a.state == LeaseState.REVOKED and a.reason == "idle"


PRESSURE = {"default_idle_timeout_seconds": 600, "pressure_idle_timeout_seconds": 60, "warn_before_seconds": 10,
            "idle_mark_seconds": 5}


def test_pressure_idle_timeout_revokes_an_idle_lease_the_head_of_the_queue_waits_for(make):
    m, clock = make(gpus=2, **PRESSURE)
    a, _ = m.request(ALICE, {"gpus": 1, "heartbeat": False})
    b, _ = m.request(BOB, {"gpus": 1, "heartbeat": False})
    clock.advance(55)
    m.tick()  # idle 55 s, nobody waits: no warning (the own timeout is 600 s)
    assert not events_of(m, "warning") and m.view(a)["idle_deadline"] == pytest.approx(a.last_activity + 600)
    c, _ = m.request(CAROL, {"gpus": 1, "heartbeat": False})
    m.tick()  # now someone waits: both idle leases are warned of the pressure deadline, the floor
    warnings = events_of(m, "warning")
    assert {(w["lease_id"], w["kind"]) for w in warnings} == {(a.id, "idle"), (b.id, "idle")}
    assert {w["deadline"] for w in warnings} == {a.last_activity + 60}
    assert m.view(a)["idle_deadline"] == pytest.approx(a.last_activity + 60)
    assert a.state == LeaseState.IDLE and c.state == LeaseState.QUEUED  # not before the floor
    clock.advance(5)
    m.tick()
    assert {a.reason, b.reason} == {"idle_pressure"} and c.state == LeaseState.GRANTED
    assert {a.state, b.state} == {LeaseState.REVOKED}


def test_with_the_default_pressure_a_lease_in_use_is_not_warned_and_an_idle_one_once(make):
    """The default pressure timeout (60 s) is no longer than warn_before_seconds (60 s): the warning comes once the
    lease has been idle for idle_mark_seconds (30 s), not at every tick of a lease in use while someone waits."""
    m, clock = make(gpus=1, default_idle_timeout_seconds=600)
    a, _ = m.request(ALICE, {"gpus": 1, "heartbeat": False})
    b, _ = m.request(BOB, {"gpus": 1, "heartbeat": False})
    for _ in range(20):  # a cell runs for 20 s while bob waits
        clock.advance(1)
        m.activity(a, clock.now())
        m.tick()
    assert not events_of(m, "warning")
    clock.advance(29)  # then the notebook pauses
    m.tick()
    assert not events_of(m, "warning")
    clock.advance(2)
    for _ in range(5):
        m.tick()
    assert [(w["lease_id"], w["deadline"]) for w in events_of(m, "warning")] == [(a.id, a.last_activity + 60)]
    clock.advance(30)
    m.tick()
    assert a.reason == "idle_pressure" and b.state == LeaseState.GRANTED


def test_pressure_needs_someone_the_gpus_would_serve(make):
    m, clock = make(gpus=4, nodes=2, **PRESSURE)
    a, _ = m.request(ALICE, {"gpus": 1, "heartbeat": False})
    y, _ = m.request(CAROL, {"gpus": 1, "heartbeat": False})
    z, _ = m.request(CAROL, {"gpus": 2, "heartbeat": False})
    assert a.node == y.node != z.node
    gang, _ = m.request(BOB, {"gpus": 2, "heartbeat": False, "locality": "node"})
    assert gang.state == LeaseState.QUEUED  # freeing a's GPU would not serve it: y holds the other one
    clock.advance(120)
    for busy in (y, z):
        m.heartbeat(busy.id, CAROL, active=True)
    m.tick()
    assert a.state == LeaseState.IDLE and not events_of(m, "warning")
    m.release(gang.id, BOB)  # nobody waits: the lease's own idle timeout holds
    clock.advance(400)
    m.tick()
    assert a.state == LeaseState.IDLE
    clock.advance(75)
    m.tick()
    assert [(w["lease_id"], w["deadline"]) for w in events_of(m, "warning")] == [(a.id, a.last_activity + 600)]
    clock.advance(10)
    m.tick()
    assert a.state == LeaseState.REVOKED and a.reason == "idle"


@pytest.mark.parametrize("small_first", [0, 1])
def test_pressure_serves_a_one_gpu_cell_that_goes_before_a_gang(make, small_first):
    """With small_first_gpus the one-GPU cell behind a gang goes first, so an idle lease's GPU serves it: the lease
    is warned and revoked at the pressure timeout and the cell gets the GPU; without, the gang (which that GPU
    would not serve) is the head and the idle lease keeps its own timeout."""
    m, clock = make(gpus=4, nodes=2, small_first_gpus=small_first, **PRESSURE)
    a, _ = m.request(ALICE, {"gpus": 1, "heartbeat": False})
    y, _ = m.request(CAROL, {"gpus": 1, "heartbeat": False})
    z, _ = m.request(CAROL, {"gpus": 2, "heartbeat": False})
    gang, _ = m.request(BOB, {"gpus": 2, "heartbeat": False, "locality": "node"})
    cell, _ = m.request(BOB, {"gpus": 1, "heartbeat": False})
    assert gang.state == cell.state == LeaseState.QUEUED
    clock.advance(55)
    for busy in (y, z):
        m.heartbeat(busy.id, CAROL, active=True)
    m.tick()
    if not small_first:
        assert a.state == LeaseState.IDLE and not events_of(m, "warning")
        return
    assert [(w["lease_id"], w["deadline"]) for w in events_of(m, "warning")] == [(a.id, a.last_activity + 60)]
    assert a.state == LeaseState.IDLE  # not before the floor
    clock.advance(5)
    m.tick()
    assert a.state == LeaseState.REVOKED and a.reason == "idle_pressure"
    assert cell.state == LeaseState.GRANTED and cell.devices == a.devices and gang.state == LeaseState.QUEUED


def test_renew_within_and_beyond_maximum(make):
    m, clock = make(gpus=1, default_duration_seconds=100, max_duration_seconds=300)
    a, _ = m.request(ALICE, {"gpus": 1})
    clock.advance(50)
    m.renew(a.id, ALICE, "200s")
    assert a.expires_at == pytest.approx(clock.now() + 200)
    with pytest.raises(Forbidden) as e:
        m.renew(a.id, ALICE, "1h")
    assert e.value.reason == "max_duration"
    # in durations and a time of day, never raw seconds or the option's name (the item 14)
    msg = e.value.message
    assert "5 min" in msg and "4 min more" in msg and "max_duration_seconds" not in msg and " s " not in msg
    assert re.search(r"until \d\d:\d\d", msg), msg
    with pytest.raises(BadRequest):
        m.renew(a.id, ALICE, "soon")


def test_requested_duration_is_capped_by_policy(make):
    m, clock = make(gpus=1, max_duration_seconds=300)
    a, _ = m.request(ALICE, {"gpus": 1, "duration_seconds": "5h"})
    assert a.expires_at - a.granted_at == pytest.approx(300)


def test_users_cannot_see_or_act_on_others_leases(make):
    m, clock = make()
    a, _ = m.request(ALICE, {"gpus": 1})
    for action in (lambda: m.lookup(a.id, BOB), lambda: m.release(a.id, BOB), lambda: m.renew(a.id, BOB, 60),
                   lambda: m.heartbeat(a.id, BOB)):
        with pytest.raises(Forbidden):
            action()
    with pytest.raises(Forbidden):
        m.revoke(a.id, BOB)
    with pytest.raises(Forbidden):
        m.list_leases(BOB, everyone=True)
    assert m.list_leases(BOB) == []
    assert m.lookup(a.id, ADMIN) is a
    m.revoke(a.id, ADMIN, "maintenance")
    assert a.state == LeaseState.REVOKED and a.reason == "admin:maintenance"


def test_unknown_lease_and_double_release(make):
    m, clock = make()
    with pytest.raises(NotFound):
        m.lookup("l-nope", ALICE)
    a, _ = m.request(ALICE, {"gpus": 1})
    m.release(a.id, ALICE)
    with pytest.raises(InvalidTransition):
        m.release(a.id, ALICE)


def test_policy_refusals(make):
    m, clock = make(gpus=4, max_gpus_per_user=2)
    with pytest.raises(BadRequest) as e:
        m.request(ALICE, {"gpus": 8})
    assert e.value.reason == "too_large" and "4" in e.value.message
    with pytest.raises(Forbidden) as e2:
        m.request(ALICE, {"gpus": 3})
    assert e2.value.reason == "quota"
    with pytest.raises(BadRequest):
        m.request(ALICE, {"gpus": 1, "priority": "vip"})
    assert store_helpers.count(m.store) == 0  # nothing stored half-way


def test_cancel_queued(make):
    m, clock = make(gpus=1)
    m.request(ALICE, {"gpus": 1})
    b, _ = m.request(BOB, {"gpus": 1})
    m.release(b.id, BOB)
    assert b.state == LeaseState.CANCELLED and b.reason == "cancelled"


def test_restore_keeps_every_lease_and_queue_order(make, tmp_path):
    db = str(tmp_path / "l.db")
    m, clock = make(gpus=2, db=db)
    held = [m.request(ALICE, {"gpus": 1})[0] for _ in range(2)]
    queued = [m.request(BOB, {"gpus": 1})[0] for _ in range(3)]
    m2 = LeaseManager(Store(db), SimulatedInventory(gpus=2), m.policy, clock=clock)
    m2.restore()
    assert {lid for lid, lease in m2.leases.items() if lease.state == LeaseState.GRANTED} == {h.id for h in held}
    assert [q.lease_id for q in m2.state.queue] == [q.id for q in queued]
    devs = [d for lease in m2.leases.values() for d in lease.devices]
    assert len(devs) == len(set(devs)) == 2


def test_attach_rejects_foreign_and_unrelated_processes(make):
    m, clock = make()
    import os

    me = Identity("me", uid=os.getuid(), pid=os.getpid())
    a, _ = m.request(me, {"gpus": 1})
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        m.attach(a.id, me, child.pid)
        assert child.pid in a.pids
        other = Identity("me", uid=os.getuid(), pid=child.pid)  # caller is the child: parent is not its descendant
        with pytest.raises(Forbidden):
            m.attach(a.id, other, os.getpid())
        with pytest.raises(Forbidden):
            m.attach(a.id, Identity("me", uid=os.getuid() + 1, pid=os.getpid()), child.pid)
        with pytest.raises(BadRequest):
            m.attach(a.id, me, "1")
        # ending the lease stops the attached process group and drains the GPU until it is gone
        m.release(a.id, me)
        assert child.wait(5) == -15
        m.tick()
        assert m.summary()["free"] == 4
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize("learns", [False, True])
def test_pressure_learns_a_notebooks_usual_pause(make, learns):
    """With pressure_learns_pauses, a lease whose holder came back after 200 s pauses twice keeps its GPU for 200 s
    of idleness while someone waits (warned 10 s before), not the 60 s pressure timeout; a lease with no pause
    yet gets the 60 s. Without the option both get 60 s."""
    m, clock = make(gpus=2, pressure_learns_pauses=learns, **PRESSURE)
    notebook, _ = m.request(ALICE, {"gpus": 1, "heartbeat": False})
    for _ in range(2):  # two cells, each after a 200 s pause (nobody waits meanwhile)
        clock.advance(200)
        m.heartbeat(notebook.id, ALICE, active=True)
    fresh, _ = m.request(BOB, {"gpus": 1, "heartbeat": False})  # granted now: no pause yet
    waiting, _ = m.request(CAROL, {"gpus": 1, "heartbeat": False})
    clock.advance(61)
    m.tick()
    assert fresh.state == LeaseState.REVOKED and fresh.reason == "idle_pressure" and waiting.state == LeaseState.GRANTED
    again, _ = m.request(CAROL, {"gpus": 1, "heartbeat": False})  # someone else waits for the notebook's GPU
    m.tick()
    if not learns:
        assert notebook.state == LeaseState.REVOKED and again.state == LeaseState.GRANTED
        return
    assert notebook.state == LeaseState.IDLE and m.view(notebook)["idle_deadline"] == pytest.approx(
        notebook.last_activity + 200)
    for step in (200 - 61 - 10, 10):
        clock.advance(step)
        m.heartbeat(waiting.id, CAROL, active=True)  # the cell that got the fresh lease's GPU runs
        m.tick()
        if step != 10:
            warned = [w["deadline"] for w in events_of(m, "warning") if w["lease_id"] == notebook.id]
            assert warned[-1] == pytest.approx(notebook.last_activity + 200) and notebook.state == LeaseState.IDLE
    assert notebook.state == LeaseState.REVOKED and notebook.reason == "idle_pressure"
    assert again.state == LeaseState.GRANTED and again.devices == notebook.devices
