"""The GPUs of this host, through NVML (the NVIDIA driver's management library, via pynvml).

The only module of the broker that imports ``pynvml``. Every NVML call here blocks, so
the broker calls ``discover`` once at start and ``sample`` in an executor thread;
``lease_active`` and ``is_drained`` only read the samples and ``/proc``.

Activity of a lease = the GPU utilisation (SM) or memory-controller utilisation
("memory traffic") of the lease's processes and their descendants, averaged over
``activity_window_seconds``. Where the driver has no per-process counters (MIG,
older GPUs), the device's utilisation counts when only the lease's processes are on it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from traitlets import Float, Unicode, validate

from ..core.errors import LeaseError
from ..core.gpu import GPU, GpuSample
from ..core.lease import parse_size
from ..host.procs import is_descendant, proc_info
from . import Inventory


class _LazyPynvml:
    """``pynvml``, imported at first use: every broker imports this module (its traits are configurable), and
    importing pynvml costs ~20 ms of each start, also for brokers that never touch NVML."""

    def __getattr__(self, name: str) -> Any:
        import pynvml as module

        globals()["pynvml"] = module
        return getattr(module, name)


pynvml: Any = _LazyPynvml()
_LOST_NAMES = ("NVML_ERROR_GPU_IS_LOST", "NVML_ERROR_UNKNOWN", "NVML_ERROR_RESET_REQUIRED")
_NVLINK_MAX_PROBE = 18  # links to probe per device (H100 SXM has 18)


def nvml_loadable() -> str | None:
    """Why NVML cannot be used here, or None when its library loads and initialises."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return str(e)
    try:
        pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        pass
    return None


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
    handle: Any
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
        config=True,
        help="GPU (SM) utilisation in percent of a lease's processes, averaged over activity_window_seconds, "
        "at or above which the lease counts as active. 0 = any process on the GPU counts as activity. Example: 5.",
    )
    activity_memory_percent = Float(
        5.0,
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
    drain_memory_slack = Unicode(
        "256M",
        config=True,
        help="Memory above a GPU's baseline (what it used with no process at start) that still counts as "
        "drained after a lease ends, e.g. '256M'. '0' = memory must be back to the baseline exactly.",
    )

    @validate("activity_gpu_percent", "activity_memory_percent", "activity_window_seconds")
    def _valid_nonneg(self, proposal: dict[str, Any]) -> float:
        value = float(proposal["value"])
        if value < 0 or (proposal["trait"].name.endswith("percent") and value > 100):
            raise ValueError(f"NVMLInventory.{proposal['trait'].name}={proposal['value']!r}: out of range")
        return value

    @validate("drain_memory_slack")
    def _valid_slack(self, proposal: dict[str, Any]) -> str:
        parse_size(proposal["value"], "NVMLInventory.drain_memory_slack")
        return str(proposal["value"])

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
        found: list[tuple[Any, str, int, str, int, bool]] = []
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
            found.append((h, uuid, index, name, total, _mig_enabled(h)))
        groups = self._link_groups([f[0] for f in found])
        devices: dict[str, _Device] = {}
        for (h, uuid, index, name, total, mig), group in zip(found, groups, strict=True):
            gpu = GPU(id=uuid, index=index, node=self.node_name, name=name, memory_total=total,
                      link_group=f"{self.node_name}/{group}", mig=mig)
            devices[uuid] = _Device(gpu, h, baseline=self._baseline(h))
            self.log.info("GPU %s: index %d, %s, %d MiB, link group %s%s", uuid, index, name, total >> 20,
                          group, ", MIG" if mig else "")
        with self._lock:
            self._devices = devices
        return [d.gpu for d in sorted(devices.values(), key=lambda d: d.gpu.index)]

    def _baseline(self, h: Any) -> int:
        try:
            used = int(pynvml.nvmlDeviceGetMemoryInfo(h).used)
            procs = sum(p for p in _processes(h).values())
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

        nvlinked = [_has_nvlink(h) for h in handles]
        kind = ["pci"] * n
        for i in range(n):
            for j in range(i + 1, n):
                if nvlinked[i] and nvlinked[j] and _p2p_nvlink(handles[i], handles[j]):
                    parent[find(j)] = find(i)
                    kind[i] = kind[j] = "nvl"
        for i in range(n):
            for j in range(i + 1, n):
                if kind[i] == kind[j] == "pci" and _common_ancestor(handles[i], handles[j]) <= \
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
                rates = pynvml.nvmlDeviceGetUtilizationRates(dev.handle)
                pids = _processes(dev.handle)
                proc_util = self._proc_util(dev)
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
                                        healthy=True)
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


def _processes(h: Any) -> dict[int, int]:
    """pid -> bytes of every compute and graphics process on a device."""
    out: dict[int, int] = {}
    for fn in (pynvml.nvmlDeviceGetComputeRunningProcesses, pynvml.nvmlDeviceGetGraphicsRunningProcesses):
        try:
            procs = fn(h)
        except pynvml.NVMLError as e:
            if e.value in (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_NO_PERMISSION):
                continue
            raise
        for p in procs:
            out[int(p.pid)] = out.get(int(p.pid), 0) + int(p.usedGpuMemory or 0)
    return out


def _mig_enabled(h: Any) -> bool:
    try:
        current, _pending = pynvml.nvmlDeviceGetMigMode(h)
    except pynvml.NVMLError:
        return False  # NOT_SUPPORTED on GPUs without MIG
    return bool(current == pynvml.NVML_DEVICE_MIG_ENABLE)


def _has_nvlink(h: Any) -> bool:
    for link in range(_NVLINK_MAX_PROBE):
        try:
            if pynvml.nvmlDeviceGetNvLinkState(h, link) == pynvml.NVML_FEATURE_ENABLED:
                return True
        except pynvml.NVMLError:
            return False
    return False


def _p2p_nvlink(a: Any, b: Any) -> bool:
    try:
        status = pynvml.nvmlDeviceGetP2PStatus(a, b, pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
    except pynvml.NVMLError:
        return False
    return bool(status == pynvml.NVML_P2P_STATUS_OK)


def _common_ancestor(a: Any, b: Any) -> int:
    try:
        return int(pynvml.nvmlDeviceGetTopologyCommonAncestor(a, b))
    except pynvml.NVMLError:
        return pynvml.NVML_TOPOLOGY_SYSTEM
