"""The replay's driver (``core/driver.py: SyncDriver``): a real LeaseManager on a virtual clock and an in-memory
store, run by event-loop iterations without a loop, as the service runs it: the changes of an iteration wait for
its end, then one scheduling pass and one group commit take them all."""

from __future__ import annotations

from lease_broker.core.clock import VirtualClock
from lease_broker.core.driver import SyncDriver
from lease_broker.core.identity import Identity
from lease_broker.core.lease import LeaseState
from lease_broker.inventory.simulated import SimulatedInventory
from lease_broker.manager.manager import LeaseManager
from lease_broker.policy.lease_policy import LeasePolicy
from lease_broker.store.lease_store import Store

ALICE = Identity("alice", uid=1001)
BOB = Identity("bob", uid=1002)
CAROL = Identity("carol", uid=1003)


def make(gpus: int = 1, **policy: float) -> tuple[LeaseManager, VirtualClock, SyncDriver]:
    clock, driver = VirtualClock(), SyncDriver()
    pol = LeasePolicy(**{"default_idle_timeout_seconds": 0, "pressure_idle_timeout_seconds": 0, **policy})
    m = LeaseManager(Store(":memory:"), SimulatedInventory(gpus=gpus), pol, clock=clock, driver=driver)
    m.restore()
    driver.run()
    return m, clock, driver


def test_work_waits_for_the_end_of_the_iteration_and_what_it_queues_runs_too() -> None:
    driver, ran = SyncDriver(), []
    driver.call_soon(lambda: (ran.append("soon"), driver.call_soon(lambda: ran.append("queued by it"))))
    driver.call_later(5.0, lambda: ran.append("later"))
    assert driver.deferred and ran == []
    driver.run()
    assert ran == ["soon", "later", "queued by it"]


def test_the_requests_of_one_iteration_share_one_pass_and_one_group_commit() -> None:
    m, _, driver = make(gpus=2)
    passes, groups = m.passes, m.group.groups
    a, _ = m.request(ALICE, {"gpus": 1, "heartbeat": False})
    b, _ = m.request(BOB, {"gpus": 1, "heartbeat": False})
    c, _ = m.request(CAROL, {"gpus": 1, "heartbeat": False})
    assert {a.state, b.state, c.state} == {LeaseState.QUEUED}  # nothing before the end of the iteration
    driver.run()
    assert (a.state, b.state, c.state) == (LeaseState.GRANTED, LeaseState.GRANTED, LeaseState.QUEUED)
    assert (m.passes - passes, m.group.groups - groups) == (1, 1)
    assert [h["to"] for h in m.store.history(a.id)] == ["queued", "granted"]


def test_a_tick_that_revokes_an_idle_lease_hands_its_gpu_on_in_its_own_pass() -> None:
    """The tick's pass runs after its ends, in the same iteration: the end's hand-on pass (``_ended``) is not run
    again once the end is stored."""
    m, clock, driver = make(gpus=1)
    idle, _ = m.request(ALICE, {"gpus": 1, "heartbeat": False, "idle_timeout_seconds": 60})
    driver.run()
    waiting, _ = m.request(BOB, {"gpus": 1, "heartbeat": False})
    driver.run()
    assert idle.state == LeaseState.GRANTED and waiting.state == LeaseState.QUEUED
    clock.advance(61.0)
    passes = m.passes
    m.tick()
    driver.run()
    assert idle.state == LeaseState.REVOKED and idle.reason == "idle"
    assert waiting.state == LeaseState.GRANTED and waiting.devices == idle.devices
    assert m.passes - passes == 1


def test_a_release_hands_its_gpu_on_once_its_end_is_stored() -> None:
    m, _, driver = make(gpus=1)
    a, _ = m.request(ALICE, {"gpus": 1, "heartbeat": False})
    b, _ = m.request(BOB, {"gpus": 1, "heartbeat": False})
    driver.run()
    passes = m.passes
    m.release(a.id, ALICE)
    assert b.state == LeaseState.QUEUED  # the hand-on pass runs after the end is stored
    driver.run()
    assert a.state == LeaseState.RELEASED and b.state == LeaseState.GRANTED
    assert m.passes - passes == 1
