"""What every inventory promises the broker, checked against each backend:
the simulated inventory, the NVML inventory over the fake libnvidia-ml, and the NVML
inventory over the real driver when this machine has an NVIDIA GPU."""

from __future__ import annotations

import re
from collections.abc import Iterator
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

from lease_broker.inventory import Inventory
from lease_broker.inventory.simulated import SimulatedInventory


@dataclass
class Backend:
    """An inventory plus the means to make a worker look busy, quiet, on or off a GPU."""

    name: str
    inv: Inventory
    fake: FakeNvml | None = None
    can_drive_gpu: bool = False
    workers: list[Worker] = field(default_factory=list)

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


@pytest.fixture(params=["simulated", "nvml-fake", "nvml-real"])
def backend(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Backend]:
    if request.param == "simulated":
        b = Backend("simulated", SimulatedInventory(gpus=4, activity_cpu_seconds=0.02))
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
    if request.param != "simulated":
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


def test_sample_reports_every_gpu(backend: Backend) -> None:
    gpus = backend.inv.discover()
    samples = backend.inv.sample()
    assert set(samples) == {g.id for g in gpus}
    for g in gpus:
        s = samples[g.id]
        assert s.healthy and 0 <= s.utilization <= 100 and 0 <= s.memory_used <= g.memory_total


def test_visible_devices_are_uuids(backend: Backend) -> None:
    gpus = backend.inv.discover()
    value = backend.inv.visible_devices(gpus[:2])
    assert value.split(",") == [g.id for g in gpus[:2]]
    assert all(re.fullmatch(r"(GPU|MIG)-[0-9a-f-]{36}", part) for part in value.split(","))


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
