"""Heap blocks: a warm worker's free memory, faulted in ahead, that the cell's own large allocations land in (real
glibc heaps, real worker processes)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from jupyter_gpulease.executors.local import LocalWorker as Worker
from jupyter_gpulease.kernel import cellrun, drive
from jupyter_gpulease.wire import fastpath, transfer

MIB = 1 << 20

# in a fresh interpreter (its heap untouched by the test runner's threads): make a block, wait until it is faulted
# in, allocate in it, count the page faults, free, give it back, and watch the process's anonymous memory
PROBE = """
import json, resource, time
import numpy as np
from jupyter_gpulease.wire import fastpath

def rss():
    for line in open('/proc/self/status'):
        if line.startswith('RssAnon:'):
            return int(line.split()[1]) * 1024

x = np.ones({n} // 8)
before = rss()
block = fastpath.make_heap_block({n})
if block is None:
    print(json.dumps(None))
    raise SystemExit
while not block.ready():
    time.sleep(0.01)
held = rss() - before
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
y = x + 1
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
# a free chunk just below the block (a hole smaller than a piece) merges with it: y may start in it
inside = block.lo - fastpath.PIECE <= y.ctypes.data and y.ctypes.data + y.nbytes <= block.hi
ok = bool((y == 2).all())
del y
block.give_back()
print(json.dumps({{"held": held, "faults": faults, "inside": inside, "ok": ok, "after": rss() - before,
                  "nbytes": block.nbytes}}))
"""


def _usable() -> None:
    if fastpath._heap_libc() is None or not fastpath._can_populate():
        pytest.skip("no heap blocks here: they need glibc and MADV_POPULATE_WRITE (Linux 5.14)")
    if not fastpath.room_for(256 * MIB):
        pytest.skip("this host is short of memory right now: no block is made (by design)")


def test_a_large_allocation_lands_in_the_block_already_faulted_in_and_the_memory_goes_back() -> None:
    _usable()
    n = 128 * MIB
    out = json.loads(subprocess.run([sys.executable, "-c", PROBE.format(n=n)], capture_output=True, text=True,
                                    check=True, timeout=120).stdout)
    assert out is not None
    assert out["nbytes"] >= n + fastpath.heap_slack(n)  # room too for what the cell allocates before its large values
    assert out["held"] >= n  # faulted in ahead, while nothing used it
    assert out["inside"] and out["ok"]  # numpy's malloc served y from the block
    assert out["faults"] < 64, out  # ... with no page to fault in (128 MiB in small pages: 32,768 faults)
    assert out["after"] < out["held"] - n // 2, out  # given back: the block's pages left the process


def test_nothing_is_made_without_a_size_or_without_room_or_when_a_job_comes_meanwhile() -> None:
    assert fastpath.make_heap_block(0) is None
    _, total = fastpath.memory()
    assert fastpath.make_heap_block(total) is None  # never more than the host can spare
    _usable()
    made = fastpath.heap_stats["made"]
    assert fastpath.make_heap_block(64 * MIB, busy=lambda: True) is None  # a job came: it goes first, the block is not made
    assert fastpath.heap_stats["made"] == made


def test_a_waiting_worker_gives_its_block_back_when_memory_runs_short() -> None:
    _usable()
    probe = ("import json, sys\nfrom _queue import SimpleQueue\nfrom jupyter_gpulease.wire import fastpath\nfrom jupyter_gpulease.worker import held\n"
             "h = held.Held()\nh.make(0, 64 << 20)\nmade = h.heap is not None\n"
             "fastpath.short_of_memory = lambda: True  # what the host says when it runs short: the block goes back\n"
             "h.CHECK_SECONDS = 0.01\nq = SimpleQueue()\n"
             "import threading\nthreading.Timer(0.5, q.put, args=({'type': 'stop'},)).start()\n"
             "msg = h.wait(q)\nprint(json.dumps({'made': made, 'kept': h.heap is not None, 'msg': msg}))")
    out = json.loads(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                                    timeout=60).stdout)
    assert out == {"made": True, "kept": False, "msg": {"type": "stop"}}


def test_a_cells_own_result_lands_in_the_block_its_worker_made_while_waiting() -> None:
    _usable()
    x = np.arange(4 << 20, dtype="f8")  # 32 MiB
    w = Worker(session=True)
    try:
        w.submit({"type": "hold", "nbytes": x.nbytes, "heap": x.nbytes})  # what the warm pool sends
        code = ("from jupyter_gpulease.wire import fastpath\ny = x * 2\n"
                "inside = fastpath.heap_stats['lo'] <= y.ctypes.data < fastpath.heap_stats['hi']")
        msg = cellrun.job_message(cellrun.Job(code=code, inputs={"x": x}, out=["y", "inside"]), {},
                                  transfer.shm_dir(), True)
        outcome = cellrun.Outcome({})
        cellrun.finish_result(drive.drive(w, msg, drive.Sinks(lambda t: None, lambda t: None), 5.0), outcome)
        assert outcome.outputs["inside"] is True
        assert np.array_equal(outcome.outputs["y"], x * 2)
    finally:
        w.kill(0.5)

