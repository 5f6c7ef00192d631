"""Suspending a worker's processes where they run: their GPU state to host memory, their CPU stopped; and back.

The worker host's half of a suspended lease (issue 33). ``suspend(pids)`` moves each process's GPU state out
through the CUDA driver's checkpoint API (lock, then checkpoint: device memory copied into the process's own host
memory, its GPU resources released) and then stops every process (SIGSTOP) so it takes no CPU. ``resume(pids)``
continues them (SIGCONT), restores their GPU state (onto other GPUs of the same model when given UUID pairs) and
unlocks them. Processes that never used CUDA are only stopped and continued; on a host with no ``libcuda.so.1`` at
all (the simulated inventory, CPU-only hosts) that is the whole of it. ``capability()`` says which applies here.

Order, from the measurements on H100/H200 with driver 580 (docs/gpu-checks.md):

- suspend = lock (0.5 ms) -> checkpoint (5.0-6.5 s for an 11.8 GB footprint: one driver thread in the target
  copying into fresh pageable memory at page-fault speed; 1.8-2.3 s into a region the worker faulted in ahead,
  ``ckpt_pool``) -> SIGSTOP. The lock waits for the process's submitted GPU work (bounded by ``timeout``).
- resume = SIGCONT -> restore (1.9-2.8 s; 1.5-2.2 s from the region's huge pages) -> unlock (1 ms). The driver restores on a thread inside the target, so a
  restore does not finish while the target is stopped: SIGCONT must come first.
- A restore that fails (CUDA_ERROR_OUT_OF_MEMORY while another process holds the GPU's memory) loses the process's
  GPU state: every later restore fails with CUDA_ERROR_OPERATING_SYSTEM. ``ResumeError`` says so; the caller must
  resume only onto GPUs that are free, and treat the error as the end of that worker.

Why ``ctypes`` on ``libcuda.so.1`` and not NVIDIA's ``cuda-bindings``: the API is six C functions taking a pid and a
64-byte struct; ctypes needs no package in the user's kernel environment (this module runs there); it does not tie
us to a bindings version that must match the driver; and it loads whatever ``libcuda.so.1`` the loader finds, so
the tests substitute a fake library (``tests/fake_cuda``) exactly as the NVML tests substitute libnvidia-ml.
``$GPULEASE_LIBCUDA`` names another library than ``libcuda.so.1``.

The suspended state lives only in the suspended process's own memory (nothing is written to disk), so nothing of
it is readable by another user. This module is pure stdlib and is imported by the kernel, never by the broker.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

_R = TypeVar("_R")

#: the lowest ``cuDriverGetVersion`` (CUDA 12.8, driver r570) whose libcuda exports the public
#: ``cuCheckpointProcess*`` entry points; the r550/r555 drivers had checkpointing only behind NVIDIA's
#: ``cuda-checkpoint`` tool (a private interface). Measured working: 13000 (driver 580.159.04).
MIN_DRIVER_VERSION = 12080

#: CUprocessState
RUNNING, LOCKED, CHECKPOINTED, FAILED = 0, 1, 2, 3
STATE_NAMES = {RUNNING: "RUNNING", LOCKED: "LOCKED", CHECKPOINTED: "CHECKPOINTED", FAILED: "FAILED"}

#: the CUresult values this module acts on (names from cuda.h; used when the library has no cuGetErrorName)
CUDA_SUCCESS = 0
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_OPERATING_SYSTEM = 304
CUDA_ERROR_ILLEGAL_STATE = 401
_ERROR_NAMES = {0: "CUDA_SUCCESS", 1: "CUDA_ERROR_INVALID_VALUE", 2: "CUDA_ERROR_OUT_OF_MEMORY",
                3: "CUDA_ERROR_NOT_INITIALIZED", 100: "CUDA_ERROR_NO_DEVICE", 304: "CUDA_ERROR_OPERATING_SYSTEM",
                401: "CUDA_ERROR_ILLEGAL_STATE", 800: "CUDA_ERROR_NOT_PERMITTED", 801: "CUDA_ERROR_NOT_SUPPORTED",
                909: "CUDA_ERROR_TIMEOUT", 999: "CUDA_ERROR_UNKNOWN"}

_CHECKPOINT_CALLS = ("cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint", "cuCheckpointProcessRestore",
                     "cuCheckpointProcessUnlock", "cuCheckpointProcessGetState")

#: how long a SIGSTOP / SIGCONT may take to show in /proc/PID/stat
_SIGNAL_WAIT_S = 5.0


class SuspendError(Exception):
    """The processes could not be suspended; what was done was undone (they run as before, holding their GPUs)."""


class ResumeError(Exception):
    """A process could not be resumed. After a failed restore its GPU state is lost: end the process."""


@dataclass(frozen=True)
class Capability:
    """Whether this host can suspend a worker's processes, and how.

    ``cuda``: libcuda loads, exports the checkpoint calls and its driver is new enough (``driver_version`` >=
    ``MIN_DRIVER_VERSION``). ``library``: the path of the libcuda that loaded, "" when none could be. ``why`` says
    in words what was found.
    """

    cuda: bool
    driver_version: int = 0
    why: str = ""
    library: str = ""

    @property
    def suspendable(self) -> bool:
        """True with the checkpoint API, or with no libcuda at all (no process here can hold GPU state, so SIGSTOP
        alone suspends); False on a CUDA host without the API (SIGSTOP would not free its GPU)."""
        return self.cuda or not self.library


@dataclass(frozen=True)
class Suspended:
    """What ``suspend`` did: ``how`` is "checkpoint" when a process's GPU state was moved out, "stop" when every
    process was only stopped; ``seconds`` in all; ``host_bytes``: the growth of the processes' resident memory
    (the checkpoints, which live there until the resume); ``checkpointed``: the pids whose GPU state moved."""

    how: str
    seconds: float
    host_bytes: int = 0
    checkpointed: tuple[int, ...] = ()


# ------------------------------------------------------------------------------------------------ the driver
class _LockArgs(ctypes.Structure):
    _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint), ("reserved1", ctypes.c_uint64 * 7)]


class _CheckpointArgs(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


class _GpuPair(ctypes.Structure):
    _fields_ = [("oldUuid", ctypes.c_ubyte * 16), ("newUuid", ctypes.c_ubyte * 16)]


class _RestoreArgs(ctypes.Structure):
    _fields_ = [("gpuPairs", ctypes.POINTER(_GpuPair)), ("gpuPairsCount", ctypes.c_uint),
                ("reserved", ctypes.c_char * 44), ("reserved1", ctypes.c_uint64)]


class _UnlockArgs(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


class _Driver:
    """libcuda's checkpoint calls through ctypes (ctypes zero-fills every struct, reserved fields included)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.lib = ctypes.CDLL(path)
        self.missing = [n for n in _CHECKPOINT_CALLS if not hasattr(self.lib, n)]
        P, c_int = ctypes.POINTER, ctypes.c_int
        sigs = {"cuInit": [ctypes.c_uint], "cuDriverGetVersion": [P(c_int)],
                "cuGetErrorName": [c_int, P(ctypes.c_char_p)],
                "cuCheckpointProcessGetState": [c_int, P(c_int)],
                "cuCheckpointProcessGetRestoreThreadId": [c_int, P(c_int)],
                "cuCheckpointProcessLock": [c_int, P(_LockArgs)],
                "cuCheckpointProcessCheckpoint": [c_int, P(_CheckpointArgs)],
                "cuCheckpointProcessRestore": [c_int, P(_RestoreArgs)],
                "cuCheckpointProcessUnlock": [c_int, P(_UnlockArgs)]}
        for name, args in sigs.items():
            if hasattr(self.lib, name):
                f = getattr(self.lib, name)
                f.argtypes, f.restype = args, ctypes.c_int
        self._init_rc: int | None = None
        self._init_lock = threading.Lock()

    def version(self) -> int:
        if not hasattr(self.lib, "cuDriverGetVersion"):
            return 0
        v = ctypes.c_int(0)
        return v.value if self.lib.cuDriverGetVersion(ctypes.byref(v)) == 0 else 0

    def init(self) -> int:
        """``cuInit(0)`` once in this (the calling) process: a restore needs it, or persistence mode."""
        with self._init_lock:
            if self._init_rc is None:
                self._init_rc = int(self.lib.cuInit(0)) if hasattr(self.lib, "cuInit") else CUDA_ERROR_NOT_INITIALIZED
            return self._init_rc

    def name(self, rc: int) -> str:
        s = ctypes.c_char_p()
        if hasattr(self.lib, "cuGetErrorName") and self.lib.cuGetErrorName(rc, ctypes.byref(s)) == 0 and s.value:
            return s.value.decode(errors="replace")
        return _ERROR_NAMES.get(rc, f"CUresult {rc}")

    def state(self, pid: int) -> tuple[int, int]:
        """(rc, state) of ``cuCheckpointProcessGetState``."""
        s = ctypes.c_int(-1)
        rc = self.lib.cuCheckpointProcessGetState(pid, ctypes.byref(s))
        return int(rc), s.value

    def lock(self, pid: int, timeout: float) -> int:
        args = _LockArgs(timeoutMs=max(1, min(int(timeout * 1000), 0xFFFFFFFF)))
        return int(self.lib.cuCheckpointProcessLock(pid, ctypes.byref(args)))

    def checkpoint(self, pid: int) -> int:
        return int(self.lib.cuCheckpointProcessCheckpoint(pid, ctypes.byref(_CheckpointArgs())))

    def restore(self, pid: int, pairs: list[tuple[bytes, bytes]] | None) -> int:
        args = _RestoreArgs()
        arr = None
        if pairs:
            arr = (_GpuPair * len(pairs))()
            for i, (old, new) in enumerate(pairs):
                arr[i].oldUuid[:] = list(old)
                arr[i].newUuid[:] = list(new)
            args.gpuPairs = ctypes.cast(arr, ctypes.POINTER(_GpuPair))
            args.gpuPairsCount = len(pairs)
        rc = int(self.lib.cuCheckpointProcessRestore(pid, ctypes.byref(args)))
        del arr  # kept alive across the call
        return rc

    def unlock(self, pid: int) -> int:
        return int(self.lib.cuCheckpointProcessUnlock(pid, ctypes.byref(_UnlockArgs())))


