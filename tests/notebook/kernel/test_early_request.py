"""A %%gpu cell's lease request leaves as the kernel starts the cell (``kernel/early.py``): real kernels, a real
broker. The magic takes the request it would have sent; nothing is sent for a cell the magic refuses; a request
that no magic takes is released."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from kernels import Kernel
from waiting import wait_for

COUNTS = "import json\nprint(json.dumps(get_ipython().magics_manager.registry['GpuMagics'].early.counts))"


@pytest.fixture
def kernel(broker, tmp_path: Path) -> Iterator[Kernel]:  # type: ignore[no-untyped-def]
    k = Kernel(broker.url, str(tmp_path / "artifacts"))
    yield k
    k.stop()


def _counts(kernel: Kernel) -> dict[str, int]:
    r = kernel.run(COUNTS)
    assert r.status == "ok", r.outputs
    return dict(json.loads(r.stdout))


def test_the_magic_takes_the_request_sent_as_the_cell_started(kernel: Kernel, client) -> None:
    before = {x.id for x in client.leases(ended=100)}
    for _ in range(3):
        r = kernel.run("%%gpu\nimport os\nprint(os.environ['GPULEASE_LEASE_ID'])")
        assert r.status == "ok", r.outputs
    assert _counts(kernel) == {"sent": 3, "taken": 3, "abandoned": 0}
    made = [x for x in client.leases(ended=100) if x.id not in before]
    assert len(made) == 3  # one lease a cell: the magic asked for none of its own
    assert {x.state for x in made} <= {"released", "granted", "active"}

    r = kernel.run("%%gpu 2 --time 5m\nimport os\nprint(os.environ['CUDA_VISIBLE_DEVICES'])")
    assert r.status == "ok" and len(r.stdout.splitlines()[0].split(",")) == 2, r.outputs
    assert _counts(kernel)["taken"] == 4


def test_nothing_is_sent_for_a_cell_the_magic_refuses(kernel: Kernel, client) -> None:
    for cell in ("%%gpu --time soon\npass", "%%gpu 1 --session s --bg b\npass",
                 "%%gpu\n", "%%gpu --in nothing_called_so\npass"):
        r = kernel.run(cell)
        assert r.status == "error", (cell, r.outputs)
        assert client.leases(ended=100) == [], cell  # no lease was made and cancelled behind the user's back
    assert _counts(kernel)["sent"] == 0


def test_a_request_no_magic_takes_is_released(kernel: Kernel, client) -> None:
    """The request sent as a cell started is for 2 GPUs, the magic then asks for 1: the 2-GPU lease is released
    and the magic's own runs (the same happens to a request whose cell fails before its magic runs)."""
    r = kernel.run(
        "from types import SimpleNamespace\n"
        "_early = get_ipython().magics_manager.registry['GpuMagics'].early\n"
        "_early.pre_run_cell(SimpleNamespace(raw_cell='%%gpu 2\\npass'))\n"
        "get_ipython().run_cell_magic('gpu', '', 'import os\\nprint(os.environ[\"GPULEASE_LEASE_ID\"])')\n"
    )
    assert r.status == "ok", r.outputs
    used = r.stdout.split()[0]
    assert _counts(kernel) == {"sent": 1, "taken": 0, "abandoned": 1}
    leases = {x.id: x for x in client.leases(ended=100)}
    assert leases[used].max_gpus == 1
    (other,) = [x for x in leases.values() if x.id != used]
    assert other.max_gpus == 2 and other.state == "released" and other.reason == "cancelled"

    kernel.run("_early.pre_run_cell(SimpleNamespace(raw_cell='%%gpu\\npass'))")  # this cell's end releases it
    assert _counts(kernel)["abandoned"] == 2
    wait_for(lambda: not client.leases(), 10, "every lease to end")  # (a cell's own is released just after it)
    assert all(x.reason in ("released", "cancelled") for x in client.leases(ended=100))
