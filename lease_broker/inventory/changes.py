"""What an inventory tells the broker after it looked at its engine: changes the lease owner applies.

An inventory never changes a lease, the GPU table or the store. Its ``reconcile()`` returns these, and the
manager applies them through its one mutation path, in order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ..core.gpu import GPU


@dataclasses.dataclass(frozen=True)
class LeaseFailed:
    """The engine lost or refused a holding lease's GPUs: the lease fails with ``reason``."""

    lease_id: str
    reason: str


@dataclasses.dataclass(frozen=True)
class LeasePlaced:
    """The engine placed a granted lease; ``devices``: the GPUs it picked, if not the broker's choice."""

    lease_id: str
    devices: tuple[str, ...] | None = None


@dataclasses.dataclass(frozen=True)
class GpusChanged:
    """The engine's GPUs changed (a node joined or left): the new inventory, in a stable order."""

    gpus: tuple[GPU, ...]


@dataclasses.dataclass(frozen=True)
class GpusClosed:
    """Every GPU the engine takes no new leases on now, with why (replaces what it said before)."""

    reasons: Mapping[str, str]


InventoryChange = LeaseFailed | LeasePlaced | GpusChanged | GpusClosed
