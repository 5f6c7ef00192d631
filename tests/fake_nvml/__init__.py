"""Build the fake libnvidia-ml.so.1 and write the state it reports (see fake_nvml.c)."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).parent
SOURCE = HERE / "fake_nvml.c"
BUILD = HERE / "build"
LIBRARY = BUILD / "libnvidia-ml.so.1"


def build() -> Path:
    """Compile the fake library with gcc (once per source change); returns its path."""
    if LIBRARY.exists() and LIBRARY.stat().st_mtime >= SOURCE.stat().st_mtime:
        return LIBRARY
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not cc:
        raise RuntimeError("no C compiler (gcc or $CC) to build the fake libnvidia-ml.so.1")
    BUILD.mkdir(exist_ok=True)
    tmp = BUILD / f"libnvidia-ml.so.1.{os.getpid()}"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-Wall", "-Werror",
                    "-o", str(tmp), str(SOURCE), "-lpthread"], check=True)
    os.replace(tmp, LIBRARY)
    return LIBRARY


@dataclass
class FakeMig:
    """A MIG device (a slice of a GPU in MIG mode) at ``index`` (0-6) on its GPU."""

    index: int
    profile: str = "1g.10gb"
    memory_total: int = 10 << 30
    uuid: str = ""  # default: MIG-fa4e<gpu>-<index>-4000-8000-000000000000


@dataclass
class FakeGpu:
    uuid: str
    name: str = "NVIDIA H100 80GB HBM3 (fake)"
    memory_total: int = 80 << 30
    memory_used: int = 512 << 20  # baseline with no process
    util: tuple[int, int] = (0, 0)
    mig: int | None = None
    nvlink: int = -1
    pci_switch: int = 0
    numa: int = 0
    proc_util: bool = True
    lost: bool = False
    migs: list[FakeMig] = field(default_factory=list)  # MIG devices (NVML lists them only while mig == 1)


@dataclass
class FakeProc:
    gpu: int
    pid: int
    memory: int = 256 << 20
    kind: str = "compute"
    sm: int = 0
    mem_util: int = 0
    mig: int = -1  # the MIG device (its index on the GPU) it runs on; -1: the whole GPU


@dataclass
class FakeNvml:
    """The state file of the fake library: change fields, then ``write()`` (atomic rename)."""

    path: Path
    gpus: list[FakeGpu] = field(default_factory=list)
    procs: list[FakeProc] = field(default_factory=list)
    driver: str = "550.54.15-fake"
    init_error: int = 0

    @classmethod
    def standard(cls, path: Path, n: int = 4, nvlink_pairs: bool = True) -> "FakeNvml":
        """``n`` GPUs; NVLink pairs (0-1, 2-3, ...) on one PCIe switch each, two NUMA nodes."""
        gpus = [
            FakeGpu(uuid=f"GPU-fa4e{i:04x}-0000-4000-8000-00000000000{i % 10}",
                    nvlink=i // 2 if nvlink_pairs else -1, pci_switch=i // 2, numa=i * 2 // max(n, 1))
            for i in range(n)
        ]
        return cls(Path(path), gpus).write()

    def split(self, gpu: int, profiles: list[tuple[str, int]]) -> list[str]:
        """Turn MIG mode on for GPU ``gpu`` with these (profile, bytes) MIG devices; returns their UUIDs."""
        g = self.gpus[gpu]
        g.mig = 1
        g.migs = [FakeMig(k, p, b, f"MIG-fa4e{gpu:04x}-{k:04x}-4000-8000-000000000000") for k, (p, b) in
                  enumerate(profiles)]
        self.write()
        return [m.uuid for m in g.migs]

    def env(self) -> dict[str, str]:
        """Environment for a broker process that should load this fake driver."""
        return {"LD_LIBRARY_PATH": str(build().parent), "FAKE_NVML_STATE": str(self.path)}

    def proc(self, pid: int) -> FakeProc | None:
        return next((p for p in self.procs if p.pid == pid), None)

    def write(self) -> "FakeNvml":
        lines = [f"driver {self.driver}"]
        if self.init_error:
            lines.append(f"init_error {self.init_error}")
        for i, g in enumerate(self.gpus):
            lines += [f"gpu {i} uuid {g.uuid}", f"gpu {i} name {g.name}", f"gpu {i} memory_total {g.memory_total}",
                      f"gpu {i} memory_used {g.memory_used}", f"gpu {i} util {g.util[0]} {g.util[1]}",
                      f"gpu {i} nvlink {g.nvlink}", f"gpu {i} pci_switch {g.pci_switch}", f"gpu {i} numa {g.numa}",
                      f"gpu {i} proc_util {int(g.proc_util)}", f"gpu {i} lost {int(g.lost)}"]
            if g.mig is not None:
                lines.append(f"gpu {i} mig {g.mig}")
            for m in g.migs:
                lines.append(f"mig {i} {m.index} {m.profile} {m.memory_total} {m.uuid}".rstrip())
        for p in self.procs:
            lines.append(f"proc {p.gpu} {p.pid} {p.memory} {p.kind} {p.sm} {p.mem_util} {p.mig}")
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("\n".join(lines) + "\n")
        os.replace(tmp, self.path)
        return self
