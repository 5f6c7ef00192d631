"""The NVML calls of the NVML inventory (``nvml.py``) that read one device: processes, MIG mode, links.

``pynvml`` is imported at first use: every broker imports the NVML inventory (its traits are configurable), and
importing pynvml costs ~20 ms of each start, also for brokers that never touch NVML.
"""

from __future__ import annotations

from typing import Any


class _LazyPynvml:
    """``pynvml``, imported at first use."""

    def __getattr__(self, name: str) -> Any:
        import pynvml as module

        globals()["pynvml"] = module
        return getattr(module, name)


_NVLINK_MAX_PROBE = 18  # links to probe per device (H100 SXM has 18)


pynvml: Any = _LazyPynvml()


def processes(h: Any) -> dict[int, int]:
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


def mig_enabled(h: Any) -> bool:
    try:
        current, _pending = pynvml.nvmlDeviceGetMigMode(h)
    except pynvml.NVMLError:
        return False  # NOT_SUPPORTED on GPUs without MIG
    return bool(current == pynvml.NVML_DEVICE_MIG_ENABLE)


def has_nvlink(h: Any) -> bool:
    for link in range(_NVLINK_MAX_PROBE):
        try:
            if pynvml.nvmlDeviceGetNvLinkState(h, link) == pynvml.NVML_FEATURE_ENABLED:
                return True
        except pynvml.NVMLError:
            return False
    return False


def p2p_nvlink(a: Any, b: Any) -> bool:
    try:
        status = pynvml.nvmlDeviceGetP2PStatus(a, b, pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
    except pynvml.NVMLError:
        return False
    return bool(status == pynvml.NVML_P2P_STATUS_OK)


def common_ancestor(a: Any, b: Any) -> int:
    try:
        return int(pynvml.nvmlDeviceGetTopologyCommonAncestor(a, b))
    except pynvml.NVMLError:
        return pynvml.NVML_TOPOLOGY_SYSTEM
