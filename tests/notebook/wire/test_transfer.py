"""Shipping values between kernel and worker: out-of-band buffers, shared references, clear errors."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from users import in_child

from jupyter_gpulease.executors.base import WorkerCrashed
from jupyter_gpulease.executors.local import LocalWorker as Worker
from jupyter_gpulease.kernel import cellrun, drive
from jupyter_gpulease.kernel.cellcode import free_names, select_inputs
from jupyter_gpulease.wire import transfer, vmcopy


def test_large_values_travel_inline_in_the_message_where_no_file_is_shared(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A node without the shared artifact root: the buffers travel in the framed message itself, both ways; the
    kernel's inputs are packed straight into it (no file, no copy: ``write_framed`` hands on the array's own memory
    in pieces), and what arrives is the same message ``send`` writes."""
    import io

    big = np.arange(1 << 20, dtype="f8")
    packed = transfer.dumps({"big": big, "alias": big}, str(tmp_path), inline=True)
    assert not packed["file"] and packed["inline"] and not os.listdir(tmp_path)  # no buffer file, ever
    msg = {"type": "run", "inputs": packed}
    whole = io.BytesIO()
    transfer.send(whole, msg)
    pieces: list[memoryview] = []
    size = transfer.write_framed(msg, pieces.append, 1 << 20)
    assert size == transfer.framed_size(msg) == len(whole.getvalue()) and max(p.nbytes for p in pieces) <= 1 << 20
    assert b"".join(pieces) == whole.getvalue()
    mine = big.__array_interface__["data"][0]  # the array's own memory, sliced, never copied into a message
    assert any(np.frombuffer(p, dtype="u1").__array_interface__["data"][0] == mine for p in pieces)
    whole.seek(0)
    out = transfer.loads(transfer.recv(whole)["inputs"])
    assert out["big"] is out["alias"] and np.array_equal(out["big"], big) and out["big"].flags.writeable