_DRIVERS: dict[str, _Driver | None] = {}
_DRIVERS_LOCK = threading.Lock()


def _library_path() -> str:
    return os.environ.get("GPULEASE_LIBCUDA") or "libcuda.so.1"


def _driver() -> _Driver | None:
    """The loaded libcuda (one per path, cached), or None when none can be loaded."""
    path = _library_path()
    with _DRIVERS_LOCK:
        if path not in _DRIVERS:
            try:
                _DRIVERS[path] = _Driver(path)
            except OSError:
                _DRIVERS[path] = None
        return _DRIVERS[path]


def capability() -> Capability:
    """Whether this host can checkpoint CUDA processes (see ``Capability``); cheap after the first call."""
    path = _library_path()
    drv = _driver()
    if drv is None:
        return Capability(False, 0, f"no CUDA driver here ({path} does not load): suspending only stops the "
                                    "processes (SIGSTOP), which holds no GPU state")
    version = drv.version()
    if drv.missing:
        return Capability(False, version, f"the CUDA driver ({path}, version {version}) has no checkpoint API "
                                          f"({', '.join(drv.missing)} missing): its processes cannot be suspended; "
                                          f"a driver of CUDA {_v(MIN_DRIVER_VERSION)} or later can", path)
    if version < MIN_DRIVER_VERSION:
        return Capability(False, version, f"the CUDA driver ({path}) is CUDA {_v(version)}; checkpointing needs "
                                          f"{_v(MIN_DRIVER_VERSION)} or later (driver r570+)", path)
    return Capability(True, version, f"the CUDA driver ({path}, CUDA {_v(version)}) can checkpoint processes", path)


