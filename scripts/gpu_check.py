"""The checks that need a real NVIDIA GPU, in one bounded run (``make gpu-check``; issue 33, item 7).

Run it with the machine's own ``python3`` (the one that has PyTorch with CUDA), from the repository root:

    PYTHONUNBUFFERED=1 python3 scripts/gpu_check.py [--out DIR]      # DIR defaults to $OUT, else /tmp/gpulease-gpu-check

It does, each step bounded by a timeout (the whole run ends in under 5 minutes):

1. **Real-NVML contract tests**: ``tests/broker/inventory/test_inventory_contract.py -k nvml-real`` (the tests skipped
   for want of a GPU elsewhere), with the project's pure-Python dependencies the machine lacks (tornado, traitlets)
   installed from ``.whl/`` when present (see /work/.library/device/README.md); and a real broker on the NVML
   inventory granting and releasing a lease on the GPU.
2. **The CUDA driver's checkpoint API** (``cuCheckpointProcessLock/Checkpoint/Restore/Unlock/GetState`` through
   ``ctypes`` on ``libcuda.so.1``): a child process holds ~10 GiB of random torch tensors (seeded, so the exact bits
   can be regenerated and compared) and a captured CUDA graph; this process locks and checkpoints it (timed), stops
   it (SIGSTOP), shows through NVML that its memory is free and lets another process allocate most of the GPU,
   continues it (SIGCONT), restores and unlocks it (timed); the child checks its tensors are bit-identical and its
   graph replays to the same bits. Then: the same with a busy child, the restore given an explicit same-GPU UUID
   pair and tried while the child is still stopped; a restore tried while another process holds the GPU's memory;
   calls made out of order (the error codes a fake libcuda must copy); and the baseline, in the same child: the
   same tensors copied to host memory (pageable and pinned), pickled (cloudpickle, as parking does) and saved
   (torch.save to /dev/shm), and back.
3. **An idle ``--session`` end to end** (``scripts/gpu_check_session.py``): a broker on the NVML inventory, a real
   kernel, the session suspended for idleness and resumed by its next cell with its tensors, graph, generator and lock.
4. **Where a checkpoint's time goes** (``--anatomy``) and the designs against the 2 s bar (``--variant``): huge pages,
   and the driver's mapping served from a region faulted in ahead (``worker/ckpt_pool``, preloaded as the local
   executor does), and that region registered with the driver first (``--variant pool_pinned``, not yet run: does
   the checkpoint then copy into it by DMA?); whether the driver has CUDA 13.4's custom storage.
5. Everything measured goes into one JSON file, ``gpu_check.json``, in the output folder, with the logs beside it.

Why ctypes and not NVIDIA's ``cuda-bindings``: the checkpoint calls are six C functions taking a pid and a 64-byte
struct, so ctypes needs no package on the worker hosts (whose Python is the user's kernel environment, not ours), is
independent of the bindings' version matching the driver's, and loads whatever ``libcuda.so.1`` the loader finds, so
CI can substitute a fake library exporting the same entry points (as the NVML tests do with libnvidia-ml). The script
records whether ``cuda-bindings`` on the machine exposes the same calls, for comparison.

Exit status: 0 when every check that ran passed, or when there is no NVIDIA GPU here (it says so); 1 otherwise.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import faulthandler
import glob
import json
import os
import platform
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from jupyter_gpulease.worker import ckpt_pool as POOL  # noqa: E402  (its region faulted in ahead)
from jupyter_gpulease.worker import suspend as SUS  # noqa: E402  (the shipped mechanism; pure stdlib)

GIB = 1 << 30
DEADLINE_S = 290.0  # the whole run: a watchdog writes the JSON and ends it after this (issue 33: under 5 minutes)
T0 = time.monotonic()

# ------------------------------------------------------------------------------------------------ the record
RESULT: dict[str, Any] = {"errors": []}
OUT_DIR = Path("/tmp/gpulease-gpu-check")
_LOG: Any = None
_CHILDREN: list[subprocess.Popen[Any]] = []  # every process this script started, ended by pid at exit


def elapsed() -> float:
    return round(time.monotonic() - T0, 3)


def log(msg: str) -> None:
    line = f"[{elapsed():7.1f}s] {msg}"
    print(line, flush=True)
    if _LOG is not None:
        _LOG.write(line + "\n")
        _LOG.flush()


def save() -> None:
    RESULT["elapsed_s"] = elapsed()
    tmp = OUT_DIR / "gpu_check.json.tmp"
    tmp.write_text(json.dumps(RESULT, indent=2, default=str))
    os.replace(tmp, OUT_DIR / "gpu_check.json")


def error(where: str, exc: BaseException | str) -> None:
    text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    RESULT["errors"].append({"where": where, "error": text, "at_s": elapsed()})
    log(f"ERROR in {where}: {text}")
    if not isinstance(exc, str):
        tb = traceback.format_exc()
        if "NoneType: None" not in tb:
            RESULT["errors"][-1]["traceback"] = tb[-3000:]
    save()


def left() -> float:
    return DEADLINE_S - (time.monotonic() - T0)


def sh(cmd: list[str], timeout: float = 30) -> dict[str, Any]:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return {"rc": r.returncode, "stdout": r.stdout[-4000:], "stderr": r.stderr[-2000:]}
    except Exception as e:  # missing program, timeout
        return {"rc": None, "error": f"{type(e).__name__}: {e}"}


def proc_state(pid: int) -> str:
    """The kernel's state letter of a process (R, S, T = stopped, Z, ...)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def vm_rss(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# ------------------------------------------------------------------------------------------------ environment
