"""A GPU as an inventory reports it (static facts) and what it is doing now (a sample)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class GPU:
    """A device as the inventory reports it (static facts)."""

    id: str  # stable identifier: the NVML UUID, or a synthetic one
    index: int  # index on its node, as CUDA_VISIBLE_DEVICES would count
    node: str
    name: str
    memory_total: int  # bytes
    link_group: str = ""  # GPUs of one group are best connected (NVLink island / PCIe switch)
    simulated: bool = False
    mig: bool = False  # a MIG device (a slice of a GPU in MIG mode): CUDA shows a process only one of them
    parent: str = ""  # a MIG device's physical GPU (its UUID); never leased itself while it is split


@dataclasses.dataclass
class GpuSample:
    """What a device is doing now."""

    memory_used: int = 0
    utilization: float = 0.0  # percent
    pids: dict[int, int] = dataclasses.field(default_factory=dict)  # pid -> bytes used
    healthy: bool = True
    proc_util: dict[int, float] | None = None  # pid -> SM utilisation percent; None: no per-process counters
    utilization_known: bool = True  # False: the device has no utilisation counter (a MIG slice)
