"""Group commit: the writes of one event-loop iteration share one transaction, nothing leaves before it commits,
and a failed commit leaves the broker as if the iteration's changes never happened.

A real LeaseManager on a real SQLite file, driven by a running asyncio loop (``Driver.attach``, as the service
does); a second
connection reads the file to see what is durable. The failing commit is a real SQLite one: a deferred foreign
key, checked only at COMMIT, broken by a trigger for the user named ``poison``.
"""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest
from waiting import wait_until

from lease_broker.core.identity import Identity
from lease_broker.core.lease import LeaseState
from lease_broker.inventory.simulated import SimulatedInventory
from lease_broker.manager.manager import LeaseManager
from lease_broker.policy.lease_policy import LeasePolicy
from lease_broker.store.lease_store import Store, StoreError

ALICE = Identity("alice", uid=1001)
BOB = Identity("bob", uid=1002)
POISON = Identity("poison", uid=1003)

POISON_AT_COMMIT = """
CREATE TABLE parent (id INTEGER PRIMARY KEY);
CREATE TABLE child (p INTEGER REFERENCES parent(id) DEFERRABLE INITIALLY DEFERRED);
CREATE TRIGGER poison AFTER INSERT ON leases WHEN NEW.user = 'poison' BEGIN INSERT INTO child VALUES (42); END;
"""


def make(tmp_path: Path, gpus: int = 2) -> LeaseManager:
    policy = LeasePolicy(heartbeat_timeout=1e9, default_idle_timeout_seconds=0, unix_groups=False)
    m = LeaseManager(Store(str(tmp_path / "leases.db")), SimulatedInventory(gpus=gpus), policy)
    m.restore()
    return m


def durable_ids(tmp_path: Path) -> set[str]:
    db = sqlite3.connect(tmp_path / "leases.db")
    try:
        return {r[0] for r in db.execute("SELECT id FROM leases")}
    finally:
        db.close()


def test_one_iteration_is_one_transaction_and_answers_wait_for_it(tmp_path: Path) -> None:
    m = make(tmp_path, gpus=2)

    async def scenario() -> None:
        m.driver.attach(asyncio.get_running_loop())  # driven by this loop, as the service drives the broker
        groups = m.group.groups
        leases = [m.request(who, {"gpus": 1})[0] for who in (ALICE, BOB, ALICE)]
        assert durable_ids(tmp_path) == set()  # written, not committed: nothing has left yet
        assert not m.events.backlog  # nor has any event
        await m.settled()  # what an answer waits for
        assert durable_ids(tmp_path) == {x.id for x in leases}
        assert [x.state for x in leases] == [LeaseState.GRANTED, LeaseState.GRANTED, LeaseState.QUEUED]
        assert m.group.groups == groups + 1  # three requests and two grants: one transaction
        kinds = [(e["lease"]["id"], e["change"]) for e in m.events.backlog if e["type"] == "lease"]
        assert kinds == [(leases[0].id, "queued"), (leases[1].id, "queued"), (leases[2].id, "queued"),
                         (leases[0].id, "granted"), (leases[1].id, "granted")]
        m.release(leases[0].id, ALICE)
        await m.settled()  # the release is stored; then its processes are stopped, then a pass hands the GPU on
        assert leases[0].state == LeaseState.RELEASED and leases[2].state == LeaseState.QUEUED
        await m.settled()
        assert leases[2].state == LeaseState.GRANTED
        db = sqlite3.connect(tmp_path / "leases.db")
        states = dict(db.execute("SELECT id, state FROM leases").fetchall())
        db.close()
        assert states == {leases[0].id: "released", leases[1].id: "granted", leases[2].id: "granted"}

    asyncio.run(scenario())
    m.store.close()


