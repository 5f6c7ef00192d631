"""The Holders part and the holder facts of a lease (issue 31): recorded with the request, stored, restored, watched
on the event loop, and shown in the lease view. Real child processes stand for the kernels."""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from waiting import wait_until

from lease_broker.core.clock import VirtualClock
from lease_broker.core.errors import BadRequest
from lease_broker.core.identity import Identity
from lease_broker.core.lease import Lease, LeaseRequest, LeaseState, parse_request
from lease_broker.host.procs import proc_info
from lease_broker.inventory.simulated import SimulatedInventory
from lease_broker.manager.manager import LeaseManager
from lease_broker.manager.views import holder_view
from lease_broker.policy.lease_policy import LeasePolicy
from lease_broker.store.lease_store import SCHEMA_VERSION, Store

ALICE = Identity("alice", uid=1001)


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    p = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    yield p
    if p.poll() is None:
        p.kill()
    p.wait(10)


def make(db: str = ":memory:", gpus: int = 4) -> LeaseManager:
    m = LeaseManager(Store(db), SimulatedInventory(gpus=gpus), LeasePolicy(default_idle_timeout_seconds=0,
                                                                          heartbeat_timeout=60.0),
                     clock=VirtualClock())
    m.restore()
    return m


def as_caller(p: subprocess.Popen[bytes]) -> Identity:
    return Identity("alice", uid=1001, pid=p.pid)


# ------------------------------------------------------------------ the request's fields
@pytest.mark.parametrize("name", ["ends_with_caller", "grow"])
def test_the_fields_are_booleans_default_false(name):
    assert getattr(parse_request({"gpus": 1}), name) is False
    assert getattr(parse_request({"gpus": 1, name: True}), name) is True
    for bad in ("yes", 1, None):
        with pytest.raises(BadRequest) as e:
            parse_request({"gpus": 1, name: bad})
        assert name in e.value.message and repr(bad) in e.value.message


# ------------------------------------------------------------------ recorded with the request
def test_the_holder_is_the_callers_process_only_when_asked_and_visible(child):
    m = make()
    me, _ = m.request(as_caller(child), {"gpus": 1, "ends_with_caller": True})
    info = proc_info(child.pid)
    assert info is not None and me.holder == (child.pid, info.start_ticks)
    plain, _ = m.request(as_caller(child), {"gpus": 1})
    unseen, _ = m.request(ALICE, {"gpus": 1, "ends_with_caller": True})  # pid 0: another pid namespace, TCP
    assert plain.holder is None and unseen.holder is None
    assert m.store.get(me.id).holder == me.holder  # stored with the lease
    assert not m.holders.watched(me)  # no event loop: nothing watched (the heartbeat stays the bound)


def test_a_schema_2_store_gets_the_holder_column(tmp_path: Path, child):
    db = str(tmp_path / "old.db")
    m = make(db)
    lease, _ = m.request(ALICE, {"gpus": 1})
    m.store.close()
    with sqlite3.connect(db) as raw:
        raw.execute("ALTER TABLE leases DROP COLUMN holder")
        raw.execute("UPDATE meta SET value='2' WHERE key='schema_version'")
    m = make(db)
    assert m.leases[lease.id].holder is None
    held, _ = m.request(as_caller(child), {"gpus": 1, "ends_with_caller": True})
    assert m.store.get(held.id).holder == held.holder
    with sqlite3.connect(db) as raw:
        assert raw.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone() == (str(SCHEMA_VERSION),)


# ------------------------------------------------------------------ restored
def test_a_restart_keeps_a_live_holders_leases_and_ends_a_gone_ones(tmp_path: Path, child):
    db = str(tmp_path / "l.db")
    m = make(db, gpus=2)
    held, _ = m.request(as_caller(child), {"gpus": 2, "ends_with_caller": True})
    queued, _ = m.request(as_caller(child), {"gpus": 2, "ends_with_caller": True})
    other, _ = m.request(ALICE, {"gpus": 1})
    assert (held.state, queued.state, other.state) == (LeaseState.GRANTED, LeaseState.QUEUED, LeaseState.QUEUED)
    m.store.close()
    m = make(db, gpus=2)
    assert {lease.id: lease.state for lease in m.leases.values()} == {
        held.id: LeaseState.GRANTED, queued.id: LeaseState.QUEUED, other.id: LeaseState.QUEUED}
    assert m.holders.leases_of == {held.holder: {held.id, queued.id}}
    m.store.close()
    child.kill()
    child.wait(10)
    m = make(db, gpus=2)
    assert {h["to"]: h["reason"] for h in m.store.history(held.id)}["revoked"] == "holder_exited"
    assert {h["to"]: h["reason"] for h in m.store.history(queued.id)}["cancelled"] == "holder_exited"
    assert m.leases[other.id].state == LeaseState.GRANTED  # the freed GPUs went to the next in line, not to queued
    assert m.holders.ended_total == {"exited": 2, "heartbeat": 0}


