"""Helpers shared by the NVML, contract and enforcement tests: the fake driver in-process,
workers whose activity a test switches on and off, and bounded polling."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, TypeVar

from fake_nvml import build
from waiting import wait_for as wait_for  # re-exported: the NVML tests import it from here

T = TypeVar("T")


def real_nvml_missing() -> str | None:
    """Why the real NVML cannot be used here (None when a real driver and GPU answer)."""
    if not (os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/nvidiactl")):
        return "no NVIDIA driver/GPU on this machine"
    import pynvml

    use_library(None)
    try:
        pynvml.nvmlInit()
        n = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
    except pynvml.NVMLError as e:
        return f"NVIDIA driver present but NVML fails: {e}"
    return None if n else "NVIDIA driver present but no GPU"


def use_library(path: Path | None) -> None:
    """Point the real pynvml bindings at a library: the fake (by path) or the system's (None).

    pynvml keeps one loaded library per process; tests that run the broker in a subprocess
    use LD_LIBRARY_PATH instead and exercise pynvml's own loading.
    """
    import pynvml

    pynvml._nvmlGetFunctionPointer_cache.clear()
    pynvml.nvmlLib = ctypes.CDLL(str(path)) if path is not None else None


def use_fake_library() -> Path:
    lib = build()
    use_library(lib)
    return lib


WORKER = """
import os, sys, time
flag = sys.argv[1]
print("ready", flush=True)
while True:
    if os.path.exists(flag):
        t = time.time()
        while time.time() - t < 0.05:
            pass
    else:
        time.sleep(0.2)
"""


class Worker:
    """A real process in its own session that burns CPU while its flag file exists."""

    def __init__(self, tmp: Path, name: str = "w") -> None:
        self.flag = tmp / f"{name}.busy"
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, str(self.flag)], stdout=subprocess.PIPE,
                                     start_new_session=True)
        assert self.proc.stdout is not None and self.proc.stdout.readline() == b"ready\n"
        self.pid = self.proc.pid

    def busy(self, on: bool = True) -> None:
        if on:
            self.flag.touch()
        else:
            self.flag.unlink(missing_ok=True)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def __enter__(self) -> "Worker":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.kill()


class EventLog:
    """Collects a broker's events from its Server-Sent Events stream (a real client, in a thread)."""

    def __init__(self, socket_path: str) -> None:
        import http.client
        import json
        import socket
        import threading

        class Conn(http.client.HTTPConnection):
            def connect(self) -> None:
                self.sock = socket.socket(socket.AF_UNIX)
                self.sock.connect(socket_path)

        self.events: list[dict[str, Any]] = []
        self.conn = Conn("localhost", timeout=120)
        self.conn.request("GET", "/api/v1/events/stream")
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200

        def pump() -> None:
            try:
                while True:
                    line = self.resp.readline()
                    if not line:
                        return
                    if line.startswith(b"data: "):
                        self.events.append(json.loads(line[6:]))
            except Exception:
                return

        self.thread = threading.Thread(target=pump, daemon=True)
        self.thread.start()

    def of(self, type_: str, **match: Any) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("type") == type_ and all(e.get(k) == v for k, v in match.items())]

    def wait(self, type_: str, timeout: float = 10.0, **match: Any) -> dict[str, Any]:
        return wait_for(lambda: (self.of(type_, **match) or [None])[0], timeout=timeout,
                        what=f"event {type_} {match}; got {[e.get('type') for e in self.events]}")

    def close(self) -> None:
        try:
            self.conn.sock.shutdown(2)  # type: ignore[union-attr]
        except Exception:
            pass
        self.conn.close()


GPU_WORKER = """
import os, sys, time
import torch
flag = sys.argv[1]
a = torch.randn(4096, 4096, device="cuda")
torch.cuda.synchronize()
print("ready", flush=True)
while True:
    if os.path.exists(flag):
        t = time.time()
        while time.time() - t < 0.1:
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()
    else:
        time.sleep(0.2)
"""


def cuda_workload_missing() -> str | None:
    """Why this machine cannot run a small CUDA workload (torch), or None."""
    r = subprocess.run([sys.executable, "-c", "import torch; assert torch.cuda.is_available()"],
                       capture_output=True, timeout=120)
    return None if r.returncode == 0 else "needs torch with CUDA to make a process busy on the GPU"


class GpuWorker(Worker):
    """A real CUDA process (torch) that multiplies matrices while its flag file exists."""

    def __init__(self, tmp: Path, name: str = "g") -> None:
        self.flag = tmp / f"{name}.busy"
        self.proc = subprocess.Popen([sys.executable, "-c", GPU_WORKER, str(self.flag)], stdout=subprocess.PIPE,
                                     start_new_session=True)
        assert self.proc.stdout is not None and self.proc.stdout.readline() == b"ready\n"
        self.pid = self.proc.pid
