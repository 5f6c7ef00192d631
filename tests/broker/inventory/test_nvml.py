"""The NVML inventory over the fake libnvidia-ml.so.1 (through the real pynvml bindings):
devices, topology, processes, utilisation, errors; and a real broker process using it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_nvml import FakeNvml, FakeProc
from nvml_helpers import EventLog, Worker, wait_for

from lease_broker.inventory.nvml import NVMLInventory

NVML_ARGS = ["--tick=0.1", "--LeaseBroker.sample_seconds=0.2",
             "--NVMLInventory.activity_window_seconds=0.5"]


@pytest.fixture
def fake(fake_driver) -> FakeNvml:  # type: ignore[no-untyped-def]
    return fake_driver(4)


@pytest.fixture
def inv(fake: FakeNvml) -> Iterator[NVMLInventory]:
    inventory = NVMLInventory(node_name="host", activity_window_seconds=0.0)
    yield inventory
    inventory.close()


# ---------------------------------------------------------------------- the inventory in-process
def test_devices_come_from_nvml(inv: NVMLInventory, fake: FakeNvml, caplog: pytest.LogCaptureFixture) -> None:
    fake.gpus[1].mig = 0  # MIG-capable, MIG mode off: a whole GPU
    fake.gpus[2].mig = 1  # MIG mode on but no MIG device made: nothing of it to lease
    fake.gpus[3].name = "NVIDIA A100-SXM4-40GB"
    fake.gpus[3].memory_total = 40 << 30
    fake.write()
    gpus = inv.discover()
    assert [g.id for g in gpus] == [fake.gpus[i].uuid for i in (0, 1, 3)]
    assert [g.index for g in gpus] == [0, 1, 3]
    assert (gpus[2].name, gpus[2].memory_total) == ("NVIDIA A100-SXM4-40GB", 40 << 30)
    assert not any(g.mig for g in gpus)
    assert fake.gpus[2].uuid in caplog.text and "index 2" in caplog.text and "without MIG devices" in caplog.text
    assert not any(g.simulated for g in gpus) and {g.node for g in gpus} == {"host"}
    assert inv.describe() == {"kind": "nvml", "simulated": False, "driver_version": "550.54.15-fake"}


def test_link_groups_follow_nvlink_then_the_pcie_switch(inv: NVMLInventory, fake: FakeNvml) -> None:
    # NVLink pairs 0-1 and 2-3
    assert [g.link_group for g in inv.discover()] == ["host/nvl0", "host/nvl0", "host/nvl1", "host/nvl1"]
    # no NVLink: GPUs behind one PCIe switch are grouped (0-1, 2-3), not those only sharing a NUMA node
    for g in fake.gpus:
        g.nvlink = -1
    fake.write()
    assert [g.link_group for g in inv.discover()] == ["host/pci0", "host/pci0", "host/pci1", "host/pci1"]
    # one NVLink island of three, the fourth GPU alone on its switch
    for i, g in enumerate(fake.gpus):
        g.nvlink = 0 if i < 3 else -1
        g.pci_switch = i
    fake.write()
    assert [g.link_group for g in inv.discover()] == ["host/nvl0", "host/nvl0", "host/nvl0", "host/pci0"]


def test_sample_lists_processes_memory_and_utilisation(inv: NVMLInventory, fake: FakeNvml) -> None:
    gpus = inv.discover()
    fake.gpus[1].util = (70, 20)
    fake.procs = [FakeProc(1, 4001, 3 << 30, sm=70), FakeProc(1, 4002, 1 << 30, kind="graphics")]
    fake.write()
    s = inv.sample()
    assert s[gpus[1].id].pids == {4001: 3 << 30, 4002: 1 << 30}
    assert s[gpus[1].id].memory_used == fake.gpus[1].memory_used + (4 << 30)
    assert s[gpus[1].id].utilization == 70.0
    assert s[gpus[0].id].pids == {} and s[gpus[0].id].memory_used == fake.gpus[0].memory_used


def test_activity_counts_descendants_of_the_leases_processes(inv: NVMLInventory, fake: FakeNvml) -> None:
    gpus = inv.discover()
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess,sys; p=subprocess.Popen(['sleep','60']);"
                               "print(p.pid, flush=True); p.wait()"], stdout=subprocess.PIPE)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        fake.procs = [FakeProc(0, child, 1 << 30, sm=40)]
        fake.write()
        inv.sample()
        assert inv.lease_active("l-1", [parent.pid], {}, [gpus[0].id])
        assert not inv.lease_active("l-2", [parent.pid], {}, [gpus[1].id])  # not on that lease's GPU
        assert not inv.lease_active("l-3", [1234567], {}, [gpus[0].id])  # someone else's process
        fake.procs[0].sm = 0
        fake.procs[0].mem_util = 30  # memory traffic alone is activity
        fake.write()
        inv.sample()
        assert inv.lease_active("l-1", [parent.pid], {}, [gpus[0].id])
    finally:
        parent.kill()
        parent.wait()


def test_without_per_process_counters_the_device_utilisation_counts(inv: NVMLInventory, fake: FakeNvml) -> None:
    gpus = inv.discover()
    me = [os.getpid()]
    fake.gpus[0].proc_util = False
    fake.gpus[0].util = (50, 0)
    fake.procs = [FakeProc(0, me[0], 1 << 30)]
    fake.write()
    inv.sample()
    assert inv.lease_active("l-1", me, {}, [gpus[0].id])
    fake.procs.append(FakeProc(0, 1234567, 1 << 30))  # another process shares it: cannot attribute
    fake.write()
    inv.sample()
    assert not inv.lease_active("l-1", me, {}, [gpus[0].id])


def test_leaked_memory_keeps_a_gpu_draining(inv: NVMLInventory, fake: FakeNvml) -> None:
    gpus = inv.discover()
    gone = 1234567  # no such process
    fake.gpus[0].memory_used += 2 << 30  # memory held with no process listed
    fake.write()
    assert not inv.is_drained(gpus[0].id, [gone], inv.sample())
    assert not inv.is_drained(gpus[0].id, [gone], inv.sample())
    fake.gpus[0].memory_used -= 2 << 30
    fake.write()
    inv.sample()
    assert inv.is_drained(gpus[0].id, [gone], inv.sample())


def test_a_lost_gpu_samples_unhealthy(inv: NVMLInventory, fake: FakeNvml, caplog: pytest.LogCaptureFixture) -> None:
    gpus = inv.discover()
    fake.gpus[2].lost = True
    fake.write()
    s = inv.sample()
    assert not s[gpus[2].id].healthy and s[gpus[0].id].healthy
    assert any(gpus[2].id in line and "index 2" in line and "lost" in line for line in caplog.text.splitlines())


def test_no_driver_names_the_fix(fake: FakeNvml) -> None:
    from lease_broker.core.errors import LeaseError

    fake.init_error = 9
    fake.write()
    with pytest.raises(LeaseError) as e:
        NVMLInventory().discover()
    assert "Driver Not Loaded" in e.value.message and "--inventory=simulated" in e.value.message


# ---------------------------------------------------------------------- a real broker on the fake driver
@pytest.fixture
def state(tmp_path: Path) -> FakeNvml:
    return FakeNvml.standard(tmp_path / "broker-nvml.state", 4)


@pytest.mark.parametrize("inventory", ["nvml", "auto"])
def test_broker_serves_the_nvml_gpus(broker_factory, state: FakeNvml, inventory: str) -> None:
    broker = broker_factory(args=[*NVML_ARGS, f"--inventory={inventory}"], env=state.env())
    c = broker.client()
    gpus = c.gpus()
    assert [g["id"] for g in gpus["gpus"]] == [g.uuid for g in state.gpus]
    assert not gpus["summary"]["simulated"] and not any(g["simulated"] for g in gpus["gpus"])
    lease = c.request_lease(2, heartbeat=False)
    assert lease["env"]["CUDA_VISIBLE_DEVICES"] == f"{state.gpus[0].uuid},{state.gpus[1].uuid}"  # one NVLink pair
    assert "nvml" in broker.log()


def test_idle_revocation_from_nvml_utilisation(broker_factory, state: FakeNvml, tmp_path: Path) -> None:
    broker = broker_factory(args=[*NVML_ARGS, "--inventory=nvml", "--LeasePolicy.warn_before_seconds=1.5",
                                  "--LeasePolicy.idle_mark_seconds=0.5"], env=state.env())
    c = broker.client()
    events = EventLog(broker.socket)
    try:
        with Worker(tmp_path) as w:
            lease = c.request_lease(1, heartbeat=False, idle_timeout_seconds=3)
            c.attach(lease["id"], w.pid)
            state.procs = [FakeProc(0, w.pid, 2 << 30, sm=80)]
            state.write()
            # computing on the GPU keeps it active well past the idle timeout
            wait_for(lambda: c.lease(lease["id"])["state"] == "active", timeout=10)
            busy_since = wait_for(lambda: c.lease(lease["id"]), timeout=1)["last_activity"]
            wait_for(lambda: c.lease(lease["id"])["last_activity"] > busy_since + 3, timeout=15,
                     what="activity past the idle timeout")
            busy = c.lease(lease["id"])
            assert busy["state"] == "active" and busy["idle_deadline"] is None and not events.of("warning")
            state.procs[0].sm = 0  # quiet: warned, then revoked
            state.write()
            warning = events.wait("warning", timeout=15, lease_id=lease["id"])
            assert warning["kind"] == "idle"
            got = wait_for(lambda: (x := c.lease(lease["id"]))["state"] == "revoked" and x, timeout=15)
            assert got["reason"] == "idle"
            assert events.of("warning")[0]["seq"] < events.wait("lease", change="revoked")["seq"]
    finally:
        events.close()


def test_draining_blocks_regrant_until_nvml_shows_the_process_gone(broker_factory, state: FakeNvml,
                                                                  tmp_path: Path) -> None:
    state.gpus = state.gpus[:1]
    state.write()
    broker = broker_factory(args=[*NVML_ARGS, "--inventory=nvml"], env=state.env())
    c = broker.client()
    with Worker(tmp_path) as w:
        lease = c.request_lease(1, heartbeat=False)
        c.attach(lease["id"], w.pid)
        state.procs = [FakeProc(0, w.pid, 4 << 30)]
        state.write()
        c.release(lease["id"])
        assert w.proc.wait(5) == -15  # the broker stopped it; NVML still lists it (context not torn down)
        assert c.gpus()["gpus"][0]["state"] == "draining"
        nxt = c.request_lease(1, heartbeat=False)
        assert nxt["state"] == "queued"
        for _ in range(5):  # stays queued while NVML shows the old process
            assert c.lease(nxt["id"], wait=0.2)["state"] == "queued"
        state.procs = []
        state.write()
        got = c.lease(nxt["id"], wait=10)
        assert got["state"] == "granted" and got["devices"][0]["id"] == state.gpus[0].uuid


def test_a_request_waiting_when_a_tick_ends_a_lease_does_not_get_the_gpu_its_processes_still_use(
        broker_factory, state: FakeNvml, tmp_path: Path) -> None:
    state.gpus = state.gpus[:1]
    state.write()
    broker = broker_factory(args=[*NVML_ARGS, "--inventory=nvml"], env=state.env())
    c = broker.client()
    with Worker(tmp_path) as w:
        lease = c.request_lease(1, heartbeat=False, duration_seconds=2)
        c.attach(lease["id"], w.pid)
        state.procs = [FakeProc(0, w.pid, 4 << 30)]
        state.write()
        nxt = c.request_lease(1, heartbeat=False)
        assert nxt["state"] == "queued"
        # the tick that expires the lease runs a pass in the same iteration, before the SIGTERM: the drain is marked
        # when the end is committed, so that pass cannot hand the GPU on
        assert wait_for(lambda: c.lease(lease["id"])["state"] == "expired" or None, timeout=10, what="the expiry")
        assert c.lease(nxt["id"])["state"] == "queued"
        assert c.gpus()["gpus"][0]["state"] == "draining"
        state.procs = []
        state.write()
        assert c.lease(nxt["id"], wait=10)["state"] == "granted"


def test_a_gpu_that_never_drains_becomes_unhealthy(broker_factory, state: FakeNvml, tmp_path: Path) -> None:
    broker = broker_factory(args=[*NVML_ARGS, "--inventory=nvml", "--LeasePolicy.term_timeout=0.2",
                                  "--LeasePolicy.drain_timeout=1"], env=state.env())
    c = broker.client()
    events = EventLog(broker.socket)
    try:
        with Worker(tmp_path) as w:
            lease = c.request_lease(1, heartbeat=False)
            gpu = lease["devices"][0]
            c.attach(lease["id"], w.pid)
            state.gpus[gpu["index"]].memory_used += 6 << 30  # memory the driver never gives back
            state.write()
            c.release(lease["id"])
            ev = events.wait("gpu_unhealthy", timeout=10, gpu_id=gpu["id"])
            assert lease["id"] in ev["message"]
            view = {g["id"]: g for g in c.gpus()["gpus"]}
            assert view[gpu["id"]]["state"] == "unhealthy"
            leases = [c.request_lease(1, heartbeat=False) for _ in range(4)]
            assert all(x["devices"][0]["id"] != gpu["id"] for x in leases if x["state"] == "granted")
            assert [x["state"] for x in leases].count("queued") == 1
    finally:
        events.close()


def test_a_lost_gpu_is_marked_unhealthy_and_not_granted(broker_factory, state: FakeNvml) -> None:
    broker = broker_factory(args=[*NVML_ARGS, "--inventory=nvml"], env=state.env())
    c = broker.client()
    state.gpus[0].lost = True
    state.write()
    wait_for(lambda: c.gpus()["gpus"][0]["state"] == "unhealthy", timeout=10)
    assert "lost" in broker.log()
    leases = [c.request_lease(1, heartbeat=False) for _ in range(4)]
    assert state.gpus[0].uuid not in {x["devices"][0]["id"] for x in leases if x["devices"]}


def test_each_sample_streams_every_gpus_utilisation_and_memory(broker_factory, state: FakeNvml) -> None:
    """The sidebar's live charts: a ``gpu_samples`` event at each sample, with what the GPU view shows everyone
    (utilisation, memory used) and nothing about processes."""
    broker = broker_factory(args=[*NVML_ARGS, "--inventory=nvml"], env=state.env())
    events = EventLog(broker.socket)
    try:
        state.gpus[1].util, state.gpus[1].memory_used = (70, 30), 9 << 30
        state.write()

        def busy() -> dict | None:
            for e in events.of("gpu_samples"):
                if {x["id"]: x for x in e["gpus"]}[state.gpus[1].uuid]["utilization"] == 70:
                    return e
            return None

        sample = wait_for(busy, timeout=10, what="a sample with GPU 1 at 70 %")
        assert [g["id"] for g in sample["gpus"]] == [g.uuid for g in state.gpus]
        assert all(set(g) == {"id", "utilization", "memory_used"} for g in sample["gpus"])  # no pids, no users
        assert sample["user"] is None  # visible to every user, as the GPU view is
        assert sample["gpus"][1]["memory_used"] == 9 << 30 and sample["gpus"][0]["utilization"] == 0
        view = broker.client().gpus()["gpus"][1]
        assert (view["utilization"], view["memory_used"]) == (70, 9 << 30)
    finally:
        events.close()
