"""The tick passes over a holding lease that has been quiet for less than ``Enforcer.quiet_for`` (no idle check can
hold for it yet): every idle mark, warning and revocation still comes at the tick of the second it is due, with
and without a request pressing the lease. A real manager on a virtual clock, ticked once a second."""

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


@pytest.mark.parametrize(("policy", "press", "expected"), [
    # mark 5 s, pressure 60 s: idle at 5, warned at 50 (60 - warn_before), revoked at 60
    ({"idle_mark_seconds": 5, "pressure_idle_timeout_seconds": 60, "warn_before_seconds": 10}, True,
     {"idle": 5, "warned": 50, "revoked": 60}),
    # the mark after the pressure timeout: the warning is the first check (quiet_for 50 s)
    ({"idle_mark_seconds": 100, "pressure_idle_timeout_seconds": 60, "warn_before_seconds": 10}, True,
     {"warned": 50, "revoked": 60}),
    # nobody waits: the own timeout (600 s) holds, warned 10 s before it
    ({"idle_mark_seconds": 100, "pressure_idle_timeout_seconds": 60, "warn_before_seconds": 10}, False,
     {"idle": 100, "warned": 590, "revoked": 600}),
    # no pressure timeout, a mark beyond the own timeout: the warning and the revocation only
    ({"idle_mark_seconds": 700, "pressure_idle_timeout_seconds": 0, "warn_before_seconds": 10}, True,
     {"warned": 590, "revoked": 600}),
])
def test_quiet_leases_are_passed_over_and_every_check_comes_on_time(policy: dict[str, float], press: bool,
                                                                    expected: dict[str, int]) -> None:
    clock = VirtualClock()
    pol = LeasePolicy(heartbeat_timeout=30.0, default_idle_timeout_seconds=600, **policy)
    m = LeaseManager(Store(":memory:"), SimulatedInventory(gpus=1), pol, clock=clock)
    m.restore()
    a, _ = m.request(ALICE, {"gpus": 1, "heartbeat": False})
    if press:
        m.request(BOB, {"gpus": 1, "heartbeat": False})
    start, seen = a.last_activity, {}
    assert m.enforcer.quiet_for(600) <= min(expected.values())
    while a.state in (LeaseState.GRANTED, LeaseState.ACTIVE, LeaseState.IDLE) and clock.now() - start < 700:
        clock.advance(1)
        m.tick()
        t = round(clock.now() - start)
        if a.state == LeaseState.IDLE:
            seen.setdefault("idle", t)
        if "idle" in a.warned or "idle:pressure" in a.warned:
            seen.setdefault("warned", t)
    if a.state == LeaseState.REVOKED:
        seen["revoked"] = round(a.ended_at - start)
    assert seen == expected
