"""What each lease used, with a real broker process: peak GPU memory and mean/peak utilisation from the fake
NVML driver's per-process and device figures, in the lease view, the end event, the metrics and after a
restart; and an older store (schema 1) that opens with the new column."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from broker_process import scrape_metrics
from fake_nvml import FakeNvml, FakeProc
from nvml_helpers import EventLog, Worker, wait_for

from lease_broker.core.identity import Identity
from lease_broker.core.lease import Change, Lease, LeaseRequest, LeaseState
from lease_broker.core.lease_use import LeaseUse
from lease_broker.store.lease_store import SCHEMA_VERSION, Store

GIB = 1 << 30
NVML_ARGS = ["--inventory=nvml", "--tick=0.1", "--LeaseBroker.sample_seconds=0.1"]


@pytest.fixture
def state(tmp_path: Path) -> FakeNvml:
    return FakeNvml.standard(tmp_path / "nvml.state", 2)


def test_per_process_figures_in_the_view_the_end_event_the_metrics_and_after_a_restart(
        broker_factory, state: FakeNvml, tmp_path: Path) -> None:
    broker = broker_factory(args=NVML_ARGS, env=state.env())
    c = broker.client()
    events = EventLog(broker.socket)
    try:
        with Worker(tmp_path) as w:
            lease = c.request_lease(1, heartbeat=False)
            assert lease["usage"]["samples"] == 0 and lease["usage"]["peak_memory"] is None
            assert lease["usage"]["held_memory"] == 80 * GIB
            c.attach(lease["id"], w.pid)
            idx = lease["devices"][0]["index"]
            other = Worker(tmp_path, "other")  # another user's process on the same GPU is not the lease's
            try:
                state.procs = [FakeProc(idx, w.pid, 6 * GIB, sm=40), FakeProc(idx, other.pid, 20 * GIB, sm=50)]
                state.write()
                wait_for(lambda: c.lease(lease["id"])["usage"]["peak_memory"] == 6 * GIB, 10, "6 GiB measured")
                state.procs = [FakeProc(idx, w.pid, 2 * GIB, sm=80)]
                state.write()
                u = wait_for(lambda: (u := c.lease(lease["id"])["usage"])["peak_utilization"] == 80 and u, 10, "80 %")
            finally:
                other.kill()
            assert u["peak_memory"] == 6 * GIB  # the peak stays
            assert 0 < u["mean_utilization"] < 80 and u["source"] == "process"  # samples before the work count as 0
            text = scrape_metrics(broker.socket)
            assert f'gpulease_lease_peak_memory_bytes{{lease="{lease["id"]}",user="{lease["user"]}"}} 6.442450944e+09' \
                in text
            c.release(lease["id"])
        ended = events.wait("lease", timeout=10, change="released")["lease"]
        assert ended["usage"]["peak_memory"] == 6 * GIB and ended["usage"]["peak_utilization"] == 80
        wait_for(lambda: "gpulease_ended_lease_peak_memory_bytes_count 1.0" in scrape_metrics(broker.socket), 10,
                 "the ended lease in the histogram")
        text = scrape_metrics(broker.socket)
        assert 'gpulease_ended_lease_peak_memory_bytes_bucket{le="8.589934592e+09"} 1.0' in text
        assert 'gpulease_ended_lease_peak_memory_bytes_bucket{le="4.294967296e+09"} 0.0' in text
        assert f'lease="{lease["id"]}"' not in text  # no gauge for a lease that ended
    finally:
        events.close()
    broker.restart()
    after = broker.client().lease(lease["id"])
    assert after["usage"] == ended["usage"]
    history = broker.client().request("GET", f"/api/v1/leases/{lease['id']}/history")
    assert history["usage"] == ended["usage"] and history["transitions"][-1]["to"] == "released"


def test_device_figures_where_nvml_lists_no_process_and_none_on_a_shared_gpu(broker_factory, state: FakeNvml) -> None:
    for g in state.gpus:
        g.proc_util = False  # no per-process counters
    state.write()
    broker = broker_factory(args=NVML_ARGS, env=state.env())
    c = broker.client()
    whole = c.request_lease(1, heartbeat=False)
    shared = c.request_lease(0.5, heartbeat=False)
    assert whole["devices"][0]["index"] != shared["devices"][0]["index"]
    state.gpus[whole["devices"][0]["index"]].memory_used = 30 * GIB
    state.gpus[whole["devices"][0]["index"]].util = (70, 10)
    state.gpus[shared["devices"][0]["index"]].memory_used = 9 * GIB
    state.gpus[shared["devices"][0]["index"]].util = (90, 10)
    state.write()
    u = wait_for(lambda: (u := c.lease(whole["id"])["usage"])["peak_memory"] == 30 * GIB and u, 10, "device memory")
    assert u["source"] == "device" and u["peak_utilization"] == 70
    # a shared GPU's device figures are not one lease's: not measured
    assert c.lease(shared["id"])["usage"] == {"samples": 0, "peak_memory": None, "held_memory": 40 * GIB,
                                              "mean_utilization": None, "peak_utilization": None, "source": None}


def test_an_older_store_opens_with_the_usage_column(tmp_path: Path) -> None:
    db = str(tmp_path / "old.db")
    store = Store(db)
    old = Lease(id="l-old", user="alice", uid=1001, request=LeaseRequest(), state=LeaseState.QUEUED, created_at=1.0)
    store.insert(old, 1.0)
    store.close()
    con = sqlite3.connect(db)  # as a version 1 store was: no usage column
    con.execute("ALTER TABLE leases DROP COLUMN usage")
    con.execute("UPDATE meta SET value='1' WHERE key='schema_version'")
    con.commit()
    con.close()
    store = Store(db)
    assert store.db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == str(SCHEMA_VERSION)
    loaded = store.get("l-old")
    assert loaded is not None and loaded.use == LeaseUse()
    use = LeaseUse().add(3 * GIB, 50.0, "process")
    Change(state=LeaseState.CANCELLED, reason="cancelled", use=use).apply(loaded, 2.0)
    store.transition(loaded, LeaseState.QUEUED, 2.0)
    assert store.get("l-old").use == use  # type: ignore[union-attr]
    store.close()


def test_samples_grow_the_figures_without_a_store_write(tmp_path: Path) -> None:
    """The figures change at every sample in memory only (the owner's soft change); the end stores them."""
    import os
    import subprocess
    import sys

    from lease_broker.core.clock import VirtualClock
    from lease_broker.inventory.simulated import SimulatedInventory
    from lease_broker.manager.manager import LeaseManager
    from lease_broker.policy.lease_policy import LeasePolicy

    inv = SimulatedInventory(gpus=1)
    m = LeaseManager(Store(str(tmp_path / "s.db")), inv, LeasePolicy(), clock=VirtualClock())
    m.restore()
    me = Identity("me", uid=os.getuid(), pid=os.getpid())
    proc = subprocess.Popen([sys.executable, "-c", "x = bytearray(200 << 20); import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)
    try:
        lease, _ = m.request(me, {"gpus": 1})
        m.attach(lease.id, me, proc.pid)
        m.tick()  # the simulated inventory learns the lease's processes
        wait_for(lambda: sum(inv.sample()[lease.devices[0]].pids.values()) > 200 << 20, 10, "the 200 MiB resident")
        before = m.store.db.total_changes
        for _ in range(3):
            m.samples = inv.sample()
        assert m.store.db.total_changes == before
        assert lease.use.samples == 3 and lease.use.peak_memory > 200 << 20 and lease.use.source == "process"
        assert m.store.get(lease.id).use.samples == 0  # type: ignore[union-attr]
        m.release(lease.id, me)
        assert m.store.get(lease.id).use == lease.use  # type: ignore[union-attr]
    finally:
        proc.kill()
        proc.wait()
