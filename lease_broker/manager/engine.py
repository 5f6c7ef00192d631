"""Applying what an engine's inventory reports (``inventory.changes``) through the lease owner, and asking the
inventory for it on every tick and soon after it calls ``wake()`` (from any thread)."""

from __future__ import annotations

import logging

from ..core.clock import Clock
from ..core.driver import Driver
from ..core.lease import HOLDING, LeaseState
from ..inventory import Inventory
from ..inventory.changes import GpusChanged, GpusClosed, InventoryChange, LeaseFailed, LeasePlaced
from .enforcer import Enforcer
from .state import LeaseOps, LiveState

log = logging.getLogger("lease_broker")


class EngineLink:
    def __init__(self, *, state: LiveState, ops: LeaseOps, inventory: Inventory, enforcer: Enforcer,
                 clock: Clock, driver: Driver) -> None:
        self.state, self.ops, self.inventory, self.enforcer, self.clock = state, ops, inventory, enforcer, clock
        self.driver = driver  # its loop, once the service attached one: where an inventory's news is applied
        inventory.wake = self.wake

    def reconcile(self) -> None:
        """Ask the inventory what changed in its engine and apply it."""
        self.apply(self.inventory.reconcile(self.state.leases, self.clock.now()))

    def apply(self, changes: list[InventoryChange]) -> None:
        if not changes:
            return
        leases = self.state.leases
        for change in changes:
            if isinstance(change, GpusChanged):
                self.ops.set_gpus(list(change.gpus))
            elif isinstance(change, GpusClosed):
                self.enforcer.set_closed(dict(change.reasons))
            elif (lease := leases.get(change.lease_id)) is not None and lease.state in HOLDING:
                if isinstance(change, LeaseFailed):
                    log.error("Lease %s: %s", lease.id, change.reason)
                    self.ops.end(lease, LeaseState.FAILED, change.reason)
                elif isinstance(change, LeasePlaced):
                    self.ops.placed(lease, change.devices)
        self.ops.schedule_soon()
        self.ops.gpus_changed()

    def wake(self) -> None:
        """The inventory has news (from any thread): reconcile on the event loop soon."""
        loop = self.driver.loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self.reconcile)
            except RuntimeError:
                pass
