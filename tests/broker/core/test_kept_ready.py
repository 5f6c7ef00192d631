"""A scheduling pass reuses an earlier pass's ready times of a node whose slots did not change (``SlotIndex.kept``):
every later pass over the same index plans exactly as a pass over a fresh copy of the slots, as time goes on past
the holders' ends, after the table changed a node, and after a pass took or booked GPUs of it."""

from __future__ import annotations

from lease_broker.core.lease import LeaseRequest
from lease_broker.core.scheduler import Pending, SchedulerPolicy, Slot, SlotIndex, schedule


def _slots() -> list[Slot]:
    out = []
    for n, node in enumerate(("a", "b", "c")):
        for i in range(4):  # every GPU held, each until its own time (node c: one idle)
            idle = node == "c" and i == 3
            out.append(Slot(id=f"{node}/{i}", node=node, index=i, exclusive=not idle,
                            free_at=0.0 if idle else 1000.0 + 100 * i + 37 * n))
    return out


def _pending() -> list[Pending]:
    sizes = (4, 2, 1, 4, 2, 3, 1, 4, 2, 1)
    return [Pending(f"r{i}", f"u{i}", LeaseRequest(min_gpus=k, max_gpus=k), i, 300.0 + 50 * i)
            for i, k in enumerate(sizes)]


def _decide(ix: SlotIndex, now: float) -> tuple[object, ...]:
    d = schedule(_pending(), ix, {}, SchedulerPolicy(backfill_depth=6), now, ordered=True)
    return ({g.lease_id: g.gpu_ids for g in d.grants}, d.plan, d.planned_start, d.waiting)


def test_kept_ready_times_plan_as_afresh() -> None:
    base = SlotIndex(_slots())
    for now in (500.0, 600.0, 600.0, 1040.0, 1100.0, 1300.0, 2000.0):
        if now == 1100.0:  # the table changes a node: its list is a new one
            s = base.by_id["b/1"].clone()
            s.free_at = 5000.0
            base.put(s)
        fresh = SlotIndex([s.clone() for s in base.all()])
        assert _decide(base, now) == _decide(fresh, now), now
    assert base.kept  # (the passes kept what they worked out)