# ------------------------------------------------------------------ watched on the loop
def test_one_watch_per_holder_process_ends_its_leases_at_its_exit_and_closes_with_its_last_lease(child):
    async def run() -> None:
        m = make(gpus=2)
        m.driver.attach(asyncio.get_running_loop())  # driven by this loop, as the service drives the broker
        who = as_caller(child)
        a, _ = m.request(who, {"gpus": 1, "ends_with_caller": True})
        b, _ = m.request(who, {"gpus": 1, "ends_with_caller": True})
        await m.settled()
        assert m.holders.watched(a) and m.holders.watched(b)
        assert m.holders.watch.watched() == [a.holder]  # one pidfd for the process
        m.release(a.id, who)
        await m.settled()
        assert m.holders.watch.watched() == [a.holder]
        m.release(b.id, who)
        await m.settled()
        assert m.holders.watch.watched() == [] and m.holders.leases_of == {}  # closed with its last lease

        c, _ = m.request(who, {"gpus": 1, "ends_with_caller": True})
        d, _ = m.request(who, {"gpus": 2, "ends_with_caller": True})  # queued behind c
        await m.settled()
        m.clock.advance(120)  # a watched holder is not revoked for silence (heartbeat_timeout 60 s)
        m.tick()
        assert c.state.holding
        child.kill()
        await wait_until(lambda: c.state.terminal and d.state.terminal, 5, "both leases to end with their holder")
        assert (c.state, c.reason, d.state, d.reason) == (LeaseState.REVOKED, "holder_exited",
                                                          LeaseState.CANCELLED, "holder_exited")
        await m.settled()
        assert m.holders.watch.watched() == [] and m.holders.ended_total["exited"] == 2

    asyncio.run(run())


# ------------------------------------------------------------------ the view
def _lease(**kw) -> Lease:
    fields = {"id": "l-1", "user": "alice", "uid": 1001, "request": LeaseRequest(), "state": LeaseState.GRANTED,
              "created_at": 0.0, "last_heartbeat": 100.0}
    return Lease(**{**fields, **kw})


@pytest.mark.parametrize("lease, watched, alive, now, want", [
    (_lease(holder=(1234, 5)), True, True, 100.0, {"pid": 1234, "watched": True, "alive": True}),
    (_lease(holder=(1234, 5)), False, False, 100.0, {"pid": 1234, "watched": False, "alive": False, "gone": True}),
    (_lease(), False, False, 103.0, {"pid": None, "watched": False, "alive": True, "ago": 3}),
    (_lease(), False, False, 145.0, {"pid": None, "watched": False, "alive": False, "silent": 45}),
    (_lease(request=LeaseRequest(heartbeat=False)), False, False, 1e6, {"pid": None, "alive": True, "text": ""}),
    (_lease(state=LeaseState.QUEUED), False, False, 1e6, {"pid": None, "alive": True, "text": ""}),
])
def test_the_holder_view_says_who_holds_the_lease(lease, watched, alive, now, want):
    got = holder_view(lease, watched, alive, now, heartbeat_timeout=60.0)
    assert set(got) == {"pid", "watched", "alive", "text"}
    for key in ("pid", "watched", "alive", "text"):
        if key in want:
            assert got[key] == want[key], (key, got)
    if "gone" in want:
        assert "1234" in got["text"] and "gone" in got["text"]
    if "ago" in want:
        assert str(want["ago"]) in got["text"]
    if "silent" in want:
        assert "no heartbeat" in got["text"] and str(want["silent"]) in got["text"] and "60" in got["text"]
