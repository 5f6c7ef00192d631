"""Inventories: where the GPUs come from (NVML on a real host, a simulated one, a Ray or Slurm cluster).

An inventory is a small configurable class chosen by entry-point name
(group ``jupyter_gpulease.inventories``). The broker owns leases and policy; the
inventory only reports devices, samples what they are doing, and says when a GPU
that a lease held is clean again.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from traitlets import Float, Unicode
from traitlets.config import LoggingConfigurable

from ..host.procs import ProcessTracker

ENTRY_POINT_GROUP = "jupyter_gpulease.inventories"


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
    mig: bool = False


@dataclasses.dataclass
class GpuSample:
    """What a device is doing now."""

    memory_used: int = 0
    utilization: float = 0.0  # percent
    pids: dict[int, int] = dataclasses.field(default_factory=dict)  # pid -> bytes used
    healthy: bool = True


class Inventory(LoggingConfigurable):
    """Base class of inventories."""

    kind = "base"
    simulated = False

    activity_cpu_seconds = Float(
        0.05,
        config=True,
        help="CPU seconds a lease's processes must use between two samples to count as activity "
        "(inventories without per-process GPU counters, e.g. the simulated one). Example: 0.05.",
    )
    node_name = Unicode(
        os.uname().nodename,
        config=True,
        help="Name of this node as shown in grants and the sidebar. Default: the host name.",
    )

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.procs = ProcessTracker()

    # --- what every inventory implements -------------------------------------------------
    def discover(self) -> list[GPU]:
        """The devices, in a stable order. Called at start and when the inventory changes."""
        raise NotImplementedError

    def sample(self) -> dict[str, GpuSample]:
        """Current use of every device, keyed by GPU id. May block: called off the event loop."""
        return {}

    # --- defaults that real inventories refine ------------------------------------------
    def visible_devices(self, gpus: list[GPU]) -> str:
        """The ``CUDA_VISIBLE_DEVICES`` value for a grant of these devices."""
        return ",".join(g.id for g in gpus)

    def lease_active(self, lease_id: str, pids: list[int], samples: dict[str, GpuSample], devices: list[str]) -> bool:
        """Whether a lease's processes did work since the last call (default: CPU time)."""
        return self.procs.cpu_delta(lease_id, pids) >= self.activity_cpu_seconds

    def is_drained(self, gpu_id: str, pids: list[int], samples: dict[str, GpuSample]) -> bool:
        """Whether a GPU a lease held is clean: none of the lease's processes is alive on it."""
        return not self.procs.any_alive(pids)

    def forget(self, lease_id: str) -> None:
        self.procs.forget(lease_id)

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "simulated": self.simulated}

    # --- inventories that place grants on another engine (Ray, Slurm) ---------------------------
    def placement(self, lease: Any) -> dict[str, Any] | None:
        """Where a holding lease was placed, for its holder (the lease view's ``placement``); None: here."""
        return None

    def reconcile(self, manager: Any) -> None:
        """Called on every broker tick, on the event loop: reflect changes of the engine in the manager."""

    def close(self) -> None:
        pass


_BUILTIN = {"simulated": "lease_broker.inventory.simulated:SimulatedInventory",
            "nvml": "lease_broker.inventory.nvml:NVMLInventory",
            "ray": "lease_broker.inventory.ray:RayInventory",
            "slurm": "lease_broker.inventory.slurm:SlurmInventory"}


def inventory_class(name: str) -> type[Inventory]:
    """Load an inventory class: a built-in name, another entry-point name, or ``module:Class``.

    Built-in names are resolved without reading the installed packages' entry points (that costs ~40 ms of
    every broker start).
    """
    if ":" in name:
        import importlib

        mod, _, attr = name.partition(":")
        cls = getattr(importlib.import_module(mod), attr)
    elif name in _BUILTIN:
        return inventory_class(_BUILTIN[name])
    else:
        from importlib.metadata import entry_points

        eps = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
        if name not in eps:
            choices = ", ".join(sorted(set(eps) | set(_BUILTIN) | {"auto"}))
            raise ValueError(f"Unknown inventory {name!r}: choose one of {choices} (--inventory)")
        cls = eps[name].load()
    if not (isinstance(cls, type) and issubclass(cls, Inventory)):
        raise ValueError(f"Inventory {name!r} is not an Inventory subclass")
    return cls