def install_wheels() -> dict[str, Any]:
    """The project's pure-Python dependencies this Python lacks, from .whl/ (carried to the device machine)."""
    missing = []
    for mod in ("tornado", "traitlets", "prometheus_client", "pynvml", "IPython", "ipykernel", "jupyter_client",
                "zmq", "ipywidgets"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    info: dict[str, Any] = {"missing_before": missing, "wheels": sorted(p.name for p in (ROOT / ".whl").glob("*.whl"))}
    site = Path(tempfile.gettempdir()) / "gpulease-site"
    if missing and info["wheels"]:
        r = sh([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, (ROOT / ".whl").glob("*.whl"))],
               timeout=120)
        info["pip"] = r
    info["entry_points"] = register_entry_points(site)
    if site.is_dir():
        sys.path.insert(0, str(site))
    paths = [str(site), str(ROOT), str(ROOT / "tests")]
    os.environ["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [os.environ.get("PYTHONPATH")])])
    still = []
    for mod in missing:
        try:
            __import__(mod)
        except ImportError:
            still.append(mod)
    info["missing_after"] = still
    return info


def register_entry_points(site: Path) -> list[str]:
    """The broker and the kernel pick inventories and executors by entry point (pyproject.toml); this checkout is
    not installed on the device, so a minimal dist-info in ``site`` declares the same entry points for the modules
    PYTHONPATH finds in the checkout. Returns the groups declared."""
    import tomllib

    groups = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    dist = site / "jupyter_gpulease_checkout-0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: jupyter-gpulease-checkout\nVersion: 0\n")
    (dist / "entry_points.txt").write_text("".join(
        f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n" for g, eps in groups.items()))
    return sorted(groups)


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": sys.version.split()[0], "python_executable": sys.executable,
        "kernel": platform.release(), "machine": platform.machine(), "cpus": os.cpu_count(),
        "host_mem_available": mem_available(),
    }
    q = sh(["nvidia-smi", "--query-gpu=name,uuid,driver_version,memory.total,memory.used,persistence_mode,"
            "compute_mode", "--format=csv,noheader"])
    env["nvidia_smi"] = q.get("stdout", "").strip() or q
    r = sh([sys.executable, "-c", "import torch,json;print(json.dumps({'torch':torch.__version__,"
            "'cuda':torch.version.cuda,'available':torch.cuda.is_available(),"
            "'name':torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}))"], timeout=90)
    try:
        env["torch"] = json.loads(r["stdout"].strip().splitlines()[-1])
    except Exception:
        env["torch"] = r
    env["dev_shm_free"] = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else None
    return env


def gpu_present() -> str | None:
    """Why there is no NVIDIA GPU to check here, or None."""
    if os.environ.get("GPU_CHECK_FORCE"):
        return None
    if not (os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/nvidiactl")):
        return "no NVIDIA driver or GPU on this machine"
    if not shutil.which("nvidia-smi") and not os.path.exists("/dev/nvidia0"):
        return "no NVIDIA GPU device"
    return None


# ------------------------------------------------------------------------------------------------ NVML
class Nvml:
    """What NVML says about the GPU and its processes (pynvml when importable, else nvidia-smi)."""

    def __init__(self) -> None:
        self.ok = False
        self.why = ""
        try:
            import pynvml

            self.nv = pynvml
            pynvml.nvmlInit()
            self.h = pynvml.nvmlDeviceGetHandleByIndex(0)
            self.ok = True
        except Exception as e:
            self.why = f"{type(e).__name__}: {e}"

    def snapshot(self) -> dict[str, Any]:
        s: dict[str, Any] = {"via": "pynvml" if self.ok else "nvidia-smi"}
        if self.ok:
            nv = self.nv
            try:
                m = nv.nvmlDeviceGetMemoryInfo(self.h)
                s.update(used=int(m.used), total=int(m.total), free=int(m.free))
                procs = nv.nvmlDeviceGetComputeRunningProcesses(self.h)
                s["processes"] = [{"pid": int(p.pid), "used": None if p.usedGpuMemory is None else int(p.usedGpuMemory)}
                                  for p in procs]
            except Exception as e:
                s["error"] = f"{type(e).__name__}: {e}"
            return s
        q = sh(["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits"])
        a = sh(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"])
        try:
            used, total = (int(x) << 20 for x in q["stdout"].split(","))
            s.update(used=used, total=total, free=total - used)
            s["processes"] = [{"pid": int(p), "used": int(u) << 20} for p, u in
                              (line.split(",") for line in a["stdout"].strip().splitlines() if line.strip())]
        except Exception as e:
            s["error"] = f"{type(e).__name__}: {e} ({q}, {a})"
        return s

    def info(self) -> dict[str, Any]:
        if not self.ok:
            return {"error": self.why}
        nv = self.nv

        def txt(v: Any) -> str:
            return v.decode() if isinstance(v, bytes) else str(v)

        d: dict[str, Any] = {}
        for key, fn in [("name", lambda: txt(nv.nvmlDeviceGetName(self.h))),
                        ("uuid", lambda: txt(nv.nvmlDeviceGetUUID(self.h))),
                        ("driver", lambda: txt(nv.nvmlSystemGetDriverVersion())),
                        ("cuda_driver_version", lambda: nv.nvmlSystemGetCudaDriverVersion()),
                        ("count", lambda: nv.nvmlDeviceGetCount()),
                        ("persistence_mode", lambda: nv.nvmlDeviceGetPersistenceMode(self.h)),
                        ("memory_total", lambda: int(nv.nvmlDeviceGetMemoryInfo(self.h).total))]:
            try:
                d[key] = fn()
            except Exception as e:
                d[key] = f"error: {type(e).__name__}: {e}"
        return d


# ------------------------------------------------------------------------------------------------ libcuda (ctypes)
# Every checkpoint call goes through the shipped module (jupyter_gpulease/worker/suspend.py): the cycles through its
# suspend() / resume(), the probes and single timed steps through its driver (its ctypes structs and calls), so this
# check exercises the code a kernel runs.
CU_STATES = SUS.STATE_NAMES


class Cuda:
    """The raw calls, for probes and timed single steps: the shipped module's ``_Driver`` (``$GPULEASE_LIBCUDA``, or
    ``GPU_CHECK_LIBCUDA`` as before, names another library)."""

    def __init__(self) -> None:
        if os.environ.get("GPU_CHECK_LIBCUDA"):
            os.environ["GPULEASE_LIBCUDA"] = os.environ["GPU_CHECK_LIBCUDA"]
        drv = SUS._driver()
        if drv is None:
            raise OSError(f"{SUS._library_path()} does not load")
        self.drv, self.path, self.lib = drv, drv.path, drv.lib
        c_int = ctypes.c_int
        for name, args in {"cuDeviceGet": [ctypes.POINTER(c_int), c_int],
                           "cuDeviceGetUuid_v2": [ctypes.c_void_p, c_int],
                           "cuDeviceGetUuid": [ctypes.c_void_p, c_int]}.items():
            if hasattr(self.lib, name):
                f = getattr(self.lib, name)
                f.argtypes, f.restype = args, c_int
        self.missing = [n for n in ("cuInit", "cuDriverGetVersion", "cuGetErrorName", "cuDeviceGet",
                                    "cuCheckpointProcessGetRestoreThreadId", *SUS._CHECKPOINT_CALLS)
                        if not hasattr(self.lib, n)]
        self.uuid: bytes | None = None

    def errname(self, rc: int | None) -> str | None:
        return None if rc is None else self.drv.name(rc)

    def init(self) -> dict[str, Any]:
        rc = self.drv.init()
        cap = SUS.capability()
        d: dict[str, Any] = {"library": self.path, "cuInit": self.errname(rc), "cuDriverGetVersion": self.drv.version(),
                             "missing_entry_points": self.missing,
                             "capability": {"cuda": cap.cuda, "driver_version": cap.driver_version, "why": cap.why,
                                            "suspendable": cap.suspendable,
                                            "min_driver_version": SUS.MIN_DRIVER_VERSION}}
        dev = ctypes.c_int()
        if rc == 0 and hasattr(self.lib, "cuDeviceGet") and self.lib.cuDeviceGet(ctypes.byref(dev), 0) == 0:
            buf = (ctypes.c_ubyte * 16)()
            get = getattr(self.lib, "cuDeviceGetUuid_v2", None) or getattr(self.lib, "cuDeviceGetUuid", None)
            if get is not None and get(ctypes.byref(buf), dev.value) == 0:
                self.uuid = bytes(buf)
                h = self.uuid.hex()
                d["device0_uuid"] = f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
        return d

    def state(self, pid: int) -> dict[str, Any]:
        rc, s = self.drv.state(pid)
        return {"rc": self.errname(rc), "state": CU_STATES.get(s, s) if rc == 0 else None}

    def restore_tid(self, pid: int) -> dict[str, Any]:
        if not hasattr(self.lib, "cuCheckpointProcessGetRestoreThreadId"):
            return {"rc": "missing"}
        t = ctypes.c_int(-1)
        rc = self.lib.cuCheckpointProcessGetRestoreThreadId(pid, ctypes.byref(t))
        return {"rc": self.errname(rc), "tid": t.value if rc == 0 else None}

    def call(self, what: str, pid: int, timeout: float, **kw: Any) -> dict[str, Any]:
        """One checkpoint call in a thread, bounded: {rc, seconds} or {timeout: True, thread} when it hangs."""
        steps: dict[str, Any] = {"lock": lambda: self.drv.lock(pid, kw.get("timeout_ms", 20000) / 1000),
                                 "checkpoint": lambda: self.drv.checkpoint(pid),
                                 "restore": lambda: self.drv.restore(pid, kw.get("pairs")),
                                 "unlock": lambda: self.drv.unlock(pid)}
        f = steps[what]
        box: dict[str, Any] = {}

        def run() -> None:
            t = time.perf_counter()
            box["rc"] = f()
            box["seconds"] = round(time.perf_counter() - t, 4)

        th = threading.Thread(target=run, daemon=True, name=f"cu-{what}")
        th.start()
        th.join(timeout)
        if th.is_alive():
            return {"call": what, "timeout": True, "bound_s": timeout, "thread": th, "box": box}
        return {"call": what, "rc": self.errname(box["rc"]), "ok": box["rc"] == 0, "seconds": box["seconds"]}


def custom_storage(cu: Cuda) -> dict[str, Any]:
    """Whether the driver has the checkpoint's custom storage (CUDA 13.4, driver API 13040: the checkpoint maps the
    target's GPU memory into the caller, which copies it where it likes, e.g. into pinned host memory at the copy
    engines' speed, then calls cuCheckpointOperationComplete). The one design measured so far that would move 10 GiB
    each way in under 2 s; the driver's own copy runs at pageable-memory speed (docs/gpu-checks.md)."""
    res: dict[str, Any] = {"dlsym": hasattr(cu.lib, "cuCheckpointOperationComplete")}
    f = getattr(cu.lib, "cuGetProcAddress_v2", None)
    if f is not None:
        f.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64,
                      ctypes.POINTER(ctypes.c_int)]
        f.restype = ctypes.c_int
        sym, status = ctypes.c_void_p(), ctypes.c_int(-1)
        rc = f(b"cuCheckpointOperationComplete", ctypes.byref(sym), 13040, 0, ctypes.byref(status))
        # status: 0 found, 1 no such symbol, 2 the driver's version is too old for it
        res["cuGetProcAddress_v2_13040"] = {"rc": cu.errname(rc), "status": status.value, "found": bool(sym.value)}
    res["available"] = bool(res["dlsym"] or (res.get("cuGetProcAddress_v2_13040") or {}).get("found"))
    return res


def header_facts() -> dict[str, Any]:
    """The checkpoint structs and prototypes as this machine's cuda.h declares them, and their sizes (compiled)."""
    cands = [*glob.glob("/usr/local/cuda*/include/cuda.h"), *glob.glob("/usr/local/cuda*/targets/*/include/cuda.h"),
             *glob.glob(os.path.join(sys.prefix, "lib", "python3*", "site-packages", "nvidia", "*", "include", "cuda.h")),
             *glob.glob(os.path.join(sys.prefix, "lib", "python3*", "site-packages", "nvidia", "cu*", "include",
                                     "cuda.h"))]
    d: dict[str, Any] = {"ctypes_sizes": {c.__name__.lstrip("_"): ctypes.sizeof(c) for c in
                                          (SUS._LockArgs, SUS._CheckpointArgs, SUS._GpuPair,
                                                                   SUS._RestoreArgs, SUS._UnlockArgs)},
                         "ctypes_offset_gpuPairsCount": SUS._RestoreArgs.gpuPairsCount.offset}
    if not cands:
        d["cuda_h"] = None
        return d
    h = cands[0]
    d["cuda_h"] = h
    text = Path(h).read_text(errors="replace")
    d["structs"] = re.findall(r"typedef struct CUcheckpoint\w*_st \{.*?\} \w+;", text, re.S)
    d["prototypes"] = re.findall(r"CUresult CUDAAPI cuCheckpointProcess\w+\([^;]*\);", text)
    m = re.search(r"typedef enum CUprocessState_enum \{.*?\}", text, re.S)
    d["states_enum"] = m.group(0) if m else None
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc:
        src = Path(tempfile.mkdtemp(prefix="glh")) / "sz.c"
        src.write_text('#include <stdio.h>\n#include <stddef.h>\n#include "cuda.h"\nint main(void){'
                       'printf("%zu %zu %zu %zu %zu %zu %zu\\n", sizeof(CUcheckpointLockArgs), '
                       'sizeof(CUcheckpointCheckpointArgs), sizeof(CUcheckpointGpuPair), '
                       'sizeof(CUcheckpointRestoreArgs), sizeof(CUcheckpointUnlockArgs), '
                       'offsetof(CUcheckpointRestoreArgs, gpuPairsCount), offsetof(CUcheckpointLockArgs, timeoutMs));'
                       'return 0;}\n')
        exe = src.with_suffix("")
        r = sh([cc, "-I", str(Path(h).parent), "-o", str(exe), str(src)], timeout=60)
        if r.get("rc") == 0:
            out = sh([str(exe)])["stdout"].split()
            d["c_sizes"] = dict(zip(["LockArgs", "CheckpointArgs", "GpuPair", "RestoreArgs", "UnlockArgs",
                                     "offset_gpuPairsCount", "offset_timeoutMs"], map(int, out), strict=False))
        else:
            d["c_sizes"] = r
    return d


def cuda_bindings_facts() -> dict[str, Any]:
    code = ("import json\nd={}\ntry:\n import cuda.bindings, cuda.bindings.driver as drv\n"
            " d['version']=getattr(cuda.bindings,'__version__',None)\n"
            " d['has']={n:hasattr(drv,n) for n in ['cuCheckpointProcessLock','cuCheckpointProcessCheckpoint',"
            "'cuCheckpointProcessRestore','cuCheckpointProcessUnlock','cuCheckpointProcessGetState',"
            "'cuCheckpointProcessGetRestoreThreadId','CUcheckpointGpuPair']}\n"
            "except Exception as e:\n d['error']=repr(e)\nprint(json.dumps(d))")
    r = sh([sys.executable, "-c", code], timeout=60)
    try:
        return json.loads(r["stdout"].strip().splitlines()[-1])
    except Exception:
        return r


# ------------------------------------------------------------------------------------------------ child processes
class Child:
    """A process of this script in --child or --hog mode, spoken to by lines: '@@{json}' answers on stdout."""

    def __init__(self, args: list[str], name: str, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.err = open(OUT_DIR / "children.stderr", "ab")
        self.err.write(f"---- {name} ----\n".encode())
        self.err.flush()
        self.proc = subprocess.Popen([sys.executable, "-u", str(Path(__file__).resolve()), *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True,
                                     bufsize=1, env={**os.environ, **(env or {})})
        _CHILDREN.append(self.proc)
        self.pid = self.proc.pid
        self.q: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@"):
                try:
                    self.q.put(json.loads(line[2:]))
                except ValueError:
                    pass
        self.q.put(None)

    def read(self, timeout: float) -> dict[str, Any]:
        try:
            msg = self.q.get(timeout=max(1.0, min(timeout, left())))
        except queue.Empty:
            return {"error": f"{self.name}: no answer within {timeout:.0f} s"}
        if msg is None:
            return {"error": f"{self.name} exited with {self.proc.wait(5)}"}
        return msg

    def ask(self, cmd: str, timeout: float) -> dict[str, Any]:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(cmd + "\n")
            self.proc.stdin.flush()
        except OSError as e:
            return {"error": f"{self.name}: {e}"}
        return self.read(timeout)

    def end(self) -> None:
        if self.proc.poll() is None:
            try:
                os.kill(self.pid, signal.SIGCONT)
                self.proc.kill()
                self.proc.wait(20)
            except Exception:
                pass


def child_main(n_tensors: int, tensor_mib: int) -> None:
    """The process that is checkpointed: tensors of seeded random numbers and a captured CUDA graph."""
    import torch

    def say(obj: dict[str, Any]) -> None:
        sys.stdout.write("@@" + json.dumps(obj, default=str) + "\n")
        sys.stdout.flush()

    dev = os.environ.get("GPU_CHECK_DEVICE", "cuda")
    cuda = dev == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    per = (tensor_mib << 20) // 4  # float32 elements per tensor

    def make(i: int) -> Any:
        g = torch.Generator(device=dev)
        g.manual_seed(1000 + i)
        return torch.randn(per, device=dev, generator=g)

    def checksum(t: Any) -> int:
        return int(t.view(torch.int32).sum(dtype=torch.int64).item())

    t = time.perf_counter()
    tensors = [make(i) for i in range(n_tensors)]
    sync()
    alloc_s = time.perf_counter() - t
    sums = [checksum(x) for x in tensors]
    reserved_untrimmed = torch.cuda.memory_reserved() if cuda else None
    if cuda:  # the checksums' temporaries, which the graph's tensors would otherwise split and keep: the footprint
        torch.cuda.empty_cache()  # is the tensors, the graph and the context (runs before 2026-11-27 kept ~2 GB more)

    # a captured CUDA graph over its own static input (two inputs, their outputs kept as references)
    graph = None
    g = torch.Generator(device=dev)
    g.manual_seed(7)
    n = 2048
    x1, x2, w = (torch.randn(n, n, device=dev, generator=g) for _ in range(3))
    static_x = x1.clone()

    def f(x: Any) -> Any:
        return torch.tanh(x @ w) * 0.5 + x

    if cuda:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                f(static_x)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = f(static_x)
    else:
        static_y = f(static_x)

    def replay(x: Any) -> Any:
        nonlocal static_y
        static_x.copy_(x)
        if graph is not None:
            graph.replay()
        else:
            static_y = f(static_x)
        sync()
        return static_y.clone()

    ref1, ref2 = replay(x1), replay(x2)
    graph_vs_eager = float((ref1 - f(x1)).abs().max().item())

    def verify() -> dict[str, Any]:
        t = time.perf_counter()
        torch.ones(1, device=dev).add_(1)
        sync()
        first = time.perf_counter() - t
        t = time.perf_counter()
        bad = [i for i, x in enumerate(tensors) if not torch.equal(x, make(i))]
        now = [checksum(x) for x in tensors]
        g1, g2 = replay(x1), replay(x2)
        if cuda:
            torch.cuda.empty_cache()  # the regenerated copies: keep the footprint the same for the next cycle
        return {"first_cuda_op_s": round(first, 4), "tensors": len(tensors), "tensors_bit_identical": not bad,
                "tensors_differing": bad, "checksums_equal": now == sums,
                "graph_replay_input1_bit_identical": bool(torch.equal(g1, ref1)),
                "graph_replay_input2_bit_identical": bool(torch.equal(g2, ref2)),
                "graph_captured": graph is not None, "verify_s": round(time.perf_counter() - t, 3),
                **({"memory_allocated": torch.cuda.memory_allocated(), "memory_reserved": torch.cuda.memory_reserved()}
                   if cuda else {})}

    busy: dict[str, Any] = {}

    def busy_loop() -> None:
        a = torch.randn(4096, 4096, device=dev)
        b = torch.randn(4096, 4096, device=dev)
        ref = a @ b
        sync()
        stamps, ok = [time.monotonic()], True
        while not busy["stop"].is_set():
            c = a @ b
            ok = ok and bool(torch.equal(c, ref))  # syncs
            stamps.append(time.monotonic())
        gaps = [b_ - a_ for a_, b_ in zip(stamps, stamps[1:], strict=False)] or [0.0]
        busy["result"] = {"iterations": len(stamps) - 1, "all_results_equal": ok,
                          "max_gap_s": round(max(gaps), 3), "median_gap_s": round(sorted(gaps)[len(gaps) // 2], 5)}

    def baseline(budget: float) -> dict[str, Any]:
        """The same tensors moved to host memory and back by the means a parking would use."""
        res: dict[str, Any] = {"bytes": sum(x.numel() * 4 for x in tensors)}
        start = time.monotonic()

        def over() -> bool:
            return time.monotonic() - start > budget

        def drop() -> None:
            tensors.clear()
            if cuda:
                torch.cuda.empty_cache()

        def check(name: str) -> None:
            res[name]["bit_identical"] = all(torch.equal(x, make(i)) for i, x in enumerate(tensors))

        def cpu_copy() -> dict[str, Any]:
            """plain copies to pageable host memory (x.cpu()) and back"""
            sync()
            t = time.perf_counter()
            host = [x.cpu() for x in tensors]
            to_host = time.perf_counter() - t
            drop()
            t = time.perf_counter()
            tensors.extend(h.to(dev) for h in host)
            sync()
            return {"to_host_s": round(to_host, 3), "to_gpu_s": round(time.perf_counter() - t, 3)}

        def pinned_copy() -> dict[str, Any]:
            """into pinned host buffers and back: the copy engines' speed, what a checkpoint could at best reach"""
            t = time.perf_counter()
            pinned = [torch.empty(per, dtype=torch.float32, pin_memory=True) for _ in tensors]
            pin_alloc = time.perf_counter() - t
            t = time.perf_counter()
            for p, x in zip(pinned, tensors, strict=True):
                p.copy_(x, non_blocking=True)
            sync()
            to_host = time.perf_counter() - t
            t = time.perf_counter()
            for p, x in zip(pinned, tensors, strict=True):
                x.copy_(p, non_blocking=True)
            sync()
            return {"pin_alloc_s": round(pin_alloc, 3), "to_host_s": round(to_host, 3),
                    "to_gpu_s": round(time.perf_counter() - t, 3)}

        def pickled() -> dict[str, Any]:
            """cloudpickle in memory, as the project's session parking does"""
            try:
                import cloudpickle as pk  # type: ignore[import-not-found]
            except ImportError:
                import pickle as pk  # type: ignore[no-redef]
            sync()
            t = time.perf_counter()
            blob = pk.dumps(list(tensors), protocol=5)
            dumps = time.perf_counter() - t
            drop()
            t = time.perf_counter()
            tensors.extend(pk.loads(blob))
            sync()
            return {"module": pk.__name__, "dumps_s": round(dumps, 3), "loads_s": round(time.perf_counter() - t, 3),
                    "blob_bytes": len(blob)}

        def saved() -> dict[str, Any]:
            """torch.save to a file in /dev/shm (host memory) and torch.load back onto the GPU"""
            where = "/dev/shm" if shutil.disk_usage("/dev/shm").free > res["bytes"] * 1.2 else tempfile.gettempdir()
            path = os.path.join(where, f"gpulease-check-{os.getpid()}.pt")
            try:
                sync()
                t = time.perf_counter()
                torch.save(list(tensors), path)
                save_s = time.perf_counter() - t
                drop()
                t = time.perf_counter()
                tensors.extend(torch.load(path, map_location=dev))
                sync()
                return {"dir": where, "save_s": round(save_s, 3), "load_s": round(time.perf_counter() - t, 3)}
            finally:
                if os.path.exists(path):
                    os.unlink(path)

        for name, step in [("cpu_copy", cpu_copy), ("pinned_copy", pinned_copy), ("cloudpickle", pickled),
                           ("torch_save", saved)]:
            if over() or (name == "pinned_copy" and not cuda):
                continue
            try:
                res[name] = step()
                check(name)
            except Exception as e:
                res[name] = {"error": f"{type(e).__name__}: {e}"}
            if len(tensors) != n_tensors:  # a step failed half-way: the same bits again, from the seeds
                drop()
                tensors.extend(make(i) for i in range(n_tensors))
            if cuda:
                torch.cuda.empty_cache()
        res["skipped_for_time"] = over()
        return res

    pinned: dict[str, int] = {}

    def cu_call(name: str, *args: Any) -> int:
        lib = ctypes.CDLL(os.environ.get("GPULEASE_LIBCUDA") or "libcuda.so.1")
        return int(getattr(lib, name)(*args))

    def pin_region() -> dict[str, Any]:
        # if the driver's checkpoint copies through its ordinary device-to-host path, a destination it knows to be
        # page-locked is written by DMA (55 GB/s measured for pinned copies) instead of staged through one CPU
        # thread (5-6 GB/s into the faulted-in region): the one idea left for driver 580 (issue 33)
        addr, length = POOL.region()
        if not addr:
            return {"pinned": False, "why": "no prepared region"}
        t = time.monotonic()
        rc = cu_call("cuMemHostRegister_v2", ctypes.c_void_p(addr), ctypes.c_size_t(length), ctypes.c_uint(0))
        if rc == 0:
            pinned.update(addr=addr, length=length)
        return {"pinned": rc == 0, "rc": rc, "bytes": length, "seconds": round(time.monotonic() - t, 3)}

    def unpin_region() -> dict[str, Any]:
        # after a restore the driver has unmapped the region it was handed: the registration may be gone with it,
        # or be left over a hole (the answer says which; a child with one left over is not used for more steps)
        if not pinned:
            return {"unpinned": None}
        rc = cu_call("cuMemHostUnregister", ctypes.c_void_p(pinned.pop("addr")))
        pinned.clear()
        return {"unpinned": rc == 0, "rc": rc}

    say({"ready": True, "pid": os.getpid(), "device": dev, "alloc_s": round(alloc_s, 3), "tensors": n_tensors,
         "tensor_bytes": per * 4, "total_bytes": per * 4 * n_tensors,
         "memory_allocated": torch.cuda.memory_allocated() if cuda else None,
         "memory_reserved": torch.cuda.memory_reserved() if cuda else None,
         "memory_reserved_before_trim": reserved_untrimmed, "graph_captured": graph is not None, "graph_vs_eager_max_abs_diff": graph_vs_eager,
         "torch": torch.__version__})
    for line in sys.stdin:
        cmd, *rest = line.split()
        try:
            if cmd == "verify":
                say(verify())
            elif cmd == "busy_start":
                busy.clear()
                busy["stop"] = threading.Event()
                busy["thread"] = threading.Thread(target=busy_loop, daemon=True)
                busy["thread"].start()
                say({"busy": True})
            elif cmd == "busy_stop":
                busy["stop"].set()
                busy["thread"].join(60)
                say(busy.get("result", {"error": "the busy loop did not end"}))
            elif cmd == "baseline":
                say(baseline(float(rest[0]) if rest else 100.0))
            elif cmd == "empty_cache":
                before = torch.cuda.memory_reserved() if cuda else 0
                if cuda:
                    torch.cuda.empty_cache()
                say({"reserved_before": before, "reserved_after": torch.cuda.memory_reserved() if cuda else 0})
            elif cmd == "prefault":  # default: torch's reserve and 1 GiB (the context, the graph's pool)
                say(prefault_heap(int(rest[0]) if rest else (torch.cuda.memory_reserved() if cuda else 0) + GIB))
            elif cmd == "pool":  # the shipped worker/ckpt_pool.py, its library preloaded (--pool)
                say(POOL.prepare(int(rest[0])))
            elif cmd == "handed":
                say({"handed": POOL.handed()})
            elif cmd == "pin":  # the prepared region registered with the driver (page-locked): --variant pool_pinned
                say(pin_region())
            elif cmd == "unpin":
                say(unpin_region())
            elif cmd == "drop":
                POOL.drop()
                say({"dropped": True})
            elif cmd == "exit":
                say({"bye": True})
                return
            else:
                say({"error": f"unknown command {cmd}"})
        except Exception as e:
            say({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]})


VARIANTS = ["plain", "empty_cache", "thp_always", "prefault_heap", "prefault_heap_thp_always", "pool", "pool_again",
            "pool_pinned"]
#: those run unless --variant names others: the ones ruled out (2026-11-26: empty_cache, prefault_heap) only on demand,
#: and pool_pinned (not yet run: it may leave the child's driver state unusable) only when named, with the later
#: stages skipped (--skip-baseline --skip-cycle2 --skip-cycle3)
DEFAULT_VARIANTS = ["plain", "thp_always", "pool", "pool_again"]
THP = Path("/sys/kernel/mm/transparent_hugepage")
_THP_ORIGINAL: dict[str, Any] = {}  # what set_thp changed, put back at exit (also by the watchdog)


def thp_settings() -> dict[str, Any]:
    """The transparent huge page settings in force (the bracketed words of enabled and defrag)."""
    d: dict[str, Any] = {}
    for k in ("enabled", "defrag"):
        try:
            m = re.search(r"\[(\w[\w+]*)\]", (THP / k).read_text())
            d[k] = m.group(1) if m else None
        except OSError as e:
            d[k] = None
            d[f"{k}_error"] = f"{type(e).__name__}: {e}"
    return d


def set_thp(enabled: str | None, defrag: str | None) -> dict[str, Any]:
    """Set transparent huge pages (root only); the first change records the original for the exit to restore."""
    if not _THP_ORIGINAL:
        _THP_ORIGINAL.update(thp_settings())
    r: dict[str, Any] = {"ok": True}
    for k, v in (("enabled", enabled), ("defrag", defrag)):
        if v is None:
            continue
        try:
            (THP / k).write_text(v)
        except OSError as e:
            r = {"ok": False, "error": f"{k}={v}: {type(e).__name__}: {e}"}
    r["now"] = thp_settings()
    return r


def threads_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of a process, by thread id."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for t in Path(f"/proc/{pid}/task").glob("*"):
        try:
            f = (t / "stat").read_text().rsplit(")", 1)[1].split()
            out[int(t.name)] = (int(f[11]) + int(f[12])) / tick
        except (OSError, ValueError, IndexError):
            pass
    return out


def big_mappings(pid: int, min_bytes: int = 256 << 20) -> dict[str, dict[str, Any]]:
    """The process's mappings of at least ``min_bytes`` (``/proc/PID/smaps``): size, permissions, what backs them
    (a path, or anonymous), resident and huge-page bytes, by start address."""
    maps: dict[str, dict[str, Any]] = {}
    cur: dict[str, Any] | None = None
    try:
        text = Path(f"/proc/{pid}/smaps").read_text()
    except OSError:
        return maps
    for line in text.splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ \S+\s*(.*)$", line)
        if head:
            size = int(head.group(2), 16) - int(head.group(1), 16)
            cur = ({"size": size, "perms": head.group(3), "backing": head.group(4) or "anonymous"}
                   if size >= min_bytes else None)
            if cur is not None:
                maps[head.group(1)] = cur
        elif cur is not None and line.split(":")[0] in ("Rss", "AnonHugePages", "Anonymous", "Locked"):
            k, v = line.split(":", 1)
            cur[k] = int(v.split()[0]) * 1024
    return maps


def copy_floor(n: int = 4 * GIB) -> dict[str, Any]:
    """One CPU thread's copy of ``n`` bytes on this machine: into fresh pages (faulted and zeroed as they are
    written, as a checkpoint into new pageable memory is) and into pages already faulted in; GB/s."""
    import numpy as np

    src = np.ones(n, dtype=np.uint8)
    res: dict[str, Any] = {"bytes": n, "thp": thp_settings()}
    t = time.perf_counter()
    dst = np.empty(n, dtype=np.uint8)
    np.copyto(dst, src)
    res["fresh_pages_GB_per_s"] = round(n / 1e9 / (time.perf_counter() - t), 2)
    t = time.perf_counter()
    np.copyto(dst, src)
    res["faulted_pages_GB_per_s"] = round(n / 1e9 / (time.perf_counter() - t), 2)
    del src, dst
    return res


def prefault_heap(n: int) -> dict[str, Any]:
    """In the checkpointed child: make malloc keep what is freed (M_MMAP_MAX 0: no mmap'd chunks; M_TRIM_THRESHOLD
    -1: the heap never shrinks), then fault in ``n`` bytes of heap and free them, so an allocation of the driver
    through malloc during the checkpoint lands on pages already faulted (its host memory stays held afterwards)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    ok = [libc.mallopt(-4, 0), libc.mallopt(-1, -1)]  # M_MMAP_MAX, M_TRIM_THRESHOLD
    t = time.perf_counter()
    p = libc.malloc(n)
    if not p:
        return {"error": f"malloc({n}) failed", "mallopt": ok}
    ctypes.memset(p, 1, n)
    fault_s = time.perf_counter() - t
    libc.free(p)
    return {"bytes": n, "mallopt_ok": ok, "fault_s": round(fault_s, 3), "rss": vm_rss(os.getpid())}


def cpu_child_main(n: int) -> None:
    """A process with ``n`` bytes of host memory, every page written, and no CUDA: what suspend() alone stops."""
    x = bytearray(n)
    x[::4096] = b"\x01" * len(range(0, n, 4096))
    print("@@" + json.dumps({"ready": True, "rss": vm_rss(os.getpid())}), flush=True)
    for _line in sys.stdin:
        print("@@" + json.dumps({"intact": x.count(b"\x01") == len(range(0, n, 4096))}), flush=True)


def cpu_only(n: int) -> dict[str, Any]:
    """suspend()/resume() of the shipped module on a process with ``n`` bytes of host memory and no CUDA (the
    simulated inventory's and CPU-only cells' path, here on a host with a real driver: GetState says
    NOT_INITIALIZED, so the process is only stopped)."""
    c = Child(["--cpu-child", str(n)], "cpu-child")
    try:
        ready = c.read(120)
        if not ready.get("ready"):
            return {"error": ready}
        done = SUS.suspend([c.pid])
        stopped = proc_state(c.pid)
        back = SUS.resume([c.pid])
        return {"bytes": n, "rss": ready.get("rss"), "how": done.how, "suspend_s": done.seconds,
                "proc_state_suspended": stopped, "resume_s": back, "proc_state_resumed": proc_state(c.pid),
                **c.ask("check", 60)}
    finally:
        c.end()


def hog_main(mode: str, margin_mib: int) -> None:
    """Another process taking most of the GPU's free memory: 'fill' allocates, writes and frees it; 'hold' keeps it
    until told 'free'."""
    import torch

    def say(obj: dict[str, Any]) -> None:
        sys.stdout.write("@@" + json.dumps(obj) + "\n")
        sys.stdout.flush()

    torch.cuda.init()
    torch.zeros(1, device="cuda")
    free, total = torch.cuda.mem_get_info()
    n = free - (margin_mib << 20)
    t = time.perf_counter()
    try:
        x = torch.empty(n, dtype=torch.uint8, device="cuda")
        x.fill_(0x5A)
        torch.cuda.synchronize()
        ok = bool((x[:: 1 << 20] == 0x5A).all().item())
    except Exception as e:
        say({"error": f"{type(e).__name__}: {e}", "free_before": free, "total": total, "asked": n})
        return
    res = {"free_before": free, "total": total, "allocated": n, "written_ok": ok,
           "alloc_and_fill_s": round(time.perf_counter() - t, 3)}
    if mode == "hold":
        say({**res, "holding": True})
        sys.stdin.readline()
    del x
    torch.cuda.empty_cache()
    say({**res, "freed": True})


# ------------------------------------------------------------------------------------------------ the experiment
class Aborted(Exception):
    pass


def ckpt_experiment(nvml: Nvml, n_tensors: int, tensor_mib: int, opts: argparse.Namespace) -> None:
    R: dict[str, Any] = RESULT.setdefault("checkpoint", {})
    R["api"] = "ctypes on libcuda.so.1 (see the module docstring for why not cuda-bindings)"
    try:
        cu = Cuda()
    except OSError as e:
        error("libcuda", e)
        return
    R["driver"] = cu.init()
    R["custom_storage"] = custom_storage(cu)
    log(f"custom storage: {R['custom_storage']}")
    R["header"] = header_facts()
    R["cuda_bindings"] = cuda_bindings_facts()
    save()
    if any(n.startswith("cuCheckpoint") for n in cu.missing):
        error("libcuda", f"checkpoint entry points missing: {cu.missing}")
        return
    log(f"driver {R['driver']}")
    if R["header"].get("c_sizes"):
        log(f"cuda.h struct sizes {R['header']['c_sizes']} vs ctypes {R['header']['ctypes_sizes']}")

    def state(pid: int) -> str | None:
        if proc_state(pid) in ("T", "t"):  # measured 2026-11-26 23:04: GetState blocks while the target is stopped
            return "not asked: the process is stopped (cuCheckpointProcessGetState blocks until it runs)"
        st = cu.state(pid)
        return st.get("state") or st.get("rc")

    def call(what: str, pid: int, timeout: float = 60, **kw: Any) -> dict[str, Any]:
        r = cu.call(what, pid, timeout, **kw)
        th = r.pop("thread", None)
        r.pop("box", None)
        r["state_after"] = state(pid) if th is None else None
        r["proc_state_after"] = proc_state(pid)
        log(f"  {what}: {r}")
        return r

    # --- probes on processes that are not CUDA processes (fake libcuda must answer the same)
    probes: dict[str, Any] = R.setdefault("probes", {})
    sleeper = subprocess.Popen(["sleep", "300"])
    _CHILDREN.append(sleeper)
    probes["getstate_non_cuda_process"] = cu.state(sleeper.pid)
    probes["getstate_own_process_after_cuInit"] = cu.state(os.getpid())
    probes["getstate_no_such_pid"] = cu.state(4_000_000)
    probes["lock_non_cuda_process"] = {k: v for k, v in cu.call("lock", sleeper.pid, 20, timeout_ms=2000).items()
                                       if k not in ("thread", "box")}
    sleeper.kill()
    sleeper.wait()
    log(f"probes: {probes}")
    save()

    # --- the child: ~10 GiB of tensors and a captured graph
    snap0 = nvml.snapshot()
    t = time.perf_counter()
    pool_lib = None
    if opts.pool:
        pool_lib, why = POOL.library()
        R["pool_library"] = pool_lib or why
    child = Child(["--child", str(n_tensors), str(tensor_mib)], "child", {"LD_PRELOAD": pool_lib} if pool_lib else None)
    R["child_ld_preload"] = pool_lib
    ready = child.read(150)
    R["child"] = {**ready, "start_s": round(time.perf_counter() - t, 2)}
    if not ready.get("ready"):
        error("child", str(ready))
        child.end()
        return
    pid = child.pid
    R["nvml_before_child"] = snap0
    R["nvml_child_running"] = snap_run = nvml.snapshot()
    log(f"child {pid} ready: {ready}; GPU used {snap_run.get('used')}")
    R["states"] = {"started": state(pid)}
    R["restore_thread_id_running"] = cu.restore_tid(pid)
    save()

    def gpu_used() -> int | None:
        return nvml.snapshot().get("used")

    def cycle1() -> None:
        # ============ cycle 1, the design's order, through the shipped module: suspend() = lock, checkpoint,
        # SIGSTOP; another process fills the GPU; resume() = SIGCONT, restore, unlock
        log("cycle 1: idle child; suspend() (lock, checkpoint, SIGSTOP), other process fills the GPU, resume()")
        c1: dict[str, Any] = R.setdefault("cycle1", {})
        c1["host_mem_available_before"] = mem_available()
        c1["child_rss_before"] = vm_rss(pid)
        t = time.perf_counter()
        try:
            done = SUS.suspend([pid], timeout=120)
        except SUS.SuspendError as e:
            c1["suspend_error"] = str(e)
            raise Aborted(f"suspend failed: {e}") from None
        c1["suspend"] = {"how": done.how, "seconds": done.seconds, "host_bytes": done.host_bytes,
                         "checkpointed": list(done.checkpointed), "wall_s": round(time.perf_counter() - t, 4),
                         "state_after": state(pid), "proc_state_after": proc_state(pid)}
        log(f"  suspend: {c1['suspend']}")
        c1["restore_thread_id_checkpointed"] = cu.restore_tid(pid)
        c1["proc_state_after_sigstop"] = proc_state(pid)
        c1["child_rss_checkpointed"] = vm_rss(pid)
        c1["host_mem_available_checkpointed"] = mem_available()
        c1["nvml_checkpointed"] = snap = nvml.snapshot()
        c1["gpu_memory_freed_bytes"] = (snap_run.get("used") or 0) - (snap.get("used") or 0)
        c1["child_listed_by_nvml_when_checkpointed"] = any(p["pid"] == pid for p in snap.get("processes", []))
        log(f"  checkpointed: GPU used {snap_run.get('used')} -> {snap.get('used')}; child RSS "
            f"{c1['child_rss_before']} -> {c1['child_rss_checkpointed']}; processes {snap.get('processes')}")
        save()
        t = time.perf_counter()
        hog = Child(["--hog", "fill", "1024"], "hog")
        c1["other_process_fill"] = {**hog.read(120), "wall_s": round(time.perf_counter() - t, 2)}
        hog.proc.wait(30)
        log(f"  other process: {c1['other_process_fill']}")
        tot = (snap.get("total") or 0)
        alloc = c1["other_process_fill"].get("allocated") or 0
        c1["other_process_allocated_fraction_of_gpu"] = round(alloc / tot, 3) if tot else None
        c1["other_process_used_the_childs_memory"] = bool(tot and alloc > tot - (snap_run.get("used") or 0))
        c1["gpu_used_after_other_process"] = gpu_used()
        try:
            c1["resume"] = {"seconds": SUS.resume([pid], timeout=120)}
        except SUS.ResumeError as e:
            c1["resume"] = {"error": str(e)}
            raise Aborted(f"resume failed: {e}") from None
        c1["resume"].update(state_after=state(pid), proc_state_after=proc_state(pid))
        log(f"  resume: {c1['resume']}")
        c1["child_rss_after"] = vm_rss(pid)
        c1["nvml_after"] = nvml.snapshot()
        c1["verify"] = v = child.ask("verify", 120)
        log(f"  verify: {v}")
        size = (c1["nvml_after"].get("used") or 0) - (R["nvml_before_child"].get("used") or 0)
        c1["footprint_bytes"] = size
        c1["suspend_s"] = done.seconds
        c1["resume_s"] = c1["resume"]["seconds"]
        c1["checkpoint_GB_per_s"] = round(size / 1e9 / max(done.seconds, 1e-6), 2)
        c1["restore_GB_per_s"] = round(size / 1e9 / max(c1["resume_s"], 1e-6), 2)
        c1["passed"] = bool(v.get("tensors_bit_identical") and v.get("checksums_equal")
                            and v.get("graph_replay_input1_bit_identical") and v.get("graph_replay_input2_bit_identical"))
        R["states"]["cycle1"] = [c1["suspend"]["state_after"], c1["resume"]["state_after"]]

    def baseline() -> None:
        # ============ baseline: the same tensors, moved by host copies and pickling, in the same child
        budget = max(20.0, min(110.0, left() - 100))
        log(f"baseline (budget {budget:.0f} s)")
        R["baseline"] = b = child.ask(f"baseline {budget:.0f}", budget + 90)
        log(f"  baseline: {b}")

    def cycle2() -> None:
        # ============ cycle 2: a busy child; restore with an explicit same-GPU UUID pair, tried while still stopped
        log("cycle 2: busy child; lock, checkpoint, SIGSTOP, restore(same-GPU UUID pair) while stopped, unlock")
        c2: dict[str, Any] = R.setdefault("cycle2", {})
        c2["busy_start"] = child.ask("busy_start", 30)
        time.sleep(1.5)
        c2["lock"] = call("lock", pid)
        if not c2["lock"].get("ok"):
            raise Aborted("lock (busy) failed")
        c2["checkpoint"] = call("checkpoint", pid, 120)
        if not c2["checkpoint"].get("ok"):
            raise Aborted("checkpoint (busy) failed")
        os.kill(pid, signal.SIGSTOP)
        time.sleep(0.2)
        c2["proc_state_after_sigstop"] = proc_state(pid)
        c2["gpu_used_checkpointed"] = gpu_used()
        pairs = [(cu.uuid, cu.uuid)] if cu.uuid else None
        c2["restore_pairs"] = "same GPU UUID -> same GPU UUID" if pairs else "none (no UUID)"
        r = cu.call("restore", pid, 15, pairs=pairs)
        if r.get("timeout"):
            c2["restore_while_stopped"] = "did not finish within 15 s while the process was stopped"
            log("  restore while stopped: still running after 15 s; SIGCONT")
            os.kill(pid, signal.SIGCONT)
            r["thread"].join(90)
            box = r["box"]
            c2["restore"] = {"call": "restore", "rc": cu.errname(box.get("rc")), "ok": box.get("rc") == 0,
                             "seconds_incl_stopped_wait": box.get("seconds"), "completed_after_sigcont": "rc" in box,
                             "state_after": state(pid)}
        else:
            r["state_after"] = state(pid)
            c2["restore_while_stopped"] = "finished while the process was stopped"
            c2["restore"] = r
            c2["proc_state_after_restore"] = proc_state(pid)
            u = cu.call("unlock", pid, 15)
            if u.get("timeout"):
                c2["unlock_while_stopped"] = "did not finish within 15 s while stopped"
                os.kill(pid, signal.SIGCONT)
                u["thread"].join(60)
                u = {"call": "unlock", "rc": cu.errname(u["box"].get("rc")), "seconds": u["box"].get("seconds")}
            else:
                c2["unlock_while_stopped"] = "finished while the process was stopped"
            c2["unlock"] = {k: v for k, v in u.items() if k not in ("thread", "box")}
            os.kill(pid, signal.SIGCONT)
        log(f"  restore: {c2['restore']}; {c2['restore_while_stopped']}")
        if proc_state(pid) == "T":
            os.kill(pid, signal.SIGCONT)
        if state(pid) == "CHECKPOINTED":  # the restore with the UUID pair failed: the plain one, to go on
            c2["restore_retry_without_pairs"] = call("restore", pid, 120)
        if "unlock" not in c2 or state(pid) == "LOCKED":
            c2["unlock"] = call("unlock", pid)
        time.sleep(1.0)
        c2["busy_result"] = child.ask("busy_stop", 60)
        c2["verify"] = v = child.ask("verify", 120)
        log(f"  busy: {c2['busy_result']}; verify: {v}")
        c2["passed"] = bool(v.get("tensors_bit_identical") and v.get("graph_replay_input1_bit_identical")
                            and c2["busy_result"].get("all_results_equal"))
        R["states"]["cycle2"] = [c2[k].get("state_after") for k in ("lock", "checkpoint", "restore", "unlock")]

    def resumed(timeout: float = 120) -> dict[str, Any]:
        """resume() of the shipped module, its outcome as a record (a ResumeError is an outcome here)."""
        t = time.perf_counter()
        try:
            r: dict[str, Any] = {"ok": True, "seconds": SUS.resume([pid], timeout=timeout)}
        except SUS.ResumeError as e:
            r = {"ok": False, "error": str(e), "seconds": round(time.perf_counter() - t, 4)}
        r.update(state_after=state(pid), proc_state_after=proc_state(pid))
        log(f"  resume: {r}")
        return r

    def suspended(timeout: float = 120) -> dict[str, Any]:
        try:
            done = SUS.suspend([pid], timeout=timeout)
        except SUS.SuspendError as e:
            raise Aborted(f"suspend failed: {e}") from None
        r = {"how": done.how, "seconds": done.seconds, "host_bytes": done.host_bytes, "state_after": state(pid),
             "proc_state_after": proc_state(pid)}
        log(f"  suspend: {r}")
        return r

    def cycle3() -> None:
        # ============ cycle 3 (last: it loses the child's GPU state): resume() while another process holds the
        # GPU's memory, then again after it lets go; through the shipped module, so its ResumeError is what is seen
        log("cycle 3: resume() while another process holds the memory")
        c3: dict[str, Any] = R.setdefault("cycle3", {})
        c3["suspend"] = suspended()
        hog = Child(["--hog", "hold", "512"], "hog3")
        c3["other_process_holds"] = hog.read(120)
        c3["resume_under_pressure"] = resumed(30)
        hog.ask("free", 60)
        hog.proc.wait(30)
        # measured twice (2026-11-26): every retry fails with CUDA_ERROR_OPERATING_SYSTEM, whatever the pause
        c3["resume_retries"] = retries = []
        for pause in (0.0, 2.0):
            if state(pid) != "CHECKPOINTED" or left() < 40:
                break
            time.sleep(pause)
            retries.append({"after_pause_s": pause, "gpu_used_before": gpu_used(), **resumed()})
        c3["state_at_end"] = state(pid)
        if c3["state_at_end"] == "RUNNING":
            c3["verify"] = v = child.ask("verify", 120)
            c3["passed"] = bool(v.get("tensors_bit_identical") and v.get("graph_replay_input1_bit_identical"))
            log(f"  verify: {v}")

    def late_probes() -> None:
        # ============ calls out of order: after the cycles (the run of 2026-11-26 22:56 made them before cycle 1,
        # and cycle 1's suspend() then gave no answer for 320 s)
        probes["unlock_when_running"] = call("unlock", pid, 20)
        probes["restore_when_running"] = call("restore", pid, 20)
        probes["checkpoint_when_running"] = call("checkpoint", pid, 20)
        if state(pid) == "CHECKPOINTED":
            call("restore", pid, 60)
            call("unlock", pid, 20)
        probes["lock_twice"] = [call("lock", pid, 20), call("lock", pid, 20, timeout_ms=2000)]
        if state(pid) == "LOCKED":
            call("unlock", pid, 20)

    def stage(name: str, fn: Any) -> bool:
        # a stage that stalls writes every thread's stack to the log, every 45 s, so the next run knows where
        faulthandler.dump_traceback_later(45, repeat=True, file=_LOG or sys.stderr)
        try:
            fn()
            return True
        except Aborted as e:
            error(name, str(e))
        except Exception as e:
            error(name, e)
        finally:
            faulthandler.cancel_dump_traceback_later()
            if proc_state(pid) == "T":
                os.kill(pid, signal.SIGCONT)
            save()
        return False

    def repeats() -> None:
        # ============ plain cycles back to back through the shipped module (no other process): the spread
        rows: list[dict[str, Any]] = R.setdefault("repeats", [])
        for _ in range(opts.repeat):
            if left() < 90 or state(pid) != "RUNNING":
                break
            s, r = suspended(), resumed()
            rows.append({"suspend_s": s["seconds"], "resume_s": r["seconds"], "host_bytes": s["host_bytes"],
                         "ok": bool(r["ok"] and s["proc_state_after"] == "T" and r["state_after"] == "RUNNING")})
            log(f"  repeat: {rows[-1]}")
        v = child.ask("verify", 120)
        R["repeats_verify"] = v
        if not v.get("tensors_bit_identical"):
            raise Aborted(f"repeats: verify failed {v}")

    def variants() -> None:
        # ============ designs that might bring suspend / resume of this footprint under 2 s each way (issue 33):
        # the plain path moved ~2.3 GB/s into fresh pageable memory (checkpoint) and ~6.2 GB/s back. Each variant is
        # one suspend()+resume() cycle of the same child, then the bit-identical check; ~10 s each.
        rows: dict[str, Any] = R.setdefault("variants", {})
        rows["thp_before"] = thp0 = thp_settings()

        def cycle(name: str, prep: str | None = None) -> None:
            if name not in (opts.variant or DEFAULT_VARIANTS):
                return
            if left() < 75 or state(pid) != "RUNNING":
                rows[name] = {"skipped": "no time left" if left() < 75 else f"child is {state(pid)}"}
                return
            row: dict[str, Any] = {"thp": thp_settings()}
            if prep:
                row["prep"] = child.ask(prep, 120)
            row["gpu_used_before"], row["rss_before"] = gpu_used(), vm_rss(pid)
            row["footprint_bytes"] = (row["gpu_used_before"] or 0) - (R["nvml_before_child"].get("used") or 0)
            s = suspended()
            row["rss_checkpointed"] = vm_rss(pid)
            r = resumed()
            v = child.ask("verify", 120)
            row.update(suspend_s=s["seconds"], resume_s=r["seconds"], host_bytes=s["host_bytes"], resume_ok=r["ok"],
                       rss_after=vm_rss(pid), bit_identical=bool(v.get("tensors_bit_identical")
                                                                 and v.get("graph_replay_input1_bit_identical")))
            if not r["ok"]:
                row["resume_error"] = r.get("error")
            rows[name] = row
            log(f"  variant {name}: suspend {row['suspend_s']} s, resume {row['resume_s']} s, "
                f"{row['footprint_bytes']} bytes, bit-identical {row['bit_identical']}")
            save()

        # i. the plain path through the module, then with torch's cache emptied first (fewer bytes to copy)
        cycle("plain")
        cycle("empty_cache", "empty_cache")
        # ii. transparent huge pages for every anonymous mapping: the checkpoint writes ~14 GB of fresh pageable
        # memory, ~3.4 M page faults with 4 KiB pages, ~7 k with 2 MiB ones (root only; restored after)
        thp_on = set_thp("always", None)
        rows["thp_set"] = thp_on
        if thp_on.get("ok"):
            try:
                cycle("thp_always", "empty_cache")
            finally:
                rows["thp_restored"] = set_thp(thp0.get("enabled"), None)
        # iii. the child's malloc keeps freed memory (M_MMAP_MAX 0: no mmap; M_TRIM_THRESHOLD -1: never trimmed) and
        # faults in a block of the footprint first, so a driver allocating through malloc lands on faulted pages;
        # if the driver maps its own memory (mmap) this changes nothing, which the figure then shows
        cycle("prefault_heap", "prefault")
        # iv. (--pool: worker/ckpt_pool.c preloaded in the child, as the local executor does) the driver's destination
        # faulted in beforehand: the anatomy showed one driver thread copying into one new mapping at fresh-page speed
        if R.get("child_ld_preload"):
            fp = (gpu_used() or 0) - (R["nvml_before_child"].get("used") or 0)
            for name in ("pool", "pool_again", "pool_pinned"):
                if name not in (opts.variant or DEFAULT_VARIANTS) or state(pid) != "RUNNING":
                    continue
                prep = child.ask(f"pool {fp + (512 << 20)}", 120)
                pin = child.ask("pin", 120) if name == "pool_pinned" else None
                cycle(name)
                if name in rows and isinstance(rows[name], dict):
                    rows[name]["pool_prepare"] = prep
                    rows[name]["pool_handed_total"] = child.ask("handed", 30).get("handed")
                    if pin is not None:
                        rows[name]["pin"] = pin
                        rows[name]["unpin_after"] = child.ask("unpin", 30)
                child.ask("drop", 30)
        if thp_on.get("ok"):  # ii + iii
            set_thp("always", None)
            try:
                cycle("prefault_heap_thp_always", "prefault")
            finally:
                set_thp(thp0.get("enabled"), None)
        rows["thp_after"] = thp_settings()

    def anatomy() -> None:
        # ============ where a checkpoint's time goes (issue 33's 2 s bar): which process and thread burn CPU while
        # the driver copies, how the target's resident memory grows, and what backs the memory it copies into
        rows: dict[str, Any] = R.setdefault("anatomy", {})

        def observe(what: str, fn: Any) -> dict[str, Any]:
            me = os.getpid()
            cpu_t0, cpu_m0 = threads_cpu(pid), threads_cpu(me)
            box: dict[str, Any] = {}
            th = threading.Thread(target=lambda: box.update(r=fn()), daemon=True)
            t0 = time.monotonic()
            th.start()
            curve = []
            while th.is_alive():
                th.join(0.25)
                curve.append([round(time.monotonic() - t0, 2), vm_rss(pid)])
            wall = time.monotonic() - t0
            cpu_t1, cpu_m1 = threads_cpu(pid), threads_cpu(me)
            busy_t = sorted(((round(v - cpu_t0.get(k, 0.0), 2), k) for k, v in cpu_t1.items()), reverse=True)[:4]
            busy_m = sorted(((round(v - cpu_m0.get(k, 0.0), 2), k) for k, v in cpu_m1.items()), reverse=True)[:3]
            return {"result": box.get("r"), "wall_s": round(wall, 3), "target_busiest_threads_cpu_s": busy_t,
                    "target_cpu_s": round(sum(cpu_t1.values()) - sum(cpu_t0.values()), 2),
                    "caller_busiest_threads_cpu_s": busy_m, "rss_curve": curve, "what": what}

        for mode in (None, "always"):
            if left() < 60 or state(pid) != "RUNNING":
                break
            name = "thp_" + (mode or "as_is")
            if mode:
                if not set_thp(mode, None).get("ok"):
                    continue
            try:
                before = big_mappings(pid)
                row: dict[str, Any] = {"thp": thp_settings(), "floor": copy_floor()}
                row["suspend"] = observe("suspend()", suspended)
                after = big_mappings(pid)
                row["new_mappings"] = {k: v for k, v in after.items() if k not in before}
                row["resume"] = observe("resume()", resumed)
                rows[name] = row
                log(f"  anatomy {name}: suspend {row['suspend']['wall_s']} s, target threads "
                    f"{row['suspend']['target_busiest_threads_cpu_s']}, caller {row['suspend']['caller_busiest_threads_cpu_s']}; "
                    f"resume {row['resume']['wall_s']} s, target {row['resume']['target_busiest_threads_cpu_s']}; "
                    f"floor {row['floor']}; new mappings {row['new_mappings']}")
            finally:
                if mode:
                    set_thp(_THP_ORIGINAL.get("enabled"), None)
            save()
        v = child.ask("verify", 120)
        rows["verify_bit_identical"] = bool(v.get("tensors_bit_identical") and v.get("graph_replay_input1_bit_identical"))

    try:
        ok1 = stage("cycle1", cycle1)
        if ok1 and opts.repeat and state(pid) == "RUNNING":
            stage("repeats", repeats)
        if ok1 and opts.anatomy and state(pid) == "RUNNING":
            stage("anatomy", anatomy)
        if ok1 and opts.variants and state(pid) == "RUNNING":
            stage("variants", variants)
        if not opts.skip_baseline and state(pid) == "RUNNING" and left() > 120:
            stage("baseline", baseline)
        if ok1 and not opts.skip_cycle2 and state(pid) == "RUNNING" and left() > 70:
            stage("cycle2", cycle2)
        if ok1 and state(pid) == "RUNNING" and left() > 30:
            stage("late_probes", late_probes)
        if ok1 and not opts.skip_cycle3 and state(pid) == "RUNNING" and left() > 50:
            stage("cycle3", cycle3)  # last: it leaves the child's GPU state lost
        R["states"]["end"] = state(pid)
        save()
    finally:
        if proc_state(pid) == "T":
            os.kill(pid, signal.SIGCONT)
        if child.proc.poll() is None and left() > 10 and state(pid) == "RUNNING":
            child.ask("exit", 10)
        child.end()


# ------------------------------------------------------------------------------------------------ project checks
def run_pytest() -> dict[str, Any]:
    """The real-NVML contract tests. --noconftest: the suite's conftest loads pytest-jupyter (a Jupyter server
    stack this machine lacks) for other tests; these need only tests/ on the path, which PYTHONPATH gives."""
    xml = OUT_DIR / "pytest-nvml-real.xml"
    cmd = [sys.executable, "-m", "pytest", "tests/broker/inventory/test_inventory_contract.py", "-k", "nvml-real",
           "--noconftest", "-rA", "-q", f"--junitxml={xml}", "-o", "timeout=120"]
    t = time.perf_counter()
    try:
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=200)
        out, rc = r.stdout + r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        out, rc = f"timeout after 200 s\n{e.stdout or ''}", None
    (OUT_DIR / "pytest.log").write_text(out if isinstance(out, str) else out.decode(errors="replace"))
    res: dict[str, Any] = {"command": " ".join(cmd[1:]), "rc": rc, "seconds": round(time.perf_counter() - t, 1)}
    if xml.exists():
        import xml.etree.ElementTree as ET

        cases = []
        for tc in ET.parse(xml).getroot().iter("testcase"):
            outcome, detail = "passed", ""
            for kind in ("failure", "error", "skipped"):
                el = tc.find(kind)
                if el is not None:
                    outcome, detail = kind, (el.get("message") or "")[:300]
            cases.append({"test": tc.get("name"), "outcome": outcome, "detail": detail,
                          "seconds": float(tc.get("time") or 0)})
        res["cases"] = cases
        res["summary"] = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failure", "error", "skipped")}
    res["tail"] = out[-1500:] if isinstance(out, str) else ""
    return res


BROKER_CHECK = r"""
import json, os, subprocess, sys, tempfile, time
from jupyter_gpulease.client import BrokerClient
d = tempfile.mkdtemp(prefix="glb")
sock = os.path.join(d, "b.sock")
log = open(sys.argv[1], "ab")
p = subprocess.Popen([sys.executable, "-m", "lease_broker", f"--socket={sock}", f"--db={d}/l.db", "--inventory=nvml",
                      "--log-level=INFO"], stdout=log, stderr=subprocess.STDOUT, cwd=d)
res = {}
try:
    t = time.monotonic()
    while not os.path.exists(sock) and p.poll() is None and time.monotonic() - t < 40:
        time.sleep(0.05)
    c = BrokerClient("unix://" + sock, timeout=20)
    for _ in range(100):
        try:
            res["info"] = c.info(); break
        except Exception as e:
            res["info_error"] = repr(e); time.sleep(0.1)
    res["start_s"] = round(time.monotonic() - t, 2)
    g = c.gpus()
    res["gpus"] = g
    lease = c.request_lease(1, wait=10)
    res["lease"] = {"id": lease.id, "state": lease.state, "devices": lease.devices, "env": lease.env,
                    "simulated": lease.simulated}
    res["released"] = c.release(lease.id).state
finally:
    p.terminate()
    try:
        p.wait(15)
    except Exception:
        p.kill()
print("@@" + json.dumps(res, default=str))
"""


def run_broker() -> dict[str, Any]:
    r = sh([sys.executable, "-c", BROKER_CHECK, str(OUT_DIR / "broker.log")], timeout=90)
    for line in (r.get("stdout") or "").splitlines():
        if line.startswith("@@"):
            return json.loads(line[2:])
    return r


def run_session(a: argparse.Namespace) -> dict[str, Any]:
    """scripts/gpu_check_session.py in a process of its own, bounded: its JSON, or what it printed."""
    bound = max(30.0, min(240.0, left() - (10 if a.skip_checkpoint else 120)))
    r = sh([sys.executable, str(ROOT / "scripts" / "gpu_check_session.py"), "--out", str(OUT_DIR),
            "--tensors", str(a.tensors), "--tensor-mib", str(a.tensor_mib), "--idle", str(a.session_idle),
            "--warn", str(a.session_idle / 2)], timeout=bound)
    path = OUT_DIR / "session.json"
    res: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    res["rc"], res["bound_s"] = r.get("rc"), bound
    if r.get("rc") != 0:
        res["tail"] = (r.get("stdout") or "")[-1500:] + (r.get("stderr") or r.get("error") or "")[-1500:]
    return res


# ------------------------------------------------------------------------------------------------ main
def summary() -> None:
    c = RESULT.get("checkpoint", {})
    rows = [("GPU", RESULT.get("nvml", {}).get("name")), ("driver", RESULT.get("nvml", {}).get("driver")),
            ("pytest nvml-real", RESULT.get("pytest", {}).get("summary")),
            ("broker on NVML lease", (RESULT.get("broker", {}).get("lease") or {}).get("state"))]
    for k in ("cycle1", "cycle2", "cycle3"):
        cy = c.get(k, {})
        rows.append((k, {x: (cy.get(x) or {}).get("seconds") for x in ("lock", "checkpoint", "restore", "unlock")}
                     | {"passed": cy.get("passed")}))
    se = RESULT.get("session", {})
    rows.append(("session (NVML broker)", {"passed": se.get("passed"), "idle suspend": (se.get("idle_suspend") or {})
                 .get("asked_to_suspended_s"), "next cell to first line": (se.get("next_cell") or {})
                 .get("to_first_line_s"), "by hand": {k: (se.get("by_hand") or {}).get(k)
                                                      for k in ("suspend_s", "resume_s")}}))
    rows.append(("custom storage", c.get("custom_storage")))
    c1 = c.get("cycle1", {})
    rows.append(("cycle1 via suspend()/resume()", {"suspend_s": c1.get("suspend_s"), "resume_s": c1.get("resume_s")}))
    rows += [(f"variant {k}", {x: v.get(x) for x in ("suspend_s", "resume_s", "footprint_bytes", "bit_identical")})
             for k, v in (c.get("variants") or {}).items() if isinstance(v, dict) and "suspend_s" in v]
    rows.append(("cpu_only", RESULT.get("cpu_only")))
    rows += [("GPU memory freed by checkpoint", c1.get("gpu_memory_freed_bytes")),
             ("other process allocated", (c1.get("other_process_fill") or {}).get("allocated")),
             ("baseline", {k: v for k, v in (c.get("baseline") or {}).items() if isinstance(v, dict)}),
             ("states", c.get("states")), ("errors", len(RESULT["errors"]))]
    print("\n==== gpu-check summary ====")
    for k, v in rows:
        print(f"{k:32s} {json.dumps(v, default=str)}")
    print(f"JSON: {OUT_DIR / 'gpu_check.json'}")


def watchdog() -> None:
    while left() > 0:
        time.sleep(1)
    error("watchdog", f"the run reached its {DEADLINE_S:.0f} s bound; what was measured is kept")
    if _THP_ORIGINAL:
        set_thp(_THP_ORIGINAL.get("enabled"), _THP_ORIGINAL.get("defrag"))
    for p in _CHILDREN:
        try:
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
        except OSError:
            pass
    summary()
    os._exit(1)


def main() -> int:
    global OUT_DIR, _LOG, DEADLINE_S
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "/tmp/gpulease-gpu-check")
    ap.add_argument("--tensors", type=int, default=int(os.environ.get("GPU_CHECK_TENSORS", 10)),
                    help="how many tensors the checkpointed child holds (default 10)")
    ap.add_argument("--tensor-mib", type=int, default=int(os.environ.get("GPU_CHECK_TENSOR_MIB", 1024)),
                    help="MiB per tensor (default 1024: 10 GiB in all)")
    ap.add_argument("--skip-tests", action="store_true", help="only the checkpoint experiment")
    ap.add_argument("--skip-baseline", action="store_true", help="no pickling / host-copy baseline")
    ap.add_argument("--skip-cycle2", action="store_true", help="no busy-child / stopped-restore cycle")
    ap.add_argument("--repeat", type=int, default=0, help="plain checkpoint cycles back to back, for their spread")
    ap.add_argument("--variants", action=argparse.BooleanOptionalAction, default=True,
                    help="the designs that might bring suspend/resume under 2 s (torch's cache emptied, transparent "
                         "huge pages, a pre-faulted heap), one cycle each (default on: ~60 s)")
    ap.add_argument("--variant", action="append", choices=VARIANTS,
                    help=f"run only these variants (repeatable; default: {', '.join(DEFAULT_VARIANTS)})")
    ap.add_argument("--pool", action=argparse.BooleanOptionalAction, default=True,
                    help="preload worker/ckpt_pool.c's library in the child (built with the machine's cc, as the "
                         "local executor does) and run the pool variants (default on)")
    ap.add_argument("--anatomy", action="store_true",
                    help="where a checkpoint's time goes: CPU per thread, resident memory over time, the mappings")
    ap.add_argument("--skip-cycle3", action="store_true", help="no restore under memory pressure (it loses the state)")
    ap.add_argument("--skip-cpu", action="store_true", help="no SIGSTOP/SIGCONT timing of a CPU-only process")
    ap.add_argument("--skip-session", action="store_true",
                    help="no idle --session through a broker on the NVML inventory (scripts/gpu_check_session.py)")
    ap.add_argument("--session-idle", type=float, default=8.0,
                    help="the session's idle timeout in that step, seconds (its countdown: the last half)")
    ap.add_argument("--skip-checkpoint", action="store_true", help="no checkpoint experiment (the child, its cycles)")
    ap.add_argument("--bound", type=float, default=DEADLINE_S, help=f"seconds for the whole run (default {DEADLINE_S:g})")
    a = ap.parse_args()
    DEADLINE_S = a.bound
    OUT_DIR = Path(a.out)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    _LOG = open(OUT_DIR / "gpu_check.log", "a")
    threading.Thread(target=watchdog, daemon=True).start()
    RESULT["command"] = "python3 scripts/gpu_check.py " + " ".join(sys.argv[1:])
    why = gpu_present()
    if why:
        RESULT["skipped"] = why
        save()
        log(f"SKIPPED: {why}; nothing to check here (run it where an NVIDIA GPU is)")
        return 0
    log("environment")
    RESULT["wheels"] = install_wheels()
    RESULT["environment"] = environment()
    nvml = Nvml()
    RESULT["nvml"] = nvml.info()
    log(f"  {RESULT['environment']}\n  nvml: {RESULT['nvml']}\n  wheels: {RESULT['wheels']}")
    save()
    if not a.skip_tests:
        log("pytest: the real-NVML contract tests")
        try:
            RESULT["pytest"] = run_pytest()
            log(f"  {RESULT['pytest'].get('summary')} rc={RESULT['pytest']['rc']}")
        except Exception as e:
            error("pytest", e)
        save()
        log("a broker on the NVML inventory: grant and release a lease")
        try:
            RESULT["broker"] = run_broker()
            log(f"  {RESULT['broker']}")
        except Exception as e:
            error("broker", e)
        save()
    if not a.skip_cpu:
        log("CPU-only suspend: suspend()/resume() of a process with 10 GiB of host memory and no CUDA")
        try:
            RESULT["cpu_only"] = cpu_only(10 * GIB)
            log(f"  {RESULT['cpu_only']}")
        except Exception as e:
            error("cpu_only", e)
        save()
    if not a.skip_session:
        log("an idle --session through a broker on the NVML inventory (scripts/gpu_check_session.py)")
        try:
            RESULT["session"] = run_session(a)
            log(f"  passed: {RESULT['session'].get('passed')}; errors {RESULT['session'].get('errors')}")
        except Exception as e:
            error("session", e)
        save()
    if not a.skip_checkpoint:
        log(f"checkpoint experiment: {a.tensors} x {a.tensor_mib} MiB")
        ckpt_experiment(nvml, a.tensors, a.tensor_mib, a)
    save()
    summary()
    c = RESULT.get("checkpoint", {})
    ok = (not RESULT["errors"] and (a.skip_checkpoint or c.get("cycle1", {}).get("passed"))
          and (a.skip_tests or RESULT.get("pytest", {}).get("rc") == 0))
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child_main(int(sys.argv[2]), int(sys.argv[3]))
    elif len(sys.argv) > 1 and sys.argv[1] == "--hog":
        hog_main(sys.argv[2], int(sys.argv[3]))
    elif len(sys.argv) > 1 and sys.argv[1] == "--cpu-child":
        cpu_child_main(int(sys.argv[2]))
    else:
        try:
            sys.exit(main())
        finally:
            for p in _CHILDREN:
                if p.poll() is None:
                    try:
                        os.kill(p.pid, signal.SIGCONT)
                        p.kill()
                    except OSError:
                        pass
            if _THP_ORIGINAL:
                set_thp(_THP_ORIGINAL.get("enabled"), _THP_ORIGINAL.get("defrag"))
