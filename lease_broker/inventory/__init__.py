"""Inventories: where the GPUs come from (NVML on a real host, a simulated one, a Ray or Slurm cluster).

An inventory is a small configurable class chosen by entry-point name (group
``jupyter_gpulease.inventories``, registered in ``pyproject.toml``; ``LeaseBroker.inventory_class``).
The broker owns leases and policy; the inventory only reports devices, samples what they are doing, says when a GPU
that a lease held is clean again, and, for an engine (Ray, Slurm), is told of
grants and ends and answers with what changed (``changes``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from traitlets import Float, Unicode
from traitlets.config import LoggingConfigurable

from ..core.gpu import GPU, GpuSample
from ..core.lease import Lease
from ..host.procs import ProcessTracker
from .changes import InventoryChange


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
        #: Set by the lease owner: ask for a ``reconcile()`` soon. Safe to call from any thread.
        self.wake: Callable[[], None] = lambda: None

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

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "simulated": self.simulated}

    # --- what the lease owner tells an inventory, and what it asks back ------------------------
    # The owner calls these on the event loop. An inventory keeps its own state (an engine's placements) and
    # reports changes of the engine only through reconcile()'s answer; it never changes a lease.
    def on_grant(self, lease: Lease, now: float) -> None:
        """A lease was granted these devices (engines place it now)."""

    def on_renew(self, lease: Lease, now: float) -> None:
        """A holding lease's time limit grew."""

    def on_end(self, lease: Lease) -> None:
        """A lease ended (engines release its placement); it holds nothing any more."""
        self.forget(lease.id)

    def forget(self, lease_id: str) -> None:
        """Drop what ``lease_active`` keeps of a lease (its processes' CPU counters)."""
        self.procs.forget(lease_id)

    def reconcile(self, leases: Mapping[str, Lease], now: float) -> list[InventoryChange]:
        """Called on every tick (and soon after ``wake()``): the engine's changes since the last call.
        ``leases``: the live leases, to read."""
        return []

    def placement(self, lease: Lease) -> dict[str, Any] | None:
        """Where a holding lease was placed, for its holder (the lease view's ``placement``); None: here."""
        return None

    def close(self) -> None:
        pass
