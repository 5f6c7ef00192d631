"""Shared (fractional) leases: the limits each lease's worker gets (environment, CUDA MPS where it runs, the
PyTorch memory fraction applied on import), and the memory cap the broker enforces from NVML's per-process
memory (a real broker on the fake NVML driver stops the lease over its cap, with a message)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fake_nvml import FakeNvml, FakeProc
from kernels import Kernel
from nvml_helpers import EventLog, Worker, wait_for

from lease_broker.core.clock import VirtualClock
from lease_broker.core.identity import Identity
from lease_broker.inventory.simulated import SimulatedInventory
from lease_broker.manager.manager import LeaseManager
from lease_broker.policy.lease_policy import LeasePolicy
from lease_broker.store.lease_store import Store

ALICE = Identity("alice", uid=1001)
GIB = 1 << 30


def manager(**policy):  # type: ignore[no-untyped-def]
    m = LeaseManager(Store(":memory:"), SimulatedInventory(gpus=2), LeasePolicy(heartbeat_timeout=1e9, **policy),
                     clock=VirtualClock())
    m.restore()
    return m


@pytest.mark.parametrize("body, mps, want, absent", [
    ({"gpus": 0.25}, "off", {"GPULEASE_MEMORY_FRACTION": "0.25", "GPULEASE_MEMORY_LIMIT": str(20 * GIB)},
     ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]),
    ({"gpus": 0.25}, "on", {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=20480M"},
     []),
    ({"gpus": 0.5, "mem": "10G"}, "on", {"GPULEASE_MEMORY_FRACTION": "0.125", "GPULEASE_MEMORY_LIMIT": str(10 * GIB),
                                         "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50",
                                         "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=10240M"}, []),
    ({"gpus": 1}, "on", {}, ["GPULEASE_MEMORY_FRACTION", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]),  # a whole GPU
])
def test_shared_lease_environment(body, mps, want, absent) -> None:  # type: ignore[no-untyped-def]
    m = manager(shared_mps=mps)
    lease, _ = m.request(ALICE, body)
    env = m.view(lease)["env"]
    assert {k: env.get(k) for k in want} == want
    assert not set(absent) & set(env)


def test_mps_auto_follows_the_control_daemon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    m = manager()
    lease, _ = m.request(ALICE, {"gpus": 0.5})
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in m.view(lease)["env"]
    (tmp_path / "control").touch()  # what nvidia-cuda-mps-control -d creates
    assert m.view(lease)["env"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"


def test_a_shared_lease_over_its_memory_cap_is_stopped(broker_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    state = FakeNvml.standard(tmp_path / "nvml.state", 1)
    broker = broker_factory(args=["--inventory=nvml", "--tick=0.1", "--LeaseBroker.sample_seconds=0.2"],
                            env=state.env())
    c = broker.client()
    events = EventLog(broker.socket)
    try:
        with Worker(tmp_path, "small") as small, Worker(tmp_path, "big") as big:
            ok = c.request_lease(0.5, mem="4G", heartbeat=False)
            over = c.request_lease(0.25, mem="1G", heartbeat=False)
            assert ok["devices"] == over["devices"]  # packed onto the one GPU
            c.attach(ok["id"], small.pid)
            c.attach(over["id"], big.pid)
            state.procs = [FakeProc(0, small.pid, 3 * GIB), FakeProc(0, big.pid, 2 * GIB)]
            state.write()
            ev = events.wait("lease.memory_exceeded", timeout=15, lease_id=over["id"])
            assert "2048 MiB" in ev["message"] and "cap of 1024 MiB" in ev["message"]
            got = wait_for(lambda: (x := c.lease(over["id"]))["state"] == "revoked" and x, timeout=10)
            assert got["reason"] == "over_memory_cap"
            assert big.proc.wait(10) == -15  # stopped by the broker
            assert c.lease(ok["id"])["state"] in ("granted", "active", "idle") and small.proc.poll() is None
    finally:
        events.close()


FAKE_TORCH = {  # stands in for PyTorch (not installed here; its CUDA half needs a GPU): records the calls
    "torch/__init__.py": "from . import cuda\n",
    "torch/cuda.py": "fractions = []\n"
                     "def is_available():\n    return True\n"
                     "def device_count():\n    return 1\n"
                     "def set_per_process_memory_fraction(fraction, device):\n    fractions.append((fraction, device))\n",
    # stands in for TensorFlow: records the logical device configurations set before its GPUs start
    "tensorflow/__init__.py": "from . import config\n",
    "tensorflow/config.py": "limits = []\n"
                            "class LogicalDeviceConfiguration:\n"
                            "    def __init__(self, memory_limit):\n        self.memory_limit = memory_limit\n"
                            "def list_physical_devices(kind):\n    return ['/physical_device:GPU:0'] if kind == 'GPU' else []\n"
                            "def set_logical_device_configuration(dev, confs):\n"
                            "    limits.append((dev, [c.memory_limit for c in confs]))\n",
}


def test_the_worker_caps_pytorch_and_tensorflow_to_their_share(broker, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    for name, text in FAKE_TORCH.items():
        (tmp_path / "mods" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "mods" / name).write_text(text)
    k = Kernel(broker.url, str(tmp_path / "art"))
    try:
        assert k.run(f"import sys; sys.path.insert(0, {str(tmp_path / 'mods')!r})").status == "ok"
        r = k.run("%%gpu 0.25\nimport os, torch\nprint(torch.cuda.fractions, os.environ['XLA_PYTHON_CLIENT_MEM_FRACTION'])")
        assert r.status == "ok", r.outputs
        assert "[(0.25, 0)] 0.25" in r.stdout
        r = k.run("%%gpu 1\nimport os, torch\nprint(torch.cuda.fractions, 'XLA_PYTHON_CLIENT_MEM_FRACTION' in os.environ)")
        assert r.status == "ok", r.outputs
        assert "[] False" in r.stdout  # a whole GPU: no cap
        r = k.run("%%gpu 0.5 --mem 10G\nimport tensorflow as tf\nprint(tf.config.limits)")
        assert r.status == "ok", r.outputs
        assert "[('/physical_device:GPU:0', [10240])]" in r.stdout  # MiB: the lease's memory cap
        r = k.run("%%gpu 1\nimport tensorflow as tf\nprint(tf.config.limits)")
        assert r.status == "ok" and "[]" in r.stdout, r.outputs
    finally:
        k.stop()
