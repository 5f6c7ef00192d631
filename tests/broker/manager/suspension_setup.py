"""The setup the preemption-by-suspension tests share: users, and a real LeaseManager with suspension on
(``preempt_mode = "suspend"``, no minimum runtime) on a virtual clock, an in-memory store and simulated GPUs."""

from __future__ import annotations

from typing import Any

from lease_broker.core.clock import VirtualClock
from lease_broker.core.identity import Identity
from lease_broker.inventory.simulated import SimulatedInventory
from lease_broker.manager.manager import LeaseManager
from lease_broker.policy.lease_policy import LeasePolicy
from lease_broker.store.lease_store import Store

ALICE = Identity("alice", uid=1001)
BOB = Identity("bob", uid=1002)
CAROL = Identity("carol", uid=1003)
DAVE = Identity("dave", uid=1004)
ERIN = Identity("erin", uid=1005)


def suspending_manager(gpus: int = 4, nodes: int = 1, cluster: str = "", **policy: Any) -> tuple[LeaseManager,
                                                                                                  VirtualClock]:
    """(manager, its clock): ``gpus`` on ``nodes`` (or the simulated ``cluster`` spec), ``policy`` over the
    suspension defaults; nothing times out by itself (heartbeats, idleness)."""
    clock = VirtualClock()
    pol = LeasePolicy(**{"heartbeat_timeout": 1e9, "default_idle_timeout_seconds": 0, "unix_groups": False,
                         "preempt_mode": "suspend", "suspend_min_runtime_seconds": 0.0, **policy})
    inv = SimulatedInventory(cluster=cluster) if cluster else SimulatedInventory(gpus=gpus, nodes=nodes)
    m = LeaseManager(Store(":memory:"), inv, pol, clock=clock)
    m.restore()
    return m, clock


def report_suspended(m: LeaseManager, lease: Any) -> None:
    """Its holder reports its processes suspended (``POST .../suspended``), as a kernel does once asked."""
    m.suspended(lease.id, Identity(lease.user, uid=lease.uid), {"ok": True, "how": "stop"})
