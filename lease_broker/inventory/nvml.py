"""The GPUs of this host, through NVML (the NVIDIA driver's management library, via pynvml).

The only module of the broker that imports ``pynvml``. Every NVML call here blocks, so
the broker calls ``discover`` once at start and ``sample`` in an executor thread;
``lease_active`` and ``is_drained`` only read the samples and ``/proc``.

Activity of a lease = the GPU utilisation (SM) or memory-controller utilisation
("memory traffic") of the lease's processes and their descendants, averaged over
``activity_window_seconds``. Where the driver has no per-process counters (MIG,
older GPUs), the device's utilisation counts when only the lease's processes are on it.

MIG: a GPU in MIG mode is not a device here; each of its MIG devices (``MIG-…`` UUIDs, a profile such as
``1g.10gb``, their own memory) is, and a lease holds it alone (CUDA shows a process one MIG device). NVML has
no utilisation counters for MIG devices (neither per device nor per process; only DCGM/GPM profiling has
them), so a lease on one counts as active when its processes used CPU time (``activity_cpu_seconds``, as on
the simulated inventory) while NVML lists them on the slice; memory and processes come per MIG device.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..core.errors import LeaseError
from ..core.gpu import GPU, GpuSample
from ..core.lease import parse_size
from ..host.procs import is_descendant, proc_info
from ..policy.numbers import Float, Size
from . import Inventory
from .nvml_calls import common_ancestor, has_nvlink, mig_enabled, p2p_nvlink, processes, pynvml

_LOST_NAMES = ("NVML_ERROR_GPU_IS_LOST", "NVML_ERROR_UNKNOWN", "NVML_ERROR_RESET_REQUIRED")


@dataclass
class _Point:
    """One sample of one device, kept for the activity window."""

    at: float
    pids: dict[int, int]
    proc_util: dict[int, tuple[float, float]] | None  # None: no per-process counters
    util: float
    mem_util: float


@dataclass
class _Device:
    gpu: GPU
    handle: Any  # a MIG device's own handle for a MIG device
    baseline: int  # bytes used with no process on it (driver reservations)
    history: deque[_Point] = field(default_factory=deque)
    last_ts: int = 0  # NVML timestamp (us) of the newest per-process sample seen
    healthy: bool = True
    sampled_at: float = 0.0


class NVMLInventory(Inventory):
    kind = "nvml"
    simulated = False

    activity_gpu_percent = Float(
        5.0,
        max=100.0,
        config=True,
        help="GPU (SM) utilisation in percent of a lease's processes, averaged over activity_window_seconds, "
        "at or above which the lease counts as active. 0 = any process on the GPU counts as activity. Example: 5.",
    )
    activity_memory_percent = Float(
        5.0,
        max=100.0,
        config=True,
        help="Memory-controller utilisation (memory traffic) in percent of a lease's processes, averaged over "
        "activity_window_seconds, at or above which the lease counts as active. 0 = ignore memory traffic "
        "(only activity_gpu_percent counts). Example: 5.",
    )
    activity_window_seconds = Float(
        10.0,
        config=True,
        help="Seconds of NVML samples averaged to decide whether a lease is active. 0 = only the latest "
        "sample. Example: 10.",
    )
    drain_memory_slack = Size(
        "256M",
        config=True,
        help="Memory above a GPU's baseline (what it used with no process at start) that still counts as "
        "drained after a lease ends, e.g. '256M'. '0' = memory must be back to the baseline exactly.",
    )

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._lock = threading.Lock()
        self._devices: dict[str, _Device] = {}
        self._initialized = False
        self.driver_version = ""
        self._clean_since: dict[tuple[str, tuple[int, ...]], float] = {}

    # ------------------------------------------------------------------ discovery
    def _init(self) -> None:
        if self._initialized:
            return
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            raise LeaseError(
                f"NVML could not start ({e}): install or load the NVIDIA driver, or start with "
                "--inventory=simulated for simulated GPUs",
                reason="no_driver",
            ) from e
        self._initialized = True
        try:
            self.driver_version = str(pynvml.nvmlSystemGetDriverVersion())
        except pynvml.NVMLError as e:
            self.log.warning("NVML: driver version unavailable: %s", e)

    def discover(self) -> list[GPU]:
        self._init()
        count = pynvml.nvmlDeviceGetCount()
        found: list[tuple[Any, str, int, str, int]] = []
        split: list[tuple[Any, str, int, str]] = []  # GPUs in MIG mode: their MIG devices are the devices
        for i in range(count):
            try:
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                uuid = str(pynvml.nvmlDeviceGetUUID(h))
                index = int(pynvml.nvmlDeviceGetIndex(h))
                name = str(pynvml.nvmlDeviceGetName(h))
                total = int(pynvml.nvmlDeviceGetMemoryInfo(h).total)
            except pynvml.NVMLError as e:
                self.log.error("GPU %d: not usable, left out of the inventory: %s", i, e)
                continue
            if mig_enabled(h):
                split.append((h, uuid, index, name))
            else:
                found.append((h, uuid, index, name, total))
        groups = self._link_groups([f[0] for f in found])
        devices: dict[str, _Device] = {}
        for (h, uuid, index, name, total), group in zip(found, groups, strict=True):
            gpu = GPU(id=uuid, index=index, node=self.node_name, name=name, memory_total=total,
                      link_group=f"{self.node_name}/{group}")
            devices[uuid] = _Device(gpu, h, baseline=self._baseline(h))
            self.log.info("GPU %s: index %d, %s, %d MiB, link group %s", uuid, index, name, total >> 20, group)
        for h, uuid, index, name in split:
            for gpu, mh in self._mig_devices(h, uuid, index, name):
                devices[gpu.id] = _Device(gpu, mh, baseline=self._baseline(mh))
        with self._lock:
            self._devices = devices
        return [d.gpu for d in sorted(devices.values(), key=lambda d: (d.gpu.index, d.gpu.mig, d.gpu.id))]

    def _mig_devices(self, h: Any, parent: str, index: int, name: str) -> list[tuple[GPU, Any]]:
        """The MIG devices of a GPU in MIG mode (none configured: nothing of it to lease, said in the log)."""
        out: list[tuple[GPU, Any]] = []
        try:
            slots = int(pynvml.nvmlDeviceGetMaxMigDeviceCount(h))
        except pynvml.NVMLError as e:
            self.log.error("GPU %s: in MIG mode, but its MIG devices cannot be listed (%s): left out", parent, e)
            return out
        for k in range(slots):
            try:
                mh = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, k)
            except pynvml.NVMLError as e:
                if e.value != pynvml.NVML_ERROR_NOT_FOUND:
                    self.log.error("GPU %s: MIG device %d not usable: %s", parent, k, e)
                continue
            try:
                uuid = str(pynvml.nvmlDeviceGetUUID(mh))
                mig_name = str(pynvml.nvmlDeviceGetName(mh))
                total = int(pynvml.nvmlDeviceGetMemoryInfo(mh).total)
            except pynvml.NVMLError as e:
                self.log.error("GPU %s: MIG device %d not usable: %s", parent, k, e)
                continue
            gpu = GPU(id=uuid, index=index, node=self.node_name, name=mig_name, memory_total=total,
                      link_group=f"{self.node_name}/mig{index}", mig=True, parent=parent)
            out.append((gpu, mh))
            self.log.info("GPU %s: index %d, MIG device %s: %s, %d MiB", parent, index, uuid, mig_name, total >> 20)
        if not out:
            self.log.warning("GPU %s (index %d, %s) is in MIG mode without MIG devices: nothing of it can be leased "
                             "(create GPU and compute instances with nvidia-smi mig, or turn MIG mode off)",
                             parent, index, name)
        return out

    def _baseline(self, h: Any) -> int:
        try:
            used = int(pynvml.nvmlDeviceGetMemoryInfo(h).used)
            procs = sum(p for p in processes(h).values())
        except pynvml.NVMLError:
            return 0
        return max(0, used - procs)

    def _link_groups(self, handles: list[Any]) -> list[str]:
        """Name the best-connected group of each device: NVLink islands, else PCIe switches."""
        n = len(handles)
        parent = list(range(n))

        def find(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        nvlinked = [has_nvlink(h) for h in handles]
        kind = ["pci"] * n
        for i in range(n):
            for j in range(i + 1, n):
                if nvlinked[i] and nvlinked[j] and p2p_nvlink(handles[i], handles[j]):
                    parent[find(j)] = find(i)
                    kind[i] = kind[j] = "nvl"
        for i in range(n):
            for j in range(i + 1, n):
                if kind[i] == kind[j] == "pci" and common_ancestor(handles[i], handles[j]) <= \
                        pynvml.NVML_TOPOLOGY_HOSTBRIDGE:
                    parent[find(j)] = find(i)
        names: dict[int, str] = {}
        out = []
        for i in range(n):
            root = find(i)
            if root not in names:
                names[root] = f"{kind[root]}{sum(1 for v in names.values() if v.startswith(kind[root]))}"
            out.append(names[root])
        return out

    # ------------------------------------------------------------------ sampling (executor thread)
    def sample(self) -> dict[str, GpuSample]:
        with self._lock:
            devices = list(self._devices.values())
        now = time.monotonic()
        out: dict[str, GpuSample] = {}
        for dev in devices:
            try:
                mem = pynvml.nvmlDeviceGetMemoryInfo(dev.handle)
                rates = _utilisation(dev)
                pids = processes(dev.handle)
                proc_util = None if dev.gpu.mig else self._proc_util(dev)
            except pynvml.NVMLError as e:
                if e.value in {getattr(pynvml, n) for n in _LOST_NAMES}:
                    if dev.healthy:
                        self.log.error("GPU %s (index %d) lost: %s; it will not be granted", dev.gpu.id,
                                       dev.gpu.index, e)
                    dev.healthy = False
                    out[dev.gpu.id] = GpuSample(healthy=False)
                else:
                    self.log.warning("GPU %s: sampling failed: %s", dev.gpu.id, e)
                continue
            if not dev.healthy:
                self.log.info("GPU %s answers NVML again", dev.gpu.id)
                dev.healthy = True
            point = _Point(now, pids, proc_util, float(rates.gpu), float(rates.memory))
            with self._lock:
                dev.history.append(point)
                dev.sampled_at = now
                horizon = now - max(self.activity_window_seconds, 1.0) - 1.0
                while dev.history and dev.history[0].at < horizon:
                    dev.history.popleft()
            out[dev.gpu.id] = GpuSample(memory_used=int(mem.used), utilization=float(rates.gpu), pids=pids,
                                        healthy=True, utilization_known=not dev.gpu.mig,
                                        proc_util={p: u[0] for p, u in proc_util.items()} if proc_util is not None
                                        else None)
        return out

    def _proc_util(self, dev: _Device) -> dict[int, tuple[float, float]] | None:
        try:
            samples = pynvml.nvmlDeviceGetProcessUtilization(dev.handle, dev.last_ts)
        except pynvml.NVMLError as e:
            if e.value == pynvml.NVML_ERROR_NOT_FOUND:
                return {}  # no process ran since the last sample
            if e.value == pynvml.NVML_ERROR_NOT_SUPPORTED:
                return None
            raise
        out: dict[int, tuple[float, float]] = {}
        for s in samples:
            dev.last_ts = max(dev.last_ts, int(s.timeStamp))
            sm, mu = out.get(int(s.pid), (0.0, 0.0))
            out[int(s.pid)] = (max(sm, float(s.smUtil)), max(mu, float(s.memUtil)))
        return out

    # ------------------------------------------------------------------ leases (event loop: no NVML)
    def lease_active(self, lease_id: str, pids: list[int], samples: dict[str, GpuSample], devices: list[str]) -> bool:
        with self._lock:
            mig = [self._devices[d] for d in devices if d in self._devices and self._devices[d].gpu.mig]
        if mig:  # no utilisation counters: CPU time of the lease's processes while NVML lists them on the slice
            on_slice = any(_belongs(q, pids) for d in mig if d.history for q in d.history[-1].pids)
            return super().lease_active(lease_id, pids, samples, devices) and on_slice
        now = time.monotonic()
        window = self.activity_window_seconds
        best_sm = best_mem = 0.0
        seen = False
        with self._lock:
            histories = [(d, list(self._devices[d].history)) for d in devices if d in self._devices]
        for _gpu, history in histories:
            points = [p for p in history if p.at >= now - window] if window else history[-1:]
            sm = mem = 0.0
            for p in points:
                mine = [q for q in p.pids if _belongs(q, pids)]
                if mine:
                    seen = True
                if p.proc_util is None:
                    if mine and len(mine) == len(p.pids):  # whole device is the lease's
                        sm += p.util
                        mem += p.mem_util
                else:
                    mine_util = [u for q, u in p.proc_util.items() if q in mine or _belongs(q, pids)]
                    sm += sum(u[0] for u in mine_util)
                    mem += sum(u[1] for u in mine_util)
            if points:
                best_sm = max(best_sm, sm / len(points))
                best_mem = max(best_mem, mem / len(points))
        if not seen:
            return False
        if self.activity_gpu_percent == 0:
            return True
        return best_sm >= self.activity_gpu_percent or (
            self.activity_memory_percent > 0 and best_mem >= self.activity_memory_percent
        )

    def is_drained(self, gpu_id: str, pids: list[int], samples: dict[str, GpuSample]) -> bool:
        """Clean when the lease's processes are gone, and a sample taken after they went shows none of
        them on the GPU and its memory (less other processes') back to the baseline."""
        key = (gpu_id, tuple(sorted(pids)))
        if self.procs.any_alive(pids):
            self._clean_since.pop(key, None)
            return False
        gone_at = self._clean_since.setdefault(key, time.monotonic())
        with self._lock:
            dev = self._devices.get(gpu_id)
            if dev is None or dev.sampled_at <= gone_at or not dev.history:
                return False
            latest = dev.history[-1]
        if any(p in latest.pids for p in pids):
            return False
        s = samples.get(gpu_id)
        if s is not None and s.healthy:
            others = sum(latest.pids.values())
            if s.memory_used - others > dev.baseline + parse_size(self.drain_memory_slack):
                return False
        self._clean_since.pop(key, None)
        return True

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "simulated": False, "driver_version": self.driver_version}

    def close(self) -> None:
        if self._initialized:
            try:
                pynvml.nvmlShutdown()
            except pynvml.NVMLError as e:
                self.log.warning("NVML shutdown failed: %s", e)
            self._initialized = False


def _belongs(pid: int, pids: list[int]) -> bool:
    return pid in pids or any(is_descendant(pid, a) for a in pids if proc_info(a) is not None)


class _Rates:
    def __init__(self, gpu: float, memory: float) -> None:
        self.gpu, self.memory = gpu, memory


def _utilisation(dev: _Device) -> Any:
    """The device's utilisation rates; zero for a MIG device (NVML has no counters for one)."""
    if dev.gpu.mig:
        return _Rates(0.0, 0.0)
    return pynvml.nvmlDeviceGetUtilizationRates(dev.handle)
