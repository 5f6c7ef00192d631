"""Preemption by suspension gives what it freed to the request it suspended for (``suspend_grant_asker``): without it
the freed GPUs go to whoever is first in queue order (on the contended month often a gang whose reservation they
complete) and the small cell asks again. Through the real LeaseManager on a virtual clock and an in-memory store."""

from __future__ import annotations

import pytest

from lease_broker.core.clock import VirtualClock
from lease_broker.core.identity import Identity
from lease_broker.core.lease import LeaseState
from lease_broker.inventory.simulated import SimulatedInventory
from lease_broker.manager.manager import LeaseManager
from lease_broker.policy.lease_policy import LeasePolicy
from lease_broker.store.lease_store import Store

ALICE = Identity("alice", uid=1001)
BOB = Identity("bob", uid=1002)
CAROL = Identity("carol", uid=1003)
DAVE = Identity("dave", uid=1004)


@pytest.mark.parametrize("asker", [True, False])
def test_the_gpus_a_suspension_freed_go_to_the_request_it_was_for(asker):
    clock = VirtualClock()
    pol = LeasePolicy(heartbeat_timeout=1e9, default_idle_timeout_seconds=0, unix_groups=False, preempt_mode="suspend",
                      suspend_min_runtime_seconds=0.0, suspend_max_gpus=1, suspend_grant_asker=asker)
    m = LeaseManager(Store(":memory:"), SimulatedInventory(gpus=4, nodes=1), pol, clock=clock)
    m.restore()
    alice, _ = m.request(ALICE, {"gpus": 2, "duration_seconds": 36000, "suspendable": True})
    bob, _ = m.request(BOB, {"gpus": 2, "duration_seconds": 36000})  # (not suspendable)
    clock.advance(10)
    dave, _ = m.request(DAVE, {"gpus": 2, "duration_seconds": 3600})  # waits first; too big to suspend anyone
    clock.advance(10)
    cell, _ = m.request(CAROL, {"gpus": 1, "duration_seconds": 600})
    assert alice.suspension is not None and alice.suspension.by_lease == cell.id
    m.suspended(alice.id, Identity(alice.user, uid=alice.uid), {"ok": True, "how": "stop"})
    assert alice.state == LeaseState.SUSPENDED
    if asker:  # carol's cell gets one of alice's GPUs; dave's 2-GPU request still waits for two
        assert cell.state == LeaseState.GRANTED and set(cell.devices) <= set(alice.suspension.devices)
        assert dave.state == LeaseState.QUEUED
    else:  # dave, first in the queue, takes both; carol's cell waits with no one left to suspend
        assert dave.state == LeaseState.GRANTED and cell.state == LeaseState.QUEUED
    clock.advance(60)
    m.release(cell.id, CAROL)  # (a queued request's release withdraws it)
    m.release(dave.id, DAVE)
    # either way alice's lease resumes once GPUs of its model are free again, and no GPU is in two leases
    assert alice.state == LeaseState.GRANTED and alice.reason == "resumed"
    held = [d for x in m.leases.values() if x.state == LeaseState.GRANTED for d in x.devices]
    assert len(held) == len(set(held)) == 4
