"""The Python API (lease, on_gpu, map) in a real kernel against a real broker."""

from __future__ import annotations

from pathlib import Path

import pytest
from kernels import Kernel


@pytest.fixture
def kernel(broker_factory, tmp_path: Path):  # type: ignore[no-untyped-def]
    b = broker_factory(gpus=2, args=["--tick=0.1"], name="api")
    k = Kernel(b.url, str(tmp_path / "art"))
    k.broker = b  # type: ignore[attr-defined]
    yield k
    k.stop()


def test_lease_context_manager_runs_functions_on_its_gpus(kernel: Kernel) -> None:
    r = kernel.run(
        "import os, jupyter_gpulease\n"
        "def visible(x):\n    return os.environ['CUDA_VISIBLE_DEVICES'], os.getpid(), x * 2\n"
        "with jupyter_gpulease.lease(2) as held:\n"
        "    a = held.run(visible, 1)\n"
        "    b = held.run(visible, 2)\n"
        "print(len(held.devices), a[0] == b[0], a[0].count('GPU-'), a[1] != b[1], a[2], b[2], held)\n"
    )
    assert r.status == "ok", r.outputs
    assert r.stdout.startswith("2 True 2 True 2 4 <Lease ") and "ended" in r.stdout
    c = kernel.broker.client()  # type: ignore[attr-defined]
    assert [x for x in c.leases() if not x["ended_at"]] == []


def test_on_gpu_decorator_and_errors(kernel: Kernel) -> None:
    r = kernel.run(
        "import jupyter_gpulease\n"
        "@jupyter_gpulease.on_gpu(1, time='5m')\n"
        "def train(lr):\n    print('training', lr)\n    return {'loss': lr * 10}\n"
        "print(train(0.5))\n"
    )
    assert r.status == "ok", r.outputs
    assert "training 0.5" in r.stdout and "{'loss': 5.0}" in r.stdout
    r = kernel.run("@jupyter_gpulease.on_gpu()\ndef bad():\n    raise ValueError('nope')\nbad()")
    assert r.error is not None and r.error["ename"] == "ValueError" and "nope" in r.error["evalue"]


def test_map_uses_more_gpus_as_they_free_up(kernel: Kernel) -> None:
    c = kernel.broker.client()  # type: ignore[attr-defined]
    held = c.request_lease(1, heartbeat=False)  # one of the two GPUs is busy when the search starts
    r = kernel.run(
        "import jupyter_gpulease, os, time, threading\n"
        "def trial(p):\n    time.sleep(0.3)\n    return p * p, os.environ['CUDA_VISIBLE_DEVICES']\n"
        "def free_later():\n    time.sleep(0.8)\n"
        f"    from jupyter_gpulease.client import BrokerClient\n    BrokerClient().release({held['id']!r})\n"
        "threading.Thread(target=free_later).start()\n"
        "res = jupyter_gpulease.map(trial, range(6), gpus_per_call=1, max_gpus=2)\n"
        "print([v for v, _ in res], len({d for _, d in res}), {d.count(',') for _, d in res})\n"
    )
    assert r.status == "ok", r.outputs
    # every trial saw one GPU; both GPUs were used once the second freed
    assert "[0, 1, 4, 9, 16, 25] 2 {0}" in r.stdout
    mine = [x for x in c.leases(ended=20) if x["labels"].get("source") == "api"]
    assert len(mine) == 1 and (mine[0]["min_gpus"], mine[0]["max_gpus"]) == (1, 2)
    assert len(mine[0]["devices"]) == 2 and mine[0]["state"] == "released"  # one lease, grown to both GPUs
