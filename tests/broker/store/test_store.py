"""The store's restart path: every live lease back exactly as written, damaged rows named."""

from __future__ import annotations

import sqlite3
import uuid
from pathlib import Path

import pytest

from lease_broker.core.lease import Lease, LeaseRequest, LeaseState, Preempting, Suspension
from lease_broker.inventory.simulated import _NAMESPACE, SimulatedInventory, gpu_uuid
from lease_broker.store import lease_store as store_module
from lease_broker.store.admin_store import AdminStore
from lease_broker.store.lease_store import SCHEMA_VERSION, Store, StoreError
from lease_broker.store.notify_store import NotifyStore


def _fill(db: str, n: int) -> list[Lease]:
    store = Store(db)
    gpus = SimulatedInventory(gpus=n, nodes=2).discover()
    out = []
    for i in range(n):
        lease = Lease(id=f"l-{i:04d}", user="ada", uid=1000, seq=i, state=LeaseState.QUEUED, reason="requested",
                      request=LeaseRequest(min_gpus=1, max_gpus=1, labels={"cell": f"In[{i}]", "ü": "ø"}),
                      created_at=1.0 + i, duration_seconds=60.0, idle_timeout_seconds=30.0)
        store.insert(lease, lease.created_at)
        if i % 2:  # half of them granted, with devices and attached processes
            lease.state, lease.reason, lease.devices, lease.node = LeaseState.GRANTED, "granted", [gpus[i].id], "n"
            lease.processes = {100 + i: 5000 + i}
            store.transition(lease, LeaseState.QUEUED, 2.0 + i)
        out.append(lease)
    store.close()
    return out


def test_live_returns_every_lease_as_written(tmp_path: Path) -> None:
    written = _fill(str(tmp_path / "s.db"), 40)
    got = Store(str(tmp_path / "s.db")).live()
    assert [x.id for x in got] == [x.id for x in written]  # arrival order
    for a, b in zip(got, written, strict=True):
        assert (a.state, a.devices, a.processes, a.request.labels) == (b.state, b.devices, b.processes, b.request.labels)
        assert a == b and type(a.state) is LeaseState  # every field


def test_live_reads_only_live_leases_through_the_partial_index(tmp_path: Path) -> None:
    db = str(tmp_path / "s.db")
    written = _fill(db, 10)
    store = Store(db)
    ended = written[1]
    ended.state, ended.reason, ended.ended_at = LeaseState.RELEASED, "released", 50.0
    store.transition(ended, LeaseState.GRANTED, 50.0)
    early = Lease(id="l-early", user="bo", uid=1001, seq=-1, state=LeaseState.QUEUED, reason="requested",
                  request=LeaseRequest(min_gpus=1, max_gpus=1), created_at=0.5, duration_seconds=60.0,
                  idle_timeout_seconds=30.0)
    store.insert(early, early.created_at)  # stored last, arrived first
    got = store.live()
    assert [x.id for x in got] == ["l-early"] + [x.id for x in written if x is not ended]
    plan = " ".join(str(r) for r in store.db.execute("EXPLAIN QUERY PLAN " + store_module._LIVE))
    assert "USING INDEX leases_state" in plan  # not a scan of every lease ever stored


@pytest.mark.parametrize("damage", ["{not json", '{"min_gpus": 1}],[{}'])
def test_a_damaged_row_is_named_not_skipped(tmp_path: Path, damage: str) -> None:
    db = str(tmp_path / "s.db")
    _fill(db, 6)
    with sqlite3.connect(db) as raw:
        raw.execute("UPDATE leases SET request=? WHERE id='l-0003'", (damage,))
    # the fast path parses every row in one document; damage must not shift rows or drop leases silently
    with pytest.raises(StoreError) as e:
        Store(db).live()
    assert "'l-0003'" in e.value.message and "backup" in e.value.message


STORE_TABLES = {"meta", "leases", "transitions", "drains", "tokens"}
ADMIN_TABLES = {"reservations", "policy_audit", "learned_groups"}


def _tables(db: str) -> set[str]:
    with sqlite3.connect(db) as raw:
        return {r[0] for r in raw.execute("SELECT name FROM sqlite_master WHERE type='table'")} - {"sqlite_sequence"}


def test_a_new_store_gets_every_table(tmp_path: Path) -> None:
    db = str(tmp_path / "new.db")
    store = Store(db)
    AdminStore(store)
    NotifyStore(store)
    store.close()
    assert _tables(db) == STORE_TABLES | ADMIN_TABLES | {"notify_prefs", "notify_outbox"}
    Path(tmp_path / "empty.db").touch()  # an empty file is a new store too
    Store(str(tmp_path / "empty.db")).close()
    assert STORE_TABLES <= _tables(str(tmp_path / "empty.db"))


@pytest.mark.parametrize("table", ["transitions", "leases", "meta", "reservations"])
def test_a_dropped_table_is_refused_naming_it_never_recreated_empty(tmp_path: Path, table: str) -> None:
    db = str(tmp_path / "s.db")
    _fill(db, 2)
    AdminStore(Store(db)).store.close()
    with sqlite3.connect(db) as raw:
        raw.execute(f"DROP TABLE {table}")
    with pytest.raises(StoreError) as e:
        AdminStore(Store(db))
    assert repr(table) in e.value.message and db in e.value.message and "backup" in e.value.message
    assert table not in _tables(db)  # not recreated empty


