"""Build the fake libcuda.so.1 (see fake_cuda.c) and read or steer the per-process state it keeps."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).parent
SOURCE = HERE / "fake_cuda.c"
BUILD = HERE / "build"
LIBRARY = BUILD / "libcuda.so.1"

STATES = {0: "RUNNING", 1: "LOCKED", 2: "CHECKPOINTED", 3: "FAILED"}


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def build() -> Path:
    """Compile the fake library with gcc (once per source change); returns its path."""
    if LIBRARY.exists() and LIBRARY.stat().st_mtime >= SOURCE.stat().st_mtime:
        return LIBRARY
    cc = compiler()
    if not cc:
        raise RuntimeError("no C compiler (gcc or $CC) to build the fake libcuda.so.1")
    BUILD.mkdir(exist_ok=True)
    tmp = BUILD / f"libcuda.so.1.{os.getpid()}"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-o", str(tmp), str(SOURCE)], check=True)
    os.replace(tmp, LIBRARY)
    return LIBRARY


@dataclass
class FakeCuda:
    """The fake's state folder: what each process's state is, what was called on it, and faults to inject."""

    state_dir: Path

    def env(self, version: int | None = None) -> dict[str, str]:
        """Environment that makes jupyter_gpulease.worker.suspend (and a child's cuInit) use the fake."""
        env = {"GPULEASE_LIBCUDA": str(build()), "FAKE_CUDA_STATE_DIR": str(self.state_dir)}
        if version is not None:
            env["FAKE_CUDA_DRIVER_VERSION"] = str(version)
        return env

    def state(self, pid: int) -> str | None:
        """RUNNING / LOCKED / CHECKPOINTED of a process that called cuInit through the fake, else None."""
        try:
            text = (self.state_dir / str(pid)).read_text()
        except FileNotFoundError:
            return None
        return STATES[int(text.split()[1])]

    def lost(self, pid: int) -> bool:
        return (self.state_dir / str(pid)).read_text().split()[3] == "1"

    def calls(self, pid: int) -> list[str]:
        """The checkpoint calls made on ``pid``, in order: "lock 60000 0", "restore GPU-a>GPU-b 0", ..."""
        try:
            return (self.state_dir / f"{pid}.calls").read_text().splitlines()
        except FileNotFoundError:
            return []

    def fail(self, pid: int, call: str, rc: int) -> None:
        """Make ``call`` (lock | checkpoint | restore | unlock) on ``pid`` return ``rc`` and change nothing."""
        with open(self.state_dir / f"{pid}.fail", "a") as f:
            f.write(f"{call} {rc}\n")

    def oom(self, on: bool = True) -> None:
        """While on, a restore fails with CUDA_ERROR_OUT_OF_MEMORY (and that process's state is lost)."""
        path = self.state_dir / "oom"
        if on:
            path.touch()
        else:
            path.unlink(missing_ok=True)
