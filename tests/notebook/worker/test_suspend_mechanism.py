"""Suspending a worker's processes where they run (``worker.suspend``), on real child processes and the fake
libcuda (tests/fake_cuda): the GPU state checkpointed and the process stopped, then continued, restored and
unlocked; the measured errors of the real driver surfacing as SuspendError / ResumeError; what a failed step undoes."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_cuda import FakeCuda, build, compiler
from waiting import wait_for

from jupyter_gpulease.worker import suspend as sus

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C compiler (gcc or $CC) to build the fake libcuda")

#: a worker: uses CUDA (through the fake's cuInit) when told, keeps counting, answers "count digest" per line read
CHILD = r"""
import ctypes, hashlib, os, sys, threading, time
if sys.argv[1] == "cuda":
    assert ctypes.CDLL(os.environ["GPULEASE_LIBCUDA"]).cuInit(0) == 0
data = bytearray(os.urandom(1 << 20))
count = 0
def work():
    global count
    while True:
        sum(range(2000))
        count += 1
        time.sleep(0.001)
threading.Thread(target=work, daemon=True).start()
print("ready", hashlib.sha256(data).hexdigest(), flush=True)
for line in sys.stdin:
    print(count, hashlib.sha256(data).hexdigest(), flush=True)
"""

OLD = "GPU-fa4e0000-0000-4000-8000-000000000000"
NEW = "GPU-fa4e0001-0000-4000-8000-000000000001"


class Worker:
    def __init__(self, cuda: bool) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, "cuda" if cuda else "cpu"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)
        self.pid = self.proc.pid
        assert self.proc.stdout is not None
        word, self.digest = self.proc.stdout.readline().split()
        assert word == "ready"

    def ask(self) -> tuple[int, str]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("?\n")
        self.proc.stdin.flush()
        count, digest = self.proc.stdout.readline().split()
        return int(count), digest

    def letter(self) -> str:
        return sus._proc_state(self.pid)

    def cpu_ticks(self) -> int:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime

    def end(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    build()
    f = FakeCuda(tmp_path / "cuda")
    for k, v in f.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("FAKE_CUDA_DRIVER_VERSION", raising=False)
    return f


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    made: list[Worker] = []
    yield made
    for w in made:
        w.end()


def start(workers: list[Worker], cuda: bool = True) -> Worker:
    w = Worker(cuda)
    workers.append(w)
    return w


def test_a_cuda_process_is_checkpointed_and_stopped_then_comes_back_intact(fake: FakeCuda, workers: list[Worker]) -> None:
    w = start(workers)
    assert fake.state(w.pid) == "RUNNING"
    before, digest = w.ask()
    done = sus.suspend([w.pid])
    assert done.how == "checkpoint" and done.checkpointed == (w.pid,) and done.seconds >= 0
    assert w.letter() == "T" and fake.state(w.pid) == "CHECKPOINTED"
    ticks = w.cpu_ticks()
    time.sleep(0.3)  # a real process observed: a stopped one takes no CPU
    assert w.cpu_ticks() == ticks
    assert [c.split()[0] for c in fake.calls(w.pid)] == ["lock", "checkpoint"]
    assert 0 < int(fake.calls(w.pid)[0].split()[1]) <= 60000  # the lock's timeout, ms

    assert sus.resume([w.pid]) >= 0
    assert w.letter() != "T" and fake.state(w.pid) == "RUNNING"
    assert fake.calls(w.pid)[2:] == ["restore - 0", "unlock 0"]  # same GPUs: no pairs
    wait_for(lambda: w.ask()[0] > before, 10, "the worker counting again")
    assert w.ask()[1] == digest == w.digest


def test_other_gpus_are_passed_to_the_restore_as_pairs(fake: FakeCuda, workers: list[Worker]) -> None:
    w = start(workers)
    sus.suspend([w.pid])
    sus.resume([w.pid], {OLD: NEW, NEW: OLD})
    assert fake.calls(w.pid)[2] == f"restore {OLD}>{NEW},{NEW}>{OLD} 0"
    sus.suspend([w.pid])
    sus.resume([w.pid], {OLD: OLD})  # the same GPU: no remapping
    assert fake.calls(w.pid)[-2:] == ["restore - 0", "unlock 0"]
    with pytest.raises(sus.ResumeError, match="not a GPU UUID"):
        sus.resume([w.pid], {OLD: "GPU-12"})


def test_a_process_that_never_used_cuda_is_only_stopped(fake: FakeCuda, workers: list[Worker]) -> None:
    cpu, gpu = start(workers, cuda=False), start(workers)
    alone = sus.suspend([cpu.pid])
    assert alone.how == "stop" and alone.checkpointed == () and cpu.letter() == "T"
    assert fake.state(cpu.pid) is None and fake.calls(cpu.pid) == []
    sus.resume([cpu.pid])
    assert cpu.letter() != "T" and cpu.ask()[1] == cpu.digest
    both = sus.suspend([cpu.pid, gpu.pid])
    assert both.how == "checkpoint" and both.checkpointed == (gpu.pid,)
    assert cpu.letter() == gpu.letter() == "T"
    sus.resume([cpu.pid, gpu.pid])
    assert fake.state(gpu.pid) == "RUNNING" and cpu.letter() != "T" and gpu.letter() != "T"


def test_without_libcuda_suspend_is_sigstop_and_sigcont(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, workers: list[Worker]) -> None:
    monkeypatch.setenv("GPULEASE_LIBCUDA", str(tmp_path / "no-libcuda.so.1"))
    cap = sus.capability()
    assert not cap.cuda and cap.library == "" and cap.suspendable and "does not load" in cap.why
    w = start(workers, cuda=False)
    assert sus.suspend([w.pid]).how == "stop" and w.letter() == "T"
    sus.resume([w.pid])
    assert w.letter() != "T"


def test_capability_with_the_fake_driver(fake: FakeCuda, monkeypatch: pytest.MonkeyPatch, workers: list[Worker]) -> None:
    cap = sus.capability()
    assert cap.cuda and cap.suspendable and cap.driver_version == 13000 and cap.library == str(build())
    monkeypatch.setenv("FAKE_CUDA_DRIVER_VERSION", "12040")  # a CUDA host too old for the checkpoint API
    old = sus.capability()
    assert not old.cuda and not old.suspendable and old.driver_version == 12040 and "12.8" in old.why
    w = start(workers)
    with pytest.raises(sus.SuspendError, match="12.8"):
        sus.suspend([w.pid])
    assert w.letter() != "T" and fake.state(w.pid) == "RUNNING"


def test_a_missing_pid_and_a_second_suspend_name_the_cuda_error(fake: FakeCuda, workers: list[Worker]) -> None:
    gone = start(workers)
    gone.end()
    with pytest.raises(sus.SuspendError, match=rf"pid {gone.pid}: cuCheckpointProcessGetState .*OPERATING_SYSTEM"):
        sus.suspend([gone.pid])
    w = start(workers)
    sus.suspend([w.pid])
    with pytest.raises(sus.SuspendError, match=rf"pid {w.pid}: .*stopped already"):
        sus.suspend([w.pid])  # never asks the driver: GetState blocks on a stopped process (measured on an H200)
    assert fake.state(w.pid) == "CHECKPOINTED"  # the first suspend stands
    with pytest.raises(sus.ResumeError, match=rf"pid {gone.pid}: SIGCONT"):
        sus.resume([w.pid, gone.pid])
    assert fake.state(w.pid) == "RUNNING" and w.letter() != "T"  # the others are resumed all the same


def test_the_fake_does_not_answer_getstate_for_a_stopped_process(fake: FakeCuda, workers: list[Worker]) -> None:
    w = start(workers)
    sus.suspend([w.pid])
    drv = sus._driver()
    assert drv is not None
    assert sus._bounded(drv.state, time.monotonic() + 0.5, w.pid) is None  # as the real driver: no answer while stopped
    sus.resume([w.pid])
    assert drv.state(w.pid) == (sus.CUDA_SUCCESS, sus.RUNNING)


def test_a_failed_lock_undoes_the_locks_before_it(fake: FakeCuda, workers: list[Worker]) -> None:
    a, b = start(workers), start(workers)
    fake.fail(b.pid, "lock", 909)
    with pytest.raises(sus.SuspendError, match=rf"pid {b.pid}: cuCheckpointProcessLock .*CUDA_ERROR_TIMEOUT"):
        sus.suspend([a.pid, b.pid])
    assert fake.state(a.pid) == fake.state(b.pid) == "RUNNING"
    assert [c.split()[0] for c in fake.calls(a.pid)] == ["lock", "unlock"]
    assert a.letter() != "T" and b.letter() != "T"


def test_a_failed_checkpoint_restores_those_checkpointed(fake: FakeCuda, workers: list[Worker]) -> None:
    a, b = start(workers), start(workers)
    fake.fail(b.pid, "checkpoint", 801)
    with pytest.raises(sus.SuspendError, match=rf"pid {b.pid}: cuCheckpointProcessCheckpoint .*NOT_SUPPORTED"):
        sus.suspend([a.pid, b.pid])
    assert fake.calls(a.pid)[1:] == ["checkpoint 0", "restore - 0", "unlock 0"]
    assert [c.split()[0] for c in fake.calls(b.pid)] == ["lock", "checkpoint", "unlock"]
    assert fake.state(a.pid) == fake.state(b.pid) == "RUNNING" and a.letter() != "T" and b.letter() != "T"
    assert a.ask()[1] == a.digest


def test_a_restore_without_memory_loses_the_gpu_state(fake: FakeCuda, workers: list[Worker]) -> None:
    w = start(workers)
    sus.suspend([w.pid])
    fake.oom()
    with pytest.raises(sus.ResumeError, match=rf"pid {w.pid}: cuCheckpointProcessRestore .*OUT_OF_MEMORY.*lost"):
        sus.resume([w.pid])
    assert fake.state(w.pid) == "CHECKPOINTED" and fake.lost(w.pid) and w.letter() != "T"
    fake.oom(False)
    for _ in range(2):  # measured: every later restore fails
        with pytest.raises(sus.ResumeError, match="CUDA_ERROR_OPERATING_SYSTEM"):
            sus.resume([w.pid])
    assert fake.state(w.pid) == "CHECKPOINTED"


def test_the_fake_keeps_the_measured_states_and_errors(fake: FakeCuda, workers: list[Worker]) -> None:
    """The table of docs/gpu-checks.md, called directly: what a real driver returned, call by call."""
    lib = ctypes.CDLL(str(build()))
    w, cpu = start(workers), start(workers, cuda=False)
    lock = sus._LockArgs(timeoutMs=200)
    ck, un, rs = sus._CheckpointArgs(), sus._UnlockArgs(), sus._RestoreArgs()
    name = sus._Driver(str(build())).name
    state = ctypes.c_int()

    def call(fn: str, pid: int, args: object) -> str:
        return name(getattr(lib, fn)(pid, ctypes.byref(args)))  # type: ignore[arg-type]

    assert call("cuCheckpointProcessUnlock", w.pid, un) == "CUDA_ERROR_ILLEGAL_STATE"
    assert call("cuCheckpointProcessRestore", w.pid, rs) == "CUDA_ERROR_ILLEGAL_STATE"
    assert call("cuCheckpointProcessLock", w.pid, lock) == "CUDA_SUCCESS"
    assert call("cuCheckpointProcessRestore", w.pid, rs) == "CUDA_ERROR_ILLEGAL_STATE"
    assert call("cuCheckpointProcessCheckpoint", w.pid, ck) == "CUDA_SUCCESS"
    assert call("cuCheckpointProcessUnlock", w.pid, un) == "CUDA_ERROR_ILLEGAL_STATE"
    os.kill(w.pid, signal.SIGSTOP)
    wait_for(lambda: w.letter() == "T", 5, "the worker stopped")
    t = time.monotonic()  # a restore does not finish while the target is stopped: the fake gives up at the lock's
    assert call("cuCheckpointProcessRestore", w.pid, rs) == "CUDA_ERROR_TIMEOUT"  # timeout, still CHECKPOINTED
    assert time.monotonic() - t >= 0.2 and fake.state(w.pid) == "CHECKPOINTED"
    os.kill(w.pid, signal.SIGCONT)
    assert call("cuCheckpointProcessRestore", w.pid, rs) == "CUDA_SUCCESS"
    assert call("cuCheckpointProcessUnlock", w.pid, un) == "CUDA_SUCCESS"
    assert lib.cuCheckpointProcessGetState(w.pid, ctypes.byref(state)) == 0 and state.value == sus.RUNNING
    assert name(lib.cuCheckpointProcessGetState(cpu.pid, ctypes.byref(state))) == "CUDA_ERROR_NOT_INITIALIZED"
    assert call("cuCheckpointProcessLock", cpu.pid, lock) == "CUDA_ERROR_NOT_INITIALIZED"
    cpu.end()
    assert name(lib.cuCheckpointProcessGetState(cpu.pid, ctypes.byref(state))) == "CUDA_ERROR_OPERATING_SYSTEM"


def test_the_gpu_check_script_drives_the_shipped_module(fake: FakeCuda, workers: list[Worker], tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """scripts/gpu_check.py (run on a real GPU only) makes its calls through this module: its pieces, on the fake."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check_script", Path(__file__).parents[3] / "scripts/gpu_check.py")
    assert spec is not None and spec.loader is not None
    gc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gc)
    monkeypatch.setattr(gc, "OUT_DIR", tmp_path)
    cpu = gc.cpu_only(16 << 20)
    assert cpu["how"] == "stop" and cpu["proc_state_suspended"] == "T" and cpu["intact"]
    cu = gc.Cuda()
    assert cu.drv is sus._driver() and cu.init()["capability"]["cuda"]
    w = start(workers)
    steps = [cu.call(k, w.pid, 10) for k in ("lock", "checkpoint", "restore", "unlock")]
    assert [s["rc"] for s in steps] == ["CUDA_SUCCESS"] * 4 and cu.state(w.pid)["state"] == "RUNNING"
    cs = gc.custom_storage(cu)  # the fake, like driver 580, has no custom storage (CUDA 13.4's)
    assert cs["dlsym"] is False and cs["available"] is False, cs
    assert set(gc.thp_settings()) >= {"enabled", "defrag"}
