"""The narrow interface every part of the broker is given instead of the manager: what it may ask of the lease
owner. The owner (``LeaseManager``) implements it; parts read :class:`~lease_broker.manager.state.LiveState`."""

from __future__ import annotations

from typing import Protocol

from ..core.gpu import GPU
from ..core.lease import Lease, LeaseState
from ..core.lease_use import LeaseUse


class LeaseOps(Protocol):
    def end(self, lease: Lease, target: LeaseState, reason: str) -> None:
        """End a lease (persisted and published), stop its processes and hand its GPUs on."""

    def mark_idle(self, lease: Lease) -> None:
        """A holding lease showed no activity for ``idle_mark_seconds``."""

    def activity(self, lease: Lease, now: float) -> None:
        """A holding lease did work at ``now``."""

    def used(self, lease: Lease, use: LeaseUse) -> None:
        """A holding lease's usage figures grew (kept in memory; stored with its next transition)."""

    def schedule_soon(self) -> None:
        """GPUs or policy changed: run a scheduling pass soon (once for all changes of this loop iteration)."""

    def placed(self, lease: Lease, devices: tuple[str, ...] | None) -> None:
        """An engine placed a granted lease (on ``devices`` when it chose others than the broker)."""

    def set_gpus(self, gpus: list[GPU]) -> None:
        """The inventory's GPUs changed (a node joined or left)."""

    def replan(self) -> None:
        """The policy or the reservations changed: the next pass (soon) is a full one over the whole queue."""

    def gpus_changed(self) -> None:
        """The GPUs' states changed: publish the GPU summary (throttled)."""
