"""What every inventory promises the broker, checked against each backend: one contract, several
implementations.

- single host: the simulated inventory, the NVML inventory over the fake libnvidia-ml, and the NVML
  inventory over the real driver when this machine has an NVIDIA GPU;
- a cluster on Ray: the Ray inventory over a real local Ray cluster (two loopback nodes with declared GPUs,
  the session's ``ray_cluster`` fixture), where a grant is also a placement group;
- a cluster on Slurm: the Slurm inventory over a real local Slurm (slurmctld and two slurmd with fake GPUs,
  the session's ``slurm_cluster`` fixture), where a grant is also an allocation (``salloc --no-shell``).

The contract: a stable, complete device list; a sample for every device; a ``CUDA_VISIBLE_DEVICES`` value
that names exactly the given devices (in the backend's own form); activity and drain judged from the
lease's processes; and, through a real ``LeaseManager``, distinct devices per grant, a placement (None on a
single host, the engine's reservation on a cluster) that is made when the lease is granted and undone when
it ends, with the engine's own count of free GPUs following.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from fake_nvml import FakeNvml, FakeProc
from nvml_helpers import (
    GpuWorker,
    Worker,
    cuda_workload_missing,
    real_nvml_missing,
    use_fake_library,
    use_library,
    wait_for,
)

from lease_broker.core.gpu import GPU
from lease_broker.core.identity import Identity
from lease_broker.core.lease import LeaseState
from lease_broker.inventory import Inventory
from lease_broker.inventory.simulated import SimulatedInventory
from lease_broker.manager.manager import LeaseManager
from lease_broker.policy.lease_policy import LeasePolicy
from lease_broker.store.lease_store import Store

UUID = r"(GPU|MIG)-[0-9a-f-]{36}"


@dataclass
class Backend:
    """An inventory plus the means to make a worker look busy, quiet, on or off a GPU."""

    name: str
    inv: Inventory
    fake: FakeNvml | None = None
    can_drive_gpu: bool = False
    workers: list[Worker] = field(default_factory=list)
    #: what one entry of ``visible_devices`` looks like: a UUID on a host; on a cluster the index on the node
    #: (the engine gives the process in the reservation its own devices)
    visible: str = UUID
    #: the engine's own count of free GPUs (Ray's available resources; Slurm's idle GRES); None: no engine
    engine_free: Callable[[], float] | None = None

    def busy(self, w: Worker, on: bool) -> None:
        w.busy(on)
        if self.fake is not None:
            p = self.fake.proc(w.pid)
            assert p is not None
            p.sm = 60 if on else 0
            self.fake.write()

    def on_gpu(self, w: Worker, index: int) -> None:
        if self.fake is not None:
            self.fake.procs.append(FakeProc(index, w.pid, 1 << 30))
            self.fake.write()

    def off_gpu(self, w: Worker) -> None:
        if self.fake is not None:
            self.fake.procs = [p for p in self.fake.procs if p.pid != w.pid]
            self.fake.write()


# single host: simulated, nvml-*; cluster: ray, slurm
BACKENDS = ["simulated", "nvml-fake", "nvml-real", "ray", "slurm"]


def _ray_free() -> float:
    import ray

    return float(ray.available_resources().get("GPU", 0.0))


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Backend]:
    if request.param == "simulated":
        b = Backend("simulated", SimulatedInventory(gpus=4, activity_cpu_seconds=0.02))
    elif request.param == "ray":
        from ray_cluster import HEAD

        cluster = request.getfixturevalue("ray_cluster")  # skips when ray is not installed
        from lease_broker.inventory.ray import RayInventory

        inv = RayInventory(address=cluster.address, node_ip=HEAD, activity_cpu_seconds=0.02, placement_timeout=60)
        b = Backend("ray", inv, visible=r"\d+", engine_free=_ray_free)
    elif request.param == "slurm":
        slurm = request.getfixturevalue("slurm_cluster")  # skips (with the reason) when not root or not installed
        for k, v in slurm.env.items():
            monkeypatch.setenv(k, v)
        from lease_broker.inventory.slurm import SlurmInventory

        inv = SlurmInventory(activity_cpu_seconds=0.02, placement_timeout=60, job_prefix="glcontract")
        b = Backend("slurm", inv, visible=r"\d+", engine_free=slurm.free_gpus)
    else:
        from lease_broker.inventory.nvml import NVMLInventory

        fake = None
        if request.param == "nvml-fake":
            use_fake_library()
            fake = FakeNvml.standard(tmp_path / "nvml.state", 4)
            monkeypatch.setenv("FAKE_NVML_STATE", str(fake.path))
        else:
            why = real_nvml_missing()
            if why:
                pytest.skip(f"real NVML: {why}")
        inv = NVMLInventory(activity_window_seconds=0.3, activity_gpu_percent=5.0)
        b = Backend(request.param, inv, fake=fake, can_drive_gpu=fake is not None)
    yield b
    for w in b.workers:
        w.kill()
    b.inv.close()
    if request.param.startswith("nvml"):
        use_library(None)


def _worker(b: Backend, tmp_path: Path) -> Worker:
    if b.name == "nvml-real":  # a real CUDA process: NVML lists it on GPU 0
        why = cuda_workload_missing()
        if why:
            pytest.skip(f"real NVML: {why}")
        w: Worker = GpuWorker(tmp_path, f"g{len(b.workers)}")
    else:
        w = Worker(tmp_path, f"w{len(b.workers)}")
    b.workers.append(w)
    return w


def test_discover_is_stable_and_complete(backend: Backend) -> None:
    first = backend.inv.discover()
    again = backend.inv.discover()
    assert first, "an inventory reports at least one GPU"
    assert [(g.id, g.index, g.node, g.name, g.memory_total, g.link_group) for g in first] == [
        (g.id, g.index, g.node, g.name, g.memory_total, g.link_group) for g in again
    ]
    assert len({g.id for g in first}) == len(first)
    for node in {g.node for g in first}:
        assert sorted(g.index for g in first if g.node == node) == list(range(sum(g.node == node for g in first)))
    for g in first:
        assert g.name and g.memory_total > 0 and g.link_group
        assert g.simulated == backend.inv.simulated == (backend.name == "simulated")
        rebuilt = GPU(**{f.name: getattr(g, f.name) for f in dataclasses.fields(GPU)})
        assert g == rebuilt and hash(g) == hash(rebuilt) and vars(g) == vars(rebuilt)  # a complete GPU, however made


def test_sample_reports_every_gpu(backend: Backend) -> None:
    gpus = backend.inv.discover()
    samples = backend.inv.sample()
    assert set(samples) == {g.id for g in gpus}
    for g in gpus:
        s = samples[g.id]
        assert s.healthy and 0 <= s.utilization <= 100 and 0 <= s.memory_used <= g.memory_total


def test_visible_devices_name_exactly_the_given_gpus(backend: Backend) -> None:
    gpus = backend.inv.discover()[:2]  # two where the host has them (a real host may have one: seen on an H100)
    value = backend.inv.visible_devices(gpus)
    parts = value.split(",")
    assert len(parts) == len(gpus) and len(set(parts)) == len(gpus)
    assert all(re.fullmatch(backend.visible, part) for part in parts), value
    if backend.visible == UUID:
        assert parts == [g.id for g in gpus]
    else:  # indices on the node, as the node counts its devices
        assert parts == [str(g.index) for g in gpus]


def test_lease_active_follows_the_work_of_its_processes(backend: Backend, tmp_path: Path) -> None:
    gpus = backend.inv.discover()
    w = _worker(backend, tmp_path)
    backend.on_gpu(w, 0)

    def active() -> bool:
        backend.inv.sample()
        return backend.inv.lease_active("l-1", [w.pid], {}, [gpus[0].id])

    active()  # first call only primes CPU counters
    wait_for(lambda: not active(), timeout=30, what="a new, quiet process is not activity")
    backend.busy(w, True)
    wait_for(active, timeout=30, what="lease becomes active while its process works")
    backend.busy(w, False)
    wait_for(lambda: not active(), timeout=30, what="lease becomes quiet when its process stops")
    backend.inv.forget("l-1")


def test_is_drained_only_when_the_processes_are_gone(backend: Backend, tmp_path: Path) -> None:
    gpus = backend.inv.discover()
    gpu = gpus[0].id
    w = _worker(backend, tmp_path)
    backend.on_gpu(w, 0)
    samples = backend.inv.sample()
    assert not backend.inv.is_drained(gpu, [w.pid], samples)
    w.kill()
    if backend.fake is not None:  # NVML still lists the process: the GPU is not clean yet
        samples = backend.inv.sample()
        assert not backend.inv.is_drained(gpu, [w.pid], samples)
        backend.off_gpu(w)

    def drained() -> bool:
        return backend.inv.is_drained(gpu, [w.pid], backend.inv.sample())

    wait_for(drained, timeout=30, what="GPU drained after the lease's process is gone")


# ------------------------------------------------------------------------------ placement, through the manager
ALICE = Identity("alice", uid=1001)


def test_grants_are_placed_on_distinct_devices_and_unplaced_when_they_end(backend: Backend) -> None:
    if backend.name == "nvml-real":
        pytest.skip("real NVML: the machine's GPUs may be busy; the fake library covers this")
    m = LeaseManager(Store(":memory:"), backend.inv, LeasePolicy(heartbeat_timeout=300.0))
    m.restore()
    m.tick()  # an engine's inventory hooks into the manager on its first tick
    free_before = backend.engine_free() if backend.engine_free else None
    a, _ = m.request(ALICE, {"gpus": 1, "heartbeat": False})
    b, _ = m.request(ALICE, {"gpus": 1, "heartbeat": False})
    assert a.state == b.state == LeaseState.GRANTED
    assert len(a.devices) == len(b.devices) == 1 and set(a.devices).isdisjoint(b.devices)

    def placed(lease: object) -> dict | None:
        m.tick()
        return m.view(lease)["placement"]  # type: ignore[arg-type]

    if backend.engine_free is None:  # a single host: the grant is the placement
        assert placed(a) is None and placed(b) is None
    else:
        for lease in (a, b):
            p = wait_for(lambda lease=lease: (v := placed(lease)) and v["state"] == "ready" and v, timeout=60,
                         what=f"{lease.id} placed by the engine")
            assert p["kind"] == backend.name
            assert [bd["node"] for bd in p["bundles"]] == [m.gpu_by_id[lease.devices[0]].node]
        wait_for(lambda: backend.engine_free() == free_before - 2, timeout=30,  # type: ignore[misc]
                 what="the engine to count two GPUs as taken")
    m.release(a.id, ALICE)
    m.release(b.id, ALICE)
    assert m.view(a)["placement"] is None and m.view(b)["placement"] is None
    if backend.engine_free is not None:
        wait_for(lambda: backend.engine_free() == free_before, timeout=30,  # type: ignore[misc]
                 what="the engine to free the GPUs of ended leases")
    m.store.close()