def test_an_older_store_without_newer_tables_gets_them_and_is_upgraded(tmp_path: Path) -> None:
    """A schema-1 store of a broker from before the admin tables and leases.usage: opened, upgraded, nothing lost."""
    db = str(tmp_path / "old.db")
    written = _fill(db, 4)
    with sqlite3.connect(db) as raw:
        for table in ADMIN_TABLES:
            raw.execute(f"DROP TABLE IF EXISTS {table}")
        raw.execute("DELETE FROM meta WHERE key='tables'")  # what an older broker kept
        raw.execute("ALTER TABLE leases DROP COLUMN usage")
        raw.execute("UPDATE meta SET value='1' WHERE key='schema_version'")
    store = Store(db)
    AdminStore(store)
    assert [x.id for x in store.live()] == [x.id for x in written]
    store.close()
    assert ADMIN_TABLES <= _tables(db)
    with sqlite3.connect(db) as raw:
        assert raw.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone() == (str(SCHEMA_VERSION),)


def test_simulated_gpu_ids_are_the_uuid5_ids_leases_refer_to() -> None:
    # persisted leases name GPUs by these ids: the fast formatting must give exactly uuid5's
    for name in ("n/0", "sim-node-12/7", "ü/3"):
        assert gpu_uuid(name) == str(uuid.uuid5(_NAMESPACE, name))


def test_a_schema_3_store_folds_its_processes_and_preemptions_into_the_leases(tmp_path: Path) -> None:
    """Schema 4 keeps a lease's processes (with their start ticks) and its preemption warning on the lease row;
    a schema-3 store's side tables move into those columns and are dropped, nothing lost."""
    db = str(tmp_path / "v3.db")
    written = _fill(db, 4)
    granted = [x for x in written if x.processes]
    with sqlite3.connect(db) as raw:
        raw.execute("ALTER TABLE leases DROP COLUMN preempting")
        raw.execute("CREATE TABLE processes (lease_id TEXT NOT NULL, pid INTEGER NOT NULL, "
                    "start_ticks INTEGER NOT NULL, PRIMARY KEY (lease_id, pid))")
        raw.execute("CREATE TABLE preemptions (lease_id TEXT PRIMARY KEY, by_lease TEXT NOT NULL, by_user TEXT NOT "
                    "NULL, by_class TEXT NOT NULL, warned_at REAL NOT NULL, deadline REAL NOT NULL)")
        for x in granted:  # a schema-3 row kept bare pids; their start ticks were in the processes table
            raw.execute("UPDATE leases SET pids=? WHERE id=?", (f"[{next(iter(x.processes))}]", x.id))
            raw.executemany("INSERT INTO processes VALUES (?,?,?)", [(x.id, p, t) for p, t in x.processes.items()])
        raw.execute("INSERT INTO preemptions VALUES (?,?,?,?,?,?)", (granted[0].id, "l-9999", "bo", "high", 5.0, 35.0))
        raw.execute("UPDATE meta SET value='3' WHERE key='schema_version'")
    store = Store(db)
    live = {x.id: x for x in store.live()}
    store.close()
    assert {x.id: x.processes for x in granted} == {x.id: live[x.id].processes for x in granted}
    assert live[granted[0].id].preempting == Preempting("l-9999", "bo", "high", 5.0, 35.0)
    assert not {"processes", "preemptions"} & _tables(db)


def test_a_schema_4_store_gets_the_suspension_columns_and_a_partial_index_that_lists_suspended(tmp_path: Path) -> None:
    """Schema 5 keeps a lease's suspension on its row; a schema-4 store gets the three columns (defaults: none,
    0 s, 0 times) and its partial index leases_state made again with 'suspended', so that the live query (which
    names the same states) still uses it and a suspended lease is found at a restart."""
    db = str(tmp_path / "v4.db")
    written = _fill(db, 4)
    with sqlite3.connect(db) as raw:
        for column in ("suspension", "suspended_seconds", "suspensions"):
            raw.execute(f"ALTER TABLE leases DROP COLUMN {column}")
        raw.execute("DROP INDEX leases_state")
        raw.execute("CREATE INDEX leases_state ON leases(state) WHERE state IN ('queued','granted','active','idle')")
        raw.execute("UPDATE meta SET value='4' WHERE key='schema_version'")
    store = Store(db)
    live = store.live()
    assert [x.id for x in live] == [x.id for x in written]
    assert all(x.suspension is None and x.suspended_seconds == 0 and x.suspensions == 0 for x in live)
    lease = next(x for x in live if x.devices)
    lease.suspension = Suspension("idle", 5.0, 65.0, 10.0, devices=tuple(lease.devices), model="H100", how="stop")
    lease.state, lease.devices, lease.suspensions = LeaseState.SUSPENDED, [], 1
    store.transition(lease, LeaseState.GRANTED, 10.0)
    plan = " ".join(str(r) for r in store.db.execute("EXPLAIN QUERY PLAN " + store_module._LIVE))
    store.close()
    assert "leases_state" in plan
    again = {x.id: x for x in Store(db).live()}
    assert again[lease.id].state == LeaseState.SUSPENDED and again[lease.id].suspension == lease.suspension
    with sqlite3.connect(db) as raw:
        assert raw.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone() == ("5",)
