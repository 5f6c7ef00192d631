"""A scheduling pass that cannot decide otherwise than the last one takes its decision without running the scheduler
(``planning.SamePass``): every pass decides exactly what the scheduler decides on the same input, as time goes on,
as requests queue behind the head, as the GPUs change, as a GPU goes idle and as full and event passes alternate;
and the decision is the last one's only where nothing it depends on changed."""

from __future__ import annotations

from typing import Any

from lease_broker.core.clock import VirtualClock
from lease_broker.core.identity import Identity
from lease_broker.core.lease import LeaseRequest, LeaseState
from lease_broker.core.scheduler import Decision, Pending, SchedulerPolicy, Slot, SlotIndex, schedule
from lease_broker.inventory.simulated import SimulatedInventory
from lease_broker.manager.manager import LeaseManager
from lease_broker.manager.planning import SamePass
from lease_broker.policy.lease_policy import LeasePolicy
from lease_broker.store.lease_store import Store

POLICY = SchedulerPolicy(backfill_depth=3, capped=False)


def _slots() -> SlotIndex:
    """Two nodes of four GPUs, every one held until its own time."""
    return SlotIndex([Slot(id=f"{node}/{i}", node=node, index=i, exclusive=True, free_at=1000.0 + 100 * i + 37 * n)
                      for n, node in enumerate(("a", "b")) for i in range(4)])


def _pending(n: int) -> list[Pending]:
    sizes = (4, 2, 1, 4, 2, 3, 1, 4)
    return [Pending(f"r{i}", f"u{i}", LeaseRequest(min_gpus=sizes[i % 8], max_gpus=sizes[i % 8]), i, 300.0 + 50 * i)
            for i in range(n)]


def _options(plan: dict[str, Any]) -> dict[str, Any]:
    return {"policy": POLICY, "usage": {}, "budget": None, "reservations": [], "growing": [], "ordered": True,
            "plan": plan, "all_exclusive": True, "shortest": 300.0}


def _facts(d: Decision) -> tuple[object, ...]:
    return d.grants, d.plan, d.planned_start, d.waiting


def test_every_pass_decides_as_the_scheduler_and_reuses_only_what_holds() -> None:
    same, ix, queue = SamePass(), _slots(), _pending(5)
    plan: dict[str, Any] = {}
    last: Decision | None = None
    reused = []
    # (now, full pass, what changes before the pass)
    steps = [(500, True, ""), (510, False, ""), (520, True, ""), (530, True, "tail"), (540, False, "tail"),
             (550, True, "gpu"), (560, True, ""), (570, True, "head"), (580, False, ""), (590, True, "idle"),
             (600, True, ""), (610, True, "busy"), (620, True, ""), (1040, True, ""), (1050, True, "")]
    for now, full, change in steps:
        if change == "tail":  # a request queues behind the head: the head is the same
            queue = [*queue, _pending(len(queue) + 1)[-1]]
        elif change == "gpu":  # a holder's time limit changed: its node's list is a new one
            s = ix.by_id["b/2"].clone()
            s.free_at = 5000.0
            ix.put(s)
        elif change == "head":  # the head was granted elsewhere (a new first request)
            queue = queue[1:]
        elif change in ("idle", "busy"):  # a GPU frees, then is held again
            s = ix.by_id["a/0"].clone()
            s.exclusive, s.free_at = change == "busy", 1000.0 if change == "busy" else 0.0
            ix.put(s)
        if full:
            plan = {}
        expected = schedule(list(queue), ix.fork(), {}, now=float(now), **_options(plan))
        d = same.decide(iter(queue), full, ix.fork(), {}, float(now), _options(plan))
        assert _facts(d) == _facts(expected), (now, change)
        reused.append(d is last)
        last, plan = d, d.plan
    assert reused == [False, True, True, True, True, False, True, False, True, False, False, False, True,
                      # past a holder's time limit (a/0 ends at 1000): ready times are now's, planned again
                      False, False]


def test_a_request_behind_a_busy_cluster_keeps_the_plan_and_a_renewal_replans() -> None:
    clock = VirtualClock()
    # (one blocked request planned: the next one queues behind the plan; the holder, idle, keeps its GPUs)
    policy = LeasePolicy(backfill_depth=1, pressure_idle_timeout_seconds=0)
    m = LeaseManager(Store(":memory:"), SimulatedInventory(gpus=2), policy, clock=clock)
    m.restore()
    holder, _ = m.request(Identity("alice", uid=1001), {"gpus": 2, "heartbeat": False, "duration_seconds": 3600})
    assert holder.state == LeaseState.GRANTED
    first, _ = m.request(Identity("bob", uid=1002), {"gpus": 2, "heartbeat": False, "duration_seconds": 600})
    assert m.state.planned[first.id] == holder.expires_at
    clock.advance(30)
    m.tick()  # a full pass (full_pass_seconds 10): its plan is made afresh
    plan = m.planning.plan
    clock.advance(30)  # the next full pass: nothing it plans on changed
    second, _ = m.request(Identity("carol", uid=1003), {"gpus": 1, "heartbeat": False})
    assert m.planning.plan is plan and m.state.planned[first.id] == holder.expires_at
    clock.advance(30)
    m.renew(holder.id, Identity("alice", uid=1001), 7200)  # its GPUs free later: planned again
    m.tick()
    assert m.planning.plan is not plan
    assert m.state.planned[first.id] == holder.expires_at == clock.now() + 7200
    assert second.state == first.state == LeaseState.QUEUED