def test_large_values_inline_cost_no_second_copy_on_the_kernels_host(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """64 MiB of inputs packed into the message and handed on in 4 MiB pieces: no file, and no more memory than a
    piece or two (a copy of the values in a file, a bytearray or a joined message would be 64 MiB each)."""
    import tracemalloc

    big = np.ones(8 << 20, dtype="f8")
    sent = 0

    def sink(piece: memoryview) -> None:
        nonlocal sent
        sent += piece.nbytes

    tracemalloc.start()
    try:
        msg = {"type": "run", "inputs": transfer.dumps_named({"x": big}, str(tmp_path), inline=True)}
        transfer.write_framed(msg, sink, 4 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert sent > big.nbytes and not os.listdir(tmp_path)
    assert peak < 8 << 20, f"{peak / 2**20:.1f} MiB allocated to send {big.nbytes / 2**20:.0f} MiB"


def test_large_buffers_travel_out_of_band_and_come_back_writable(tmp_path) -> None:  # type: ignore[no-untyped-def]
    big = np.arange(1 << 20, dtype="f8")  # 8 MiB
    small = np.arange(10)
    packed = transfer.dumps({"big": big, "alias": big, "small": small}, str(tmp_path))
    assert packed["file"] and os.path.getsize(packed["file"]) == big.nbytes  # only the big buffer went out
    assert os.stat(packed["file"]).st_mode & 0o777 == 0o600  # the user's data: no one else may read it
    assert len(packed["data"]) < 10_000
    out = transfer.loads(packed)
    assert not os.path.exists(packed["file"])  # mapped, then removed at once
    assert out["alias"] is out["big"]  # shared references survive
    assert np.array_equal(out["big"], big) and out["big"].flags.writeable
    out["big"][0] = 42.0  # copy-on-write: no effect on anything else
    assert big[0] == 0.0


def test_notebook_functions_and_classes_travel_by_value() -> None:
    ns: dict = {"__name__": "__main__"}
    exec("class P:\n    k = 3\ndef f(x):\n    return x * P.k", ns)
    out = transfer.loads(transfer.dumps({"f": ns["f"]}))
    assert out["f"](2) == 6


def test_unpicklable_value_is_named() -> None:
    with pytest.raises(transfer.TransferError, match=r"Cannot send 'lock' \(type _thread.lock\)"):
        transfer.dumps_named({"ok": 1, "lock": threading.Lock()})


def test_version_mismatch_says_so() -> None:
    transfer.check_versions({"python": "3.11.7"}, {"python": "3.11.9"})  # patch releases pickle alike
    with pytest.raises(transfer.TransferError, match="python 3.12.1 but this kernel runs python 3.11.7"):
        transfer.check_versions({"python": "3.11.7"}, {"python": "3.12.1"})
    with pytest.raises(transfer.TransferError, match="cloudpickle"):
        transfer.check_versions({"python": "3.11.7", "cloudpickle": "3.1.2"},
                                {"python": "3.11.7", "cloudpickle": "2.2.0"})


def test_free_names_and_auto_selection_guards() -> None:
    code = "import math\ny = x + math.pi\ndef g(a):\n    return a + z\nprint(y, token, big, _)\n"
    assert free_names(code) == ["x", "z", "print", "token", "big", "_"]  # in order of first use
    ns = {"x": 1, "z": 2, "token": "s3cr3t", "big": np.zeros(1 << 20), "_": 5}
    sel = select_inputs(code, ns, None, auto_max_bytes=1 << 20)
    assert sel.send == {"x": 1, "z": 2}
    assert set(sel.skipped) == {"token", "big", "_"} and "secret" in sel.skipped["token"]
    assert "MiB" in sel.skipped["big"]
    sel = select_inputs(code, ns, ["x"], auto_max_bytes=1 << 20)
    assert list(sel.send) == ["x"] and "z" in sel.skipped
    assert free_names("def broken(:\n") == []  # the worker reports the SyntaxError with the cell's lines


# ---------------------------------------------------------------- kernel <-> worker, same host
def _run(worker: Worker, code: str, inputs: dict, out: list[str], vm: bool = True):  # type: ignore[no-untyped-def]
    """One job on a real worker through the kernel side's own path (job message, drive, result)."""
    msg = cellrun.job_message(cellrun.Job(code=code, inputs=inputs, out=out), {}, transfer.shm_dir(), vm)
    errs: list[str] = []
    result = drive.drive(worker, msg, drive.Sinks(lambda text: None, errs.append), 5.0)
    outcome = cellrun.Outcome({})
    cellrun.finish_result(result, outcome)
    return msg, result, outcome, "".join(errs)


def test_large_values_are_copied_straight_between_kernel_and_worker(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(vmcopy, "CHUNK", (1 << 20) + 3 * 4096)  # uneven pieces over several threads
    big = np.arange(1 << 20, dtype="f8")  # 8 MiB
    w = Worker(session=True)
    try:
        code = "y = big * 2\nsame = alias is big\nwritable = big.flags.writeable\nbig[0] = -1.0"
        msg, result, outcome, errs = _run(w, code, {"big": big, "alias": big}, ["y", "same", "writable"])
        if not vmcopy.usable():  # e.g. a container whose seccomp profile forbids process_vm_readv/writev
            pytest.skip(f"direct copies between processes are refused on this machine: {vmcopy.why_not()}")
        assert msg["inputs"]["vm"] and msg["inputs"]["file"] is None  # in: no file, copied into the worker
        assert result["payload"]["vm"] and result["payload"]["file"] is None  # out: copied from it
        assert outcome.outputs["same"] and outcome.outputs["writable"]  # shared references survive
        y = outcome.outputs["y"]
        assert np.array_equal(y, np.arange(1 << 20, dtype="f8") * 2) and y.flags.writeable
        assert big[0] == 0.0  # the worker changed its own copy
        assert errs == "" and vmcopy.usable()
        # the same worker again (a session): its previous values are its own, not the kernel's memory
        _, _, outcome, _ = _run(w, "s = float(big[:4].sum())", {}, ["s"])
        assert outcome.outputs["s"] == -1.0 + 1 + 2 + 3
    finally:
        w.kill(0.5)


def _without_ptrace_capability() -> None:
    """Drop CAP_SYS_PTRACE (root has it; a user's kernel does not): from now on this process may read
    or write only the memory of its own dumpable processes, like any unprivileged kernel."""
    import ctypes

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    libc = ctypes.CDLL(None, use_errno=True)
    header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3
    assert libc.capget(ctypes.byref(header), data) == 0, os.strerror(ctypes.get_errno())
    data[0].effective &= ~(1 << 19)  # CAP_SYS_PTRACE
    data[0].permitted &= ~(1 << 19)
    assert libc.capset(ctypes.byref(header), data) == 0, os.strerror(ctypes.get_errno())


def test_refused_direct_copies_fall_back_to_files() -> None:
    """A kernel may not touch the memory of a worker that made itself undumpable (EPERM, as under Yama's
    ptrace_scope 2 or a seccomp profile): values still arrive, through files, and the cell says why once."""

    def theirs() -> dict:
        w = Worker(session=True)
        try:
            code = "import ctypes\nimport numpy as np\nctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE\n" \
                   "y = np.arange(1 << 20, dtype='f8')"
            _, result, outcome, errs = _run(w, code, {}, ["y"])
            first = {"equal": bool(np.array_equal(outcome.outputs["y"], np.arange(1 << 20, dtype="f8"))),
                     "file": bool(result["payload"]["file"]), "usable": vmcopy.usable(), "note": errs}
            big = np.arange(1 << 20, dtype="f8")
            msg, _, outcome, errs = _run(w, "s = float(big.sum())", {"big": big}, ["s"], vm=True)  # asked anyway
            second = {"s": outcome.outputs["s"], "file": msg["inputs"]["file"], "note": errs}
            return {"first": first, "second": second, "left": os.path.exists(second["file"] or "")}
        finally:
            w.kill(0.5)

    out = in_child(theirs, _without_ptrace_capability)
    assert out["first"]["equal"] and out["first"]["file"] and not out["first"]["usable"]
    assert "was refused" in out["first"]["note"] and "Operation not permitted" in out["first"]["note"]
    assert out["second"]["s"] == float(np.arange(1 << 20, dtype="f8").sum())
    assert out["second"]["file"] and not out["left"]  # the kernel wrote the file, the worker mapped and removed it


def test_a_worker_that_dies_while_its_result_is_copied_is_a_crash_not_a_refusal() -> None:
    w = Worker()
    poll = w.poll

    def poll_then_kill(*args):  # type: ignore[no-untyped-def]
        msg = poll(*args)
        if msg and (msg.get("payload") or {}).get("vm"):  # the result is in, its buffers not yet copied
            os.kill(w.pid, 9)
            w.proc.wait()
        return msg

    w.poll = poll_then_kill  # type: ignore[method-assign]
    try:
        with pytest.raises(WorkerCrashed, match="SIGKILL"):
            _run(w, "import numpy as np\ny = np.ones(1 << 20)", {}, ["y"])
        assert vmcopy.usable()  # a worker gone is not a refusal: the next cell copies directly again
    finally:
        w.close()


def test_direct_copy_errors_are_os_errors() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    buf = bytearray(16)
    with pytest.raises(OSError) as e:
        vmcopy.copy(gone.pid, [(vmcopy.address(buf), 16)], [(vmcopy.address(buf), 16)], write=False)
    assert e.value.errno == errno.ESRCH and f"process {gone.pid}" in str(e.value)
    with pytest.raises(ValueError, match="differ in size"):
        vmcopy.copy(os.getpid(), [(vmcopy.address(buf), 16)], [(vmcopy.address(buf), 8)], write=False)