def test_a_failed_commit_undoes_the_whole_iteration_and_fails_its_answers(tmp_path: Path) -> None:
    m = make(tmp_path, gpus=2)
    m.store.db.executescript(POISON_AT_COMMIT)

    async def scenario() -> None:
        m.driver.attach(asyncio.get_running_loop())  # driven by this loop, as the service drives the broker
        kept, _ = m.request(BOB, {"gpus": 1})
        await m.settled()
        assert kept.state == LeaseState.GRANTED
        events = len(m.events.backlog)
        before = {g["id"]: g["state"] for g in m.gpu_views(ALICE)}

        a, _ = m.request(ALICE, {"gpus": 1})  # granted in memory by the iteration's pass ...
        p, _ = m.request(POISON, {"gpus": 1})
        m.release(kept.id, BOB)
        with pytest.raises(StoreError) as e:  # ... but its commit fails: every answer of the iteration says so
            await m.settled()
        assert "cannot be written" in e.value.message and "nothing was changed" in e.value.message
        # memory is what the store holds: the new requests never were, the release did not happen
        assert set(m.leases) == {kept.id} and kept.state == LeaseState.GRANTED
        assert a.id not in m.state.queue and p.id not in m.state.queue and not len(m.state.queue)
        assert {g["id"]: g["state"] for g in m.gpu_views(ALICE)} == before
        later = await wait_until(lambda: list(m.events.backlog)[events:], 5, "the GPU summary (throttled)")
        assert not [e for e in later if e["type"] == "lease"]  # no event for what was not stored
        assert later and all(e["summary"]["free"] == 1 and e["summary"]["queued"] == 0 for e in later)
        assert durable_ids(tmp_path) == {kept.id}

        # the broker goes on: the next iteration commits
        again, _ = m.request(ALICE, {"gpus": 1})
        await m.settled()
        assert again.state == LeaseState.GRANTED and durable_ids(tmp_path) == {kept.id, again.id}

    asyncio.run(scenario())
    m.store.close()
    restarted = make(tmp_path)
    assert {x.id: x.state for x in restarted.leases.values()} == {
        lid: LeaseState.GRANTED for lid in durable_ids(tmp_path)}
    restarted.store.close()


def test_a_write_of_its_own_commits_the_open_group_first(tmp_path: Path) -> None:
    """A write with a transaction of its own (tokens, written by the `lease-broker token` command): an open group
    commits before one starts, so each keeps its all-or-nothing answer."""
    m = make(tmp_path)

    async def scenario() -> None:
        m.driver.attach(asyncio.get_running_loop())  # driven by this loop, as the service drives the broker
        lease, _ = m.request(ALICE, {"gpus": 1})
        assert m.group.open and durable_ids(tmp_path) == set()
        m.store.add_token("h" * 64, "alice", False, 1.0)
        assert not m.group.open and durable_ids(tmp_path) == {lease.id}
        await m.settled()
        assert lease.state == LeaseState.GRANTED and durable_ids(tmp_path) == {lease.id}

    asyncio.run(scenario())
    m.store.close()


def test_without_an_event_loop_every_write_commits_at_once(tmp_path: Path) -> None:
    m = make(tmp_path)
    lease, _ = m.request(ALICE, {"gpus": 1})
    assert lease.state == LeaseState.GRANTED and not m.group.open
    assert durable_ids(tmp_path) == {lease.id}
    m.store.close()


def test_without_a_loop_each_write_is_a_group_of_its_own_through_the_same_path(tmp_path: Path) -> None:
    """The replay and the unit tests attach no loop: the same group commit stores each write at once, and a failed
    one raises to its writer with memory put back, as a failed iteration does under a loop."""
    m = make(tmp_path, gpus=1)
    m.store.db.executescript(POISON_AT_COMMIT)
    groups = m.group.groups
    kept, _ = m.request(ALICE, {"gpus": 1})
    assert kept.state == LeaseState.GRANTED and durable_ids(tmp_path) == {kept.id}
    assert m.group.groups >= groups + 2 and not m.group.open  # the request and its grant: one group each
    m.reserve(Identity("root", uid=0, admin=True), {"user": "alice", "gpus": 1, "start": m.clock.now() + 3600, "duration_seconds": 60})  # a group too
    assert not m.group.open
    with pytest.raises(StoreError):
        m.request(POISON, {"gpus": 1})
    assert set(m.leases) == {kept.id} and not len(m.state.queue) and durable_ids(tmp_path) == {kept.id}
    m.store.close()
