"""The checkpoint's host memory, faulted in ahead: what brings suspending 10 GiB from 5.7 s to about 2 s (issue 33).

Measured on an H200 with driver 580 (docs/gpu-checks.md, "Where a checkpoint's time goes"): ``cuCheckpointProcess
Checkpoint`` is one thread inside the target copying the process's GPU memory into one new anonymous mapping of the
footprint's size. That thread is busy the whole time (5.51 of 5.53 s for 11.8 GB, 2.1 GB/s); on the same machine
one CPU thread copies 3.6 GB/s into fresh pages and 10.1 GB/s into pages already faulted in. The copy's floor is
the page faults. The driver takes no buffer from its caller (CUDA 13.4's custom storage would; driver 580 lacks it),
so ``ckpt_pool.c``, preloaded into the worker (``LD_PRELOAD``), hands the driver's next large anonymous mapping a
region the worker faulted in beforehand (huge pages advised). Same child, same runs, two machines: suspend
5.0-5.8 s -> 1.84-2.28 s, resume 2.3 s -> 1.49-2.18 s; faulting in the region took 1.6-2.0 s, ahead
(``BENCHMARKS.md``, gpu_device).

Who does what:
- ``preload_env(env)`` (the local executor, when it starts a worker on a host that can checkpoint): the library in
  ``LD_PRELOAD``. It is built once per user from ``ckpt_pool.c`` with the host's C compiler into a private cache
  directory (``~/.cache/jupyter-gpulease``, 0700, checked). No compiler, or ``GPULEASE_CKPT_POOL=0``: no pool, and
  suspending works as before, only slower. Every other ``mmap`` of the worker passes through unchanged.
- ``gpu_footprint(pids)`` (the kernel): the processes' GPU memory as NVML reports it, the size of the driver's copy.
- ``prepare(nbytes)`` / ``drop()`` (the worker, on the kernel's ``ckpt_pool`` job): fault the region in, or give it
  back. The kernel asks when a session is warned that it will be suspended for idleness, and before a suspension
  of an idle session that was not prepared; the worker drops an unused region when its next job comes.

The region is the worker's own anonymous memory, like the checkpoint it becomes: nothing is written to disk.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
import time
from pathlib import Path
from typing import Any

SOURCE = Path(__file__).with_name("ckpt_pool.c")
#: added to the measured footprint: the driver's mapping was 4.8 MB over NVML's figure for 11.8 GB (H200)
MARGIN = 512 << 20


def _cache_dir() -> Path:
    from gpulease_protocol.private import private_dir

    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    root.mkdir(parents=True, exist_ok=True)
    return Path(private_dir(str(root / "jupyter-gpulease")))


#: one build at a time in a process: a kernel's first workers (the warm pool's, a session's) start together, and
#: each build writes the same temporary file (the loser's worker started without the library)
_BUILD = threading.Lock()


@functools.lru_cache(maxsize=1)
def library() -> tuple[str | None, str]:
    """(path of the built library, '') or (None, why not). Built once per user and source version; asked once per
    kernel (a worker's start pays nothing after the first)."""
    if os.environ.get("GPULEASE_CKPT_POOL", "1") == "0":
        return None, "GPULEASE_CKPT_POOL=0"
    with _BUILD:  # a second asker finds the first one's build
        return _built()


def _built() -> tuple[str | None, str]:
    import hashlib
    import shutil
    import subprocess

    from gpulease_protocol.private import UnsafePathError, open_private

    try:
        source = SOURCE.read_bytes()
        out = _cache_dir() / f"libgpulease_ckpt_pool-{hashlib.sha256(source).hexdigest()[:16]}.so"
        try:
            os.close(open_private(str(out)))  # the user's own, written by nobody else: safe to preload
            return str(out), ""
        except FileNotFoundError:
            pass
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if not cc:
            return None, "no C compiler (cc) to build the checkpoint pool library"
        tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")  # in the private directory: nobody else reaches it
        try:
            subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(tmp), str(SOURCE), "-ldl"], check=True,
                           capture_output=True, timeout=60)
            os.chmod(tmp, 0o700)
            os.replace(tmp, out)
        finally:
            if tmp.exists():
                tmp.unlink()
        return str(out), ""
    except (OSError, UnsafePathError, subprocess.SubprocessError) as e:
        return None, f"the checkpoint pool library could not be built: {e}"


def preload_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the library in ``LD_PRELOAD`` when this host can checkpoint CUDA processes and it builds."""
    from .suspend import capability

    if not capability().cuda:
        return env
    path, _ = library()
    if path:
        env["LD_PRELOAD"] = " ".join(p for p in (path, env.get("LD_PRELOAD", "")) if p)
    return env


def gpu_footprint(pids: list[int]) -> int:
    """Bytes of GPU memory the processes hold, summed over the GPUs (NVML); 0 where NVML cannot say."""
    try:
        import pynvml
    except ImportError:
        return 0
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return 0
    total = 0
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if p.pid in pids and p.usedGpuMemory:
                    total += int(p.usedGpuMemory)
    except pynvml.NVMLError:
        return 0
    finally:
        pynvml.nvmlShutdown()
    return total


def _loaded() -> Any:
    """This process's handle on the preloaded library, or None (not preloaded)."""
    lib = ctypes.CDLL(None, use_errno=True)
    if not hasattr(lib, "gpulease_pool_prepare"):
        return None
    lib.gpulease_pool_prepare.argtypes = [ctypes.c_size_t]
    lib.gpulease_pool_prepare.restype = ctypes.c_int
    lib.gpulease_pool_handed.restype = ctypes.c_long
    lib.gpulease_pool_region.argtypes = [ctypes.POINTER(ctypes.c_size_t)]
    lib.gpulease_pool_region.restype = ctypes.c_void_p
    return lib


def prepare(nbytes: int) -> dict[str, Any]:
    """Fault in ``nbytes`` for the driver's next checkpoint (the worker, on the kernel's ``ckpt_pool`` job)."""
    lib = _loaded()
    if lib is None:
        return {"ok": False, "why": "the checkpoint pool library is not preloaded in this worker"}
    available = _mem_available()
    if available is not None and nbytes > available:
        return {"ok": False, "why": f"host memory is short: {nbytes} bytes wanted, {available} available"}
    t = time.monotonic()
    if lib.gpulease_pool_prepare(int(nbytes)) != 0:
        return {"ok": False, "why": f"could not map {nbytes} bytes: {os.strerror(ctypes.get_errno()) or 'no memory'}"}
    return {"ok": True, "bytes": int(nbytes), "seconds": round(time.monotonic() - t, 3)}


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def drop() -> None:
    """Give back a region the driver did not take (the worker, before its next job; nothing when there is none)."""
    lib = _loaded()
    if lib is not None:
        lib.gpulease_pool_drop()


def handed() -> int:
    """How many of the driver's mappings a prepared region served in this process (the tests, the device check)."""
    lib = _loaded()
    return int(lib.gpulease_pool_handed()) if lib is not None else 0


def region() -> tuple[int, int]:
    """(address, length) of the prepared region the driver has not taken yet, or (0, 0) (the device check's
    variants register it with the driver before a checkpoint, to measure whether the driver then copies into it
    directly)."""
    lib = _loaded()
    if lib is None:
        return 0, 0
    n = ctypes.c_size_t(0)
    return int(lib.gpulease_pool_region(ctypes.byref(n)) or 0), int(n.value)
