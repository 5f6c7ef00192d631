"""MIG devices through the fake libnvidia-ml.so.1 (the real pynvml bindings, the NVML calls a real A100/H100 in
MIG mode answers): each MIG device is a device of the inventory, leased alone with CUDA_VISIBLE_DEVICES=MIG-…,
its activity and draining judged per MIG device; the GPU it is cut from is never leased while it is split."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_nvml import FakeNvml, FakeProc
from nvml_helpers import EventLog, Worker, wait_for

from jupyter_gpulease.client import BrokerError
from lease_broker.inventory.nvml import NVMLInventory

GIB = 1 << 30
NVML_ARGS = ["--inventory=nvml", "--tick=0.1", "--LeaseBroker.sample_seconds=0.2",
             "--NVMLInventory.activity_window_seconds=0.5"]
PROFILES = [("3g.40gb", 40 * GIB), ("2g.20gb", 20 * GIB), ("1g.10gb", 10 * GIB)]


@pytest.fixture
def fake(fake_driver) -> FakeNvml:  # type: ignore[no-untyped-def]
    return fake_driver(2)


@pytest.fixture
def inv(fake: FakeNvml) -> Iterator[NVMLInventory]:
    inventory = NVMLInventory(node_name="host", activity_window_seconds=0.0, activity_cpu_seconds=0.03)
    yield inventory
    inventory.close()


def test_mig_devices_replace_the_gpu_they_are_cut_from(inv: NVMLInventory, fake: FakeNvml) -> None:
    fake.gpus[1].name = "NVIDIA A100-SXM4-80GB"
    migs = fake.split(1, PROFILES)
    gpus = inv.discover()
    assert [g.id for g in gpus] == [fake.gpus[0].uuid, *migs]  # GPU 1 itself is not a device any more
    whole, slices = gpus[0], gpus[1:]
    assert not whole.mig and all(g.mig and g.parent == fake.gpus[1].uuid for g in slices)
    assert [g.name for g in slices] == [f"NVIDIA A100-SXM4-80GB MIG {p}" for p, _ in PROFILES]
    assert [g.memory_total for g in slices] == [b for _, b in PROFILES]
    assert {g.index for g in slices} == {1} and {g.link_group for g in slices} == {"host/mig1"}
    assert inv.visible_devices(slices[2:]) == migs[2]


def test_samples_processes_and_memory_per_mig_device(inv: NVMLInventory, fake: FakeNvml) -> None:
    migs = fake.split(1, PROFILES)
    inv.discover()
    fake.procs = [FakeProc(1, 4001, 5 * GIB, sm=90, mig=0), FakeProc(1, 4002, 2 * GIB, mig=2)]
    fake.write()
    s = inv.sample()
    assert s[migs[0]].pids == {4001: 5 * GIB} and s[migs[0]].memory_used == 5 * GIB
    assert s[migs[1]].pids == {} and s[migs[1]].memory_used == 0
    assert s[migs[2]].pids == {4002: 2 * GIB}
    assert s[migs[0]].utilization == 0.0  # NVML has no utilisation counters for a MIG device


def test_activity_on_a_mig_device_is_cpu_time_while_on_it(inv: NVMLInventory, fake: FakeNvml,
                                                          tmp_path: Path) -> None:
    migs = fake.split(0, PROFILES[:2])
    inv.discover()
    with Worker(tmp_path) as w:
        w.busy(True)
        fake.procs = [FakeProc(0, w.pid, GIB, mig=1)]
        fake.write()
        inv.sample()
        assert wait_for(lambda: inv.lease_active("l-1", [w.pid], {}, [migs[1]]), timeout=10)
        w.busy(False)
        inv.lease_active("l-1", [w.pid], {}, [migs[1]])  # takes up the CPU time used so far
        assert wait_for(lambda: not inv.lease_active("l-1", [w.pid], {}, [migs[1]]), timeout=10)
        w.busy(True)
        fake.procs = []  # busy on the CPU, but not on the MIG device: not GPU activity
        fake.write()
        inv.sample()
        inv.lease_active("l-1", [w.pid], {}, [migs[1]])
        assert wait_for(lambda: w.proc.poll() is None and not inv.lease_active("l-1", [w.pid], {}, [migs[1]]),
                        timeout=10)


def test_each_mig_device_drains_on_its_own(inv: NVMLInventory, fake: FakeNvml) -> None:
    migs = fake.split(0, PROFILES[:2])
    inv.discover()
    gone = 1234567  # no such process: its context still listed on MIG device 0
    fake.procs = [FakeProc(0, gone, 3 * GIB, mig=0)]
    fake.write()
    for mig in migs:  # the lease's processes are gone from now on: a sample taken after this one decides
        assert not inv.is_drained(mig, [gone], {})
    samples = inv.sample()
    assert not inv.is_drained(migs[0], [gone], samples)
    assert inv.is_drained(migs[1], [gone], samples)  # its sibling is clean
    fake.procs = []
    fake.write()
    assert inv.is_drained(migs[0], [gone], inv.sample())


# ---------------------------------------------------------------------- a real broker on MIG devices
@pytest.fixture
def state(tmp_path: Path) -> FakeNvml:
    s = FakeNvml.standard(tmp_path / "broker-nvml.state", 2)
    s.gpus[1].name = "NVIDIA A100-SXM4-80GB"
    s.split(1, PROFILES)
    return s


def test_a_broker_leases_mig_devices_one_each(broker_factory, state: FakeNvml) -> None:
    broker = broker_factory(args=NVML_ARGS, env=state.env())
    c = broker.client()
    views = c.gpus()["gpus"]
    assert [(g["mig"], g["name"]) for g in views] == [(False, state.gpus[0].name)] + [
        (True, f"NVIDIA A100-SXM4-80GB MIG {p}") for p, _ in PROFILES]
    leases = [c.request_lease(1, heartbeat=False) for _ in range(4)]
    visible = [x["env"]["CUDA_VISIBLE_DEVICES"] for x in leases]
    assert sorted(visible) == sorted([state.gpus[0].uuid, *(m.uuid for m in state.gpus[1].migs)])
    assert state.gpus[1].uuid not in ",".join(visible)  # the split GPU itself is never leased
    for x in leases:
        c.release(x["id"])
    # a request for two GPUs gets the two whole ones only: never MIG devices
    with pytest.raises(BrokerError) as e:
        c.request_lease(2, heartbeat=False)
    assert e.value.status == 400 and "at most 1" in e.value.message and "one node" in e.value.message
    with pytest.raises(BrokerError) as e:
        c.request_lease(2, heartbeat=False, gpu_type="MIG")
    assert "one MIG device" in e.value.message and "ask for 1" in e.value.message


def test_a_mig_device_drains_and_is_handed_on_alone(broker_factory, state: FakeNvml, tmp_path: Path) -> None:
    broker = broker_factory(args=[*NVML_ARGS, "--LeasePolicy.term_timeout=0.5"], env=state.env())
    c = broker.client()
    events = EventLog(broker.socket)
    try:
        with Worker(tmp_path) as w:
            lease = c.request_lease(1, heartbeat=False, gpu_type="1g.10gb")
            assert events.wait("lease", change="granted")["lease"]["id"] == lease["id"]
            mig = state.gpus[1].migs[2]
            assert lease["env"]["CUDA_VISIBLE_DEVICES"] == mig.uuid
            c.attach(lease["id"], w.pid)
            state.procs = [FakeProc(1, w.pid, 4 * GIB, mig=2)]
            state.write()
            c.release(lease["id"])
            assert w.proc.wait(5) == -15  # stopped; NVML still lists its context on the MIG device
            views = {g["id"]: g["state"] for g in c.gpus()["gpus"]}
            assert views[mig.uuid] == "draining"
            assert [views[m.uuid] for m in state.gpus[1].migs[:2]] == ["free", "free"]  # its siblings are not
            nxt = c.request_lease(1, heartbeat=False, gpu_type="1g.10gb")
            assert c.lease(nxt["id"], wait=0.5)["state"] == "queued"
            other = c.request_lease(1, heartbeat=False, gpu_type="2g.20gb")
            assert other["state"] == "granted"  # a sibling MIG device is granted meanwhile
            state.procs = []
            state.write()
            got = c.lease(nxt["id"], wait=10)
            assert got["state"] == "granted" and got["env"]["CUDA_VISIBLE_DEVICES"] == mig.uuid
    finally:
        events.close()


def test_an_unleased_process_on_a_mig_device_is_reported_for_that_device(broker_factory, state: FakeNvml,
                                                                          tmp_path: Path) -> None:
    broker = broker_factory(args=NVML_ARGS, env=state.env())
    c = broker.client()
    with Worker(tmp_path) as w:
        mig = state.gpus[1].migs[1]
        state.procs = [FakeProc(1, w.pid, 2 * GIB, mig=1)]
        state.write()
        views = wait_for(lambda: (v := {g["id"]: g for g in c.gpus()["gpus"]})[mig.uuid]["unleased_processes"] and v,
                         timeout=10)
        assert [p["pid"] for p in views[mig.uuid]["unleased_processes"]] == [w.pid]
        assert all(not views[m.uuid]["unleased_processes"] for m in state.gpus[1].migs if m is not mig)
