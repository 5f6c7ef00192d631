"""What a pre-started (warm) worker, and the memory it holds ahead of a lease, must never change: a fresh process
per cell that inherits none of the kernel's descriptors and sees only its lease's GPUs, values that arrive right
(also through reserves), and the option that turns reserves off. Real kernels, workers and broker."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from kernels import Kernel
from waiting import wait_for

PROBE = (
    "%%gpu\n"
    "import json, os\n"
    "fds = {}\n"
    "for fd in os.listdir('/proc/self/fd'):\n"
    "    try:\n"
    "        fds[fd] = os.readlink(f'/proc/self/fd/{fd}')\n"
    "    except OSError:\n"
    "        pass  # the directory listing's own descriptor, closed meanwhile\n"
    "import probe_gpus\n"
    "print(json.dumps({'pid': os.getpid(), 'fds': fds, 'cvd': os.environ['CUDA_VISIBLE_DEVICES'],\n"
    "                  'at_import': probe_gpus.SEEN, 'lease': os.environ['GPULEASE_LEASE_ID']}))\n"
)

KERNEL_FDS = (
    "import json, os\n"
    "print(json.dumps({fd: os.readlink(f'/proc/self/fd/{fd}') for fd in os.listdir('/proc/self/fd')\n"
    "                  if os.path.exists(f'/proc/self/fd/{fd}')}))"
)


@pytest.fixture
def kernel(broker, tmp_path: Path) -> Iterator[Kernel]:  # type: ignore[no-untyped-def]
    k = Kernel(broker.url, str(tmp_path / "artifacts"))
    yield k
    k.stop()


def _probe(kernel: Kernel) -> dict:  # type: ignore[type-arg]
    r = kernel.run(PROBE)
    assert r.status == "ok", r.outputs
    return json.loads(r.stdout.splitlines()[0])  # type: ignore[no-any-return]


def test_every_cell_gets_a_fresh_process_with_only_its_gpus_and_none_of_the_kernels_descriptors(
        broker, client, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # a module the cell imports that reads the GPUs at import time, as CUDA libraries do
    (tmp_path / "probe_gpus.py").write_text("import os\nSEEN = os.environ.get('CUDA_VISIBLE_DEVICES')\n")
    kernel = Kernel(broker.url, str(tmp_path / "artifacts"), {"PYTHONPATH": str(tmp_path)})
    try:
        kernel_fds = json.loads(kernel.run(KERNEL_FDS).stdout)
        assert any(t.startswith("socket:") for t in kernel_fds.values())  # the kernel has sockets (zmq) ...
        other = client.request_lease(1, heartbeat=False)  # ... and another lease holds one of the 4 GPUs
        seen = []
        for _ in range(3):  # the first cell takes the warm worker started with the kernel, the next ones refills
            cell = _probe(kernel)
            seen.append(cell)
            lease = client.lease(cell["lease"])
            assert cell["cvd"] == lease["env"]["CUDA_VISIBLE_DEVICES"] and cell["cvd"].startswith("GPU-")
            assert cell["at_import"] == cell["cvd"]  # set before any of the cell's imports ran
            assert other["env"]["CUDA_VISIBLE_DEVICES"] not in cell["cvd"].split(",")
            # (a module file open at that instant is the worker's own import on a background thread: process.py
            # loads linecache off the cell's path while the first cell runs)
            fds = {fd: target for fd, target in cell["fds"].items()
                   if not target.startswith("/proc/") and not target.endswith((".py", ".pyc"))}
            assert fds["0"] == "/dev/null"
            # stdout, stderr, the control pipe and the private dup of stdin: pipes to the kernel, nothing else
            assert all(t.startswith("pipe:") for fd, t in fds.items() if fd != "0"), fds
            assert len(fds) <= 5, fds
            assert not set(fds.values()) & {t for t in kernel_fds.values() if not t.startswith("pipe:")}
        pids = [c["pid"] for c in seen]
        assert len(set(pids)) == 3 and kernel.pid not in pids
        wait_for(lambda: not any(os.path.exists(f"/proc/{p}") for p in pids), 10, "every cell's worker reaped")
        client.release(other["id"])
    finally:
        kernel.stop()


def test_values_arrive_right_through_memory_reserved_ahead_and_reserves_can_be_turned_off(
        kernel: Kernel) -> None:
    r = kernel.run("import numpy as np\nfrom jupyter_gpulease.wire import fastpath\nx = np.arange(1 << 20, dtype='f8')")
    assert r.status == "ok", r.outputs
    cell = ("%%gpu --in x --out y,got,inheap\nfrom jupyter_gpulease.wire import fastpath\n"
            "got = fastpath.stats['taken_bytes']\ny = x * 2\n"
            "inheap = fastpath.heap_stats['made'], fastpath.heap_stats['lo'] <= y.ctypes.data < fastpath.heap_stats['hi']")
    assert kernel.run(cell).status == "ok"  # the first 8 MiB cell: nothing reserved yet, sizes noted
    taken = []
    for i in range(1, 3):
        # the warm worker (and the kernel's spare for the result) were sized from the last cells
        wait_for(lambda: kernel.run("print(fastpath.RESULTS._spare is not None)").stdout.strip() == "True", 30,
                 "the kernel's spare reserve")
        r = kernel.run(f"x = np.arange(1 << 20, dtype='f8') + {i}\nbefore = fastpath.stats['taken_bytes']")
        assert r.status == "ok"
        r = kernel.run(cell)
        assert r.status == "ok", r.outputs
        r = kernel.run(f"print(bool((y == (np.arange(1 << 20) + {i}) * 2).all()), y.flags.writeable, got,"
                       " fastpath.stats['taken_bytes'] - before)")
        ok, writable, in_worker, in_kernel = r.stdout.split()
        assert ok == "True" and writable == "True"
        taken.append((int(in_worker), int(in_kernel)))
        # the cell's own y (numpy, through malloc) landed in the heap block its worker made while it waited
        assert kernel.run("print(inheap)").stdout.strip() == "(1, True)"
    assert all(t == (8 << 20, 8 << 20) for t in taken), taken  # copied into reserves on both sides
    # off: no reserves anywhere, values still right
    assert kernel.run("%config GpuMagics.warm_memory = '0'").status == "ok"
    r = kernel.run("%config GpuMagics.warm_memory = 'lots'")
    assert r.status == "error" or "Invalid GpuMagics.warm_memory 'lots'" in r.stdout + r.stderr, r.outputs
    r = kernel.run("print(get_ipython().find_magic('gpu').__self__.warm_memory)")
    assert r.stdout.strip() == "0"  # kept as it was
    r = kernel.run("before = fastpath.stats['taken_bytes']")
    for _ in range(2):
        assert kernel.run(cell).status == "ok"
    r = kernel.run("print(bool((y == (np.arange(1 << 20) + 2) * 2).all()), got, fastpath.stats['taken_bytes'] - before,"
                   " inheap[0])")
    assert r.stdout.split() == ["True", "0", "0", "0"], r.stdout  # no heap block made either


def test_a_session_worker_gets_memory_for_its_next_inputs(kernel: Kernel) -> None:
    assert kernel.run("import numpy as np\nx = np.ones(1 << 20)").status == "ok"
    cell = "%%gpu --session s --in x --out t\nfrom jupyter_gpulease.wire import fastpath\nt = fastpath.stats['taken_bytes']"
    assert kernel.run(cell).status == "ok"
    got = []
    for _ in range(2):
        r = kernel.run(cell)
        assert r.status == "ok", r.outputs
        got.append(int(kernel.run("print(t)").stdout))
    assert got[1] - got[0] == 8 << 20, got  # each later cell's x went into memory faulted in between cells
    assert kernel.run("%gpu session stop s").status == "ok"


COUNT_STARTS = (
    "import threading\n"
    "_starts = []\n"
    "_start = threading.Thread.start\n"
    "def _counting(self, *a, **k):\n"
    "    if threading.current_thread() is threading.main_thread():\n"
    "        _starts.append(self.name)\n"
    "    return _start(self, *a, **k)\n"
    "threading.Thread.start = _counting"
)

SETTLED = (  # the last cell's work is done: its lease released, the next warm worker waiting
    "_m = get_ipython().find_magic('gpu').__self__\n"
    "print(bool(_m.pool._idle) and not _m.pool._filling and not _m.client.leases())"
)


def test_a_cell_starts_no_thread_while_the_user_waits(kernel: Kernel) -> None:
    """Starting a thread waits until it runs (milliseconds on a busy host): what the kernel does after a cell (reap
    the worker, release the lease, start the next warm worker, fault in memory) goes to threads already running."""
    for _ in range(2):  # the first cells start what later cells reuse
        assert kernel.run("%%gpu\npass").status == "ok"
        wait_for(lambda: kernel.run(SETTLED).stdout.strip() == "True", 30, "the cell's work after it")
    assert kernel.run(COUNT_STARTS).status == "ok"
    assert kernel.run("%%gpu\nx = 1").status == "ok"
    r = kernel.run("threading.Thread.start = _start\nprint(_starts)")
    assert r.stdout.strip() == "[]", r.stdout
    wait_for(lambda: kernel.run(SETTLED).stdout.strip() == "True", 30, "the cell's lease released after it")