def _v(version: int) -> str:
    return f"{version // 1000}.{version % 1000 // 10}"


# ------------------------------------------------------------------------------------------------ processes
def _proc_state(pid: int) -> str:
    """The kernel's state letter of a process (R, S, T = stopped, Z, ...), "gone" when there is none."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _signal(pids: list[int], sig: int, stopped: bool) -> list[int]:
    """Send ``sig`` to each pid and wait (bounded) until each shows stopped (or not); returns the pids that are
    gone."""
    gone = []
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            gone.append(pid)
    end = time.monotonic() + _SIGNAL_WAIT_S
    for pid in pids:
        if pid in gone:
            continue
        while True:
            st = _proc_state(pid)
            if st in ("gone", "Z", "X"):
                gone.append(pid)
                break
            if (st in ("T", "t")) == stopped or time.monotonic() > end:
                break
            time.sleep(0.001)
    return gone


def _bounded(fn: Callable[..., _R], deadline: float, *args: object) -> _R | None:
    """Run a driver call in a thread and wait for it until ``deadline`` (monotonic); None when it has not returned
    (it goes on in its thread: a driver call cannot be interrupted)."""
    box: list[_R] = []
    th = threading.Thread(target=lambda: box.append(fn(*args)), daemon=True,
                          name="gpulease-cuda-checkpoint")
    th.start()
    th.join(max(0.0, deadline - time.monotonic()))
    return box[0] if box else None


_FIXES = {
    "CUDA_ERROR_ILLEGAL_STATE": "the process is already locked or checkpointed (another suspend?): resume it first",
    "CUDA_ERROR_OPERATING_SYSTEM": "the process is gone, or not this user's (the driver must be allowed to ptrace "
                                   "it): check that the worker still runs",
    "CUDA_ERROR_TIMEOUT": "its GPU work did not finish in time: let the running kernel finish or raise the timeout",
    "CUDA_ERROR_NOT_SUPPORTED": "the driver cannot checkpoint this process (IPC, MPS or UVM in use?): it cannot be "
                                "suspended; stop or park it instead",
    "CUDA_ERROR_NOT_INITIALIZED": "the process has not used CUDA (nothing to checkpoint) or the driver is not "
                                  "initialised",
    "CUDA_ERROR_OUT_OF_MEMORY": "host memory is short for the checkpoint: free host memory, or stop the cell "
                                "instead",
}


def _message(pid: int, call: str, err: str, fix: str | None = None) -> str:
    return f"pid {pid}: {call} failed with {err}; {fix or _FIXES.get(err, 'see the worker log and the driver log')}"


# ------------------------------------------------------------------------------------------------ the interface
def suspend(pids: list[int], timeout: float = 60.0) -> Suspended:
    """Checkpoint the GPU state of each process that uses CUDA (lock, then checkpoint), then SIGSTOP every one.

    ``timeout`` (seconds) bounds the whole: the lock waits at most what is left of it for the process's GPU work,
    and a checkpoint still running at the deadline is an error. On any error what was done is undone (restored,
    unlocked, continued) and ``SuspendError`` says which pid, which call, the CUDA error and the fix.
    """
    t0 = time.monotonic()
    deadline = t0 + timeout
    pids = list(dict.fromkeys(pids))
    drv = _driver()
    cap = capability()
    if drv is not None and not cap.cuda:
        raise SuspendError(f"cannot suspend on this host: {cap.why}")
    rss_before = {pid: _rss(pid) for pid in pids}
    cuda_pids: list[int] = []
    locked: list[int] = []
    checkpointed: list[int] = []

    def undo_and_raise(msg: str) -> None:
        undone = _undo(drv, locked, checkpointed, deadline=time.monotonic() + max(timeout, 30.0))
        raise SuspendError(msg + (f" (undoing: {undone})" if undone else ""))

    if drv is not None:
        drv.init()
        for pid in pids:
            if _proc_state(pid) in ("T", "t"):  # the driver would not answer (measured: GetState blocks on it)
                raise SuspendError(_message(pid, "cuCheckpointProcessGetState", "a stopped process",
                                            "it is stopped already (suspended?): resume it first"))
            got = _bounded(drv.state, deadline, pid)  # not RUNNING is left to the lock, which says ILLEGAL_STATE
            if got is None:
                raise SuspendError(_message(pid, "cuCheckpointProcessGetState", f"no answer within {timeout:g} s",
                                            "the driver does not answer for this process: it cannot be suspended now"))
            rc = got[0]
            if rc == CUDA_ERROR_NOT_INITIALIZED:
                continue  # never used CUDA: only stopped
            if rc != CUDA_SUCCESS:
                raise SuspendError(_message(pid, "cuCheckpointProcessGetState", drv.name(rc)))
            cuda_pids.append(pid)
        for pid in cuda_pids:
            rc_opt = _bounded(drv.lock, deadline, pid, max(0.001, deadline - time.monotonic()))
            if rc_opt is None:
                undo_and_raise(_message(pid, "cuCheckpointProcessLock", f"no answer within {timeout:g} s",
                                        "its GPU work did not finish: retry later or raise the timeout"))
            elif rc_opt != CUDA_SUCCESS:
                undo_and_raise(_message(pid, "cuCheckpointProcessLock", drv.name(rc_opt)))
            locked.append(pid)
        for pid in cuda_pids:
            rc_opt = _bounded(drv.checkpoint, deadline, pid)
            if rc_opt is None:
                raise SuspendError(_message(pid, "cuCheckpointProcessCheckpoint", f"no answer within {timeout:g} s",
                                            "it is still being checkpointed and cannot be undone now: resume it "
                                            "once it is CHECKPOINTED, or end it"))
            if rc_opt != CUDA_SUCCESS:
                undo_and_raise(_message(pid, "cuCheckpointProcessCheckpoint", drv.name(rc_opt)))
            locked.remove(pid)
            checkpointed.append(pid)
    gone = _signal(pids, signal.SIGSTOP, stopped=True)
    if gone:
        _signal([p for p in pids if p not in gone], signal.SIGCONT, stopped=False)
        undo_and_raise(_message(gone[0], "SIGSTOP", "no such process", "the worker has exited"))
    host = sum(max(0, _rss(pid) - rss_before[pid]) for pid in pids)
    return Suspended("checkpoint" if checkpointed else "stop", round(time.monotonic() - t0, 6), host,
                     tuple(checkpointed))


def _undo(drv: _Driver | None, locked: list[int], checkpointed: list[int], deadline: float) -> str:
    """Bring back what a failed suspend did: restore+unlock the checkpointed, unlock the locked. Returns what failed,
    "" when all was undone."""
    if drv is None:
        return ""
    failed = []
    for pid in checkpointed:
        rc = _bounded(drv.restore, deadline, pid, None)
        if rc != CUDA_SUCCESS:
            failed.append(f"pid {pid} restore: {'no answer' if rc is None else drv.name(rc)}")
            continue
        locked.append(pid)
    for pid in locked:
        rc = _bounded(drv.unlock, deadline, pid)
        if rc != CUDA_SUCCESS:
            failed.append(f"pid {pid} unlock: {'no answer' if rc is None else drv.name(rc)}")
    return "; ".join(failed)


def uuid_bytes(uuid: str) -> bytes:
    """The 16 bytes of a GPU UUID as NVML and CUDA_VISIBLE_DEVICES write it ("GPU-8-4-4-4-12 hex digits")."""
    text = uuid.split("-", 1)[1] if uuid[:4] in ("GPU-", "MIG-") else uuid
    digits = text.replace("-", "")
    if len(digits) != 32:
        raise ValueError(f"not a GPU UUID: {uuid!r}")
    return bytes.fromhex(digits)


def resume(pids: list[int], pairs: dict[str, str] | None = None, timeout: float = 60.0) -> float:
    """Continue suspended processes: SIGCONT, then restore each checkpointed one and unlock it. Returns seconds.

    ``pairs``: old GPU UUID -> new UUID when the process is to come back on other GPUs (of the same model); when
    any differs every pair is passed to the driver (it wants every checkpointed GPU listed), else none. Raises
    ``ResumeError`` (which pid, which call, the CUDA error) when a process cannot be brought back; after a failed
    restore its GPU state is lost (measured: every retry fails with CUDA_ERROR_OPERATING_SYSTEM).
    """
    t0 = time.monotonic()
    deadline = t0 + timeout
    pids = list(dict.fromkeys(pids))
    try:
        pair_bytes = ([(uuid_bytes(o), uuid_bytes(n)) for o, n in pairs.items()]
                      if pairs and any(o != n for o, n in pairs.items()) else None)
    except ValueError as e:
        raise ResumeError(f"resume: {e}; pass the GPUs' UUIDs as NVML reports them") from None
    gone = _signal(pids, signal.SIGCONT, stopped=False)  # first: a restore does not finish while stopped
    errors = [_message(pid, "SIGCONT", "no such process", "the worker has exited; its lease ends") for pid in gone]
    drv = _driver()
    if drv is None:
        if errors:
            raise ResumeError("; ".join(errors))
        return round(time.monotonic() - t0, 6)
    drv.init()
    for pid in pids:
        if pid in gone:
            continue
        got = _bounded(drv.state, deadline, pid)
        if got is None:
            errors.append(_message(pid, "cuCheckpointProcessGetState", f"no answer within {timeout:g} s",
                                   "the driver does not answer for this process: end it"))
            continue
        rc, state = got
        if rc == CUDA_ERROR_NOT_INITIALIZED:
            continue
        if rc != CUDA_SUCCESS:
            errors.append(_message(pid, "cuCheckpointProcessGetState", drv.name(rc)))
            continue
        if state == CHECKPOINTED:
            rc_opt = _bounded(drv.restore, deadline, pid, pair_bytes)
            if rc_opt is None:
                errors.append(_message(pid, "cuCheckpointProcessRestore", f"no answer within {timeout:g} s",
                                       "the restore goes on in the driver: check the process's state, or end it"))
                continue
            if rc_opt != CUDA_SUCCESS:
                err = drv.name(rc_opt)
                fix = ("another process holds the GPU's memory; the process's GPU state is lost (every retry fails, "
                       "measured): end it, and resume only onto free GPUs" if rc_opt == CUDA_ERROR_OUT_OF_MEMORY else
                       "the process's GPU state is lost (an earlier restore failed?): end it"
                       if rc_opt == CUDA_ERROR_OPERATING_SYSTEM else None)
                errors.append(_message(pid, "cuCheckpointProcessRestore", err, fix))
                continue
            state = LOCKED
        if state == LOCKED:
            rc_opt = _bounded(drv.unlock, deadline, pid)
            if rc_opt != CUDA_SUCCESS:
                errors.append(_message(pid, "cuCheckpointProcessUnlock",
                                       f"no answer within {timeout:g} s" if rc_opt is None else drv.name(rc_opt)))
    if errors:
        raise ResumeError("; ".join(errors))
    return round(time.monotonic() - t0, 6)
