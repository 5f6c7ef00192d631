"""Memory faulted in ahead of a transfer (real mappings, real worker processes)."""

from __future__ import annotations

import numpy as np
import pytest
from waiting import wait_for

from jupyter_gpulease.executors.local import LocalWorker as Worker
from jupyter_gpulease.kernel import cellrun, drive
from jupyter_gpulease.wire import fastpath, transfer, vmcopy

MIB = 1 << 20


def test_buffers_are_cut_page_aligned_from_a_reserve_and_hold_their_data() -> None:
    r = fastpath.Prefaulted(8 * MIB)
    a, b = r.take([3 * MIB + 5, 2 * MIB])
    assert (len(a), len(b)) == (3 * MIB + 5, 2 * MIB)
    assert vmcopy.address(a) % fastpath.ALIGN == 0 and vmcopy.address(b) % fastpath.ALIGN == 0
    assert vmcopy.address(b) - vmcopy.address(a) >= len(a)  # no overlap
    x = np.frombuffer(b, dtype="u1")
    x[:] = 7
    assert bytes(a[:4]) == b"\0\0\0\0" and int(x.sum()) == 7 * 2 * MIB  # zero-filled, writable, its own
    assert r.spent() and r.take([1]) is None  # used up: a reserve serves one transfer


def test_what_does_not_fit_gets_fresh_memory() -> None:
    r = fastpath.Prefaulted(2 * MIB)
    assert r.take([3 * MIB]) is None and r.spent()  # too small: given back, not half used
    (d,) = fastpath.destinations([3 * MIB], fastpath.Prefaulted(2 * MIB))
    assert len(d) == 3 * MIB
    (d,) = fastpath.destinations([MIB], None)
    assert len(d) == MIB


def test_expected_sizes_follow_recent_cells_within_the_limit() -> None:
    sizes = fastpath.Sizes(keep=3)
    sizes.note(5 * MIB)
    assert sizes.expected() == 0  # no limit: no reserves (GpuMagics.warm_memory = 0)
    sizes.limit = 64 * MIB
    assert sizes.expected() == 5 * MIB
    for n in (0, 0, 0):
        sizes.note(n)
    assert sizes.expected() == 0  # the last 3 cells moved nothing large
    sizes.note(128 * MIB)
    assert sizes.expected() == 0  # over the limit: no reserve at all rather than a part


def test_a_spare_is_prepared_for_the_next_cell_and_taken_once() -> None:
    sizes = fastpath.Sizes()
    sizes.limit = 64 * MIB
    sizes.note(4 * MIB)
    if not fastpath.room_for(4 * MIB):
        pytest.skip("this host is short of memory right now: no reserve is made (by design)")
    sizes.prepare(0.0)
    spare = wait_for(lambda: sizes._spare, 30, "the spare reserve")
    assert sizes.spare() is spare
    assert spare is not None and spare.nbytes == 4 * MIB and sizes.spare() is None
    spare.close()
    assert spare.spent()


def test_no_reserve_without_room_for_it() -> None:
    available, total = fastpath.memory()
    assert total > 0 and 0 < available <= total
    assert fastpath.prefault(total) is None  # never more than the host can spare
    assert fastpath.prefault(0) is None


def test_a_waiting_worker_copies_its_inputs_into_its_reserve() -> None:
    if not vmcopy.usable():
        pytest.skip(f"direct copies between processes are refused on this machine: {vmcopy.why_not()}")
    big = np.arange(1 << 20, dtype="f8")  # 8 MiB
    w = Worker(session=True)
    try:
        w.submit({"type": "hold", "nbytes": big.nbytes})  # what the warm pool sends a new worker
        code = ("from jupyter_gpulease.wire import fastpath\n"
                "taken = fastpath.stats['taken_bytes']\ny = big * 2")
        msg = cellrun.job_message(cellrun.Job(code=code, inputs={"big": big}, out=["taken", "y"]), {},
                                  transfer.shm_dir(), True)
        result = drive.drive(w, msg, drive.Sinks(lambda text: None, lambda text: None), 5.0)
        outcome = cellrun.Outcome({})
        cellrun.finish_result(result, outcome)
        assert outcome.outputs["taken"] == big.nbytes  # copied into memory faulted in while it waited
        assert np.array_equal(outcome.outputs["y"], big * 2) and outcome.outputs["y"].flags.writeable
    finally:
        w.kill(0.5)


def test_refused_direct_copies_still_fall_back_to_files_when_the_worker_holds_a_reserve() -> None:
    from test_transfer import _without_ptrace_capability
    from users import in_child

    def theirs() -> dict:  # type: ignore[type-arg]
        w = Worker(session=True)
        try:
            big = np.arange(1 << 20, dtype="f8")
            w.submit({"type": "hold", "nbytes": big.nbytes})
            code = "import ctypes\nctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE: refuse copies\ns = 0.0"
            msg = cellrun.job_message(cellrun.Job(code=code, out=["s"]), {}, transfer.shm_dir(), True)
            drive.drive(w, msg, drive.Sinks(lambda text: None, lambda text: None), 5.0)
            code = "from jupyter_gpulease.wire import fastpath\nt = fastpath.stats['taken_bytes']\ns = float(big.sum())"
            msg = cellrun.job_message(cellrun.Job(code=code, inputs={"big": big}, out=["s", "t"]), {},
                                      transfer.shm_dir(), True)
            errs: list[str] = []
            result = drive.drive(w, msg, drive.Sinks(lambda text: None, errs.append), 5.0)
            outcome = cellrun.Outcome({})
            cellrun.finish_result(result, outcome)
            return {"s": outcome.outputs["s"], "t": outcome.outputs["t"], "file": msg["inputs"]["file"],
                    "note": "".join(errs)}
        finally:
            w.kill(0.5)

    out = in_child(theirs, _without_ptrace_capability)
    assert out["s"] == float(np.arange(1 << 20, dtype="f8").sum())  # the value arrived, through a file
    assert out["file"] and "was refused" in out["note"]
    assert out["t"] == 8 << 20  # the reserve was cut for it, then not copied into: nothing else changed


def test_work_after_the_answer_runs_in_order_and_never_before_its_delay() -> None:
    import threading
    import time

    done: list[tuple[str, float, str]] = []
    finished = threading.Event()

    def note(name: str) -> None:
        done.append((name, time.monotonic(), threading.current_thread().name))

    asked = time.monotonic()
    fastpath.after_answer(note, "meta 1")
    fastpath.after_answer(note, "meta 2")
    fastpath.after_answer(finished.set)
    assert done == []  # nothing on the asking thread: the kernel answers the cell meanwhile
    assert finished.wait(10)
    assert [name for name, _, _ in done] == ["meta 1", "meta 2"]
    assert all(at >= asked + fastpath.AFTER_ANSWER for _, at, _ in done)
    assert all(thread.startswith("gpulease-after") for _, _, thread in done)
