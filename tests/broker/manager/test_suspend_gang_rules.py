"""Preemption by suspension without making gangs wait longer (issue 33's 8-GPU bar): ``suspend_resume_behind_gangs``
(a lease suspended by preemption resumes behind an older waiting gang, not before it) and ``suspend_spare_gangs`` /
``suspend_yield_after_seconds`` (no suspension takes a GPU of the planned reservation of a gang that waited that
long), through the real LeaseManager on a virtual clock and an in-memory store."""

from __future__ import annotations

import pytest
from suspension_setup import ALICE, BOB, CAROL, DAVE, report_suspended, suspending_manager

from lease_broker.core.lease import LeaseState


def make(**policy):
    return suspending_manager(4, 1, **{"suspend_max_gpus": 1, **policy})


def grant(m, clock, who, gpus, duration):
    lease, _ = m.request(who, {"gpus": gpus, "duration_seconds": duration, "suspendable": True})
    assert lease.state == LeaseState.GRANTED, lease.state
    clock.advance(10)
    return lease


def asked(m) -> set[str]:
    return {x.id for x in m.leases.values() if x.suspension is not None and not x.suspension.suspended}


def suspend_for_a_cell(m, clock):
    """alice holds 1 GPU (long), bob 3 (ending at 2,000 s); dave's 4-GPU gang waits; carol's short cell suspends
    alice's lease, runs and ends."""
    small = grant(m, clock, ALICE, 1, 36000)
    big = grant(m, clock, BOB, 3, 2000)
    gang, _ = m.request(DAVE, {"gpus": 4, "duration_seconds": 3600})
    clock.advance(10)
    cell, _ = m.request(CAROL, {"gpus": 1, "duration_seconds": 600})
    assert asked(m) == {small.id}
    report_suspended(m, small)
    assert small.state == LeaseState.SUSPENDED and cell.state == LeaseState.GRANTED
    clock.advance(300)
    m.release(cell.id, CAROL)
    return small, big, gang


@pytest.mark.parametrize("behind", [True, False])
def test_a_suspended_lease_resumes_behind_an_older_gang(behind):
    m, clock = make(suspend_resume_behind_gangs=behind)
    small, big, gang = suspend_for_a_cell(m, clock)
    if not behind:  # as before: it resumes at once, ahead of the gang, and the gang's node drains later
        assert small.state == LeaseState.GRANTED and gang.state == LeaseState.QUEUED
        return
    # its GPU is free, but it would end after the gang's planned start: it waits behind the gang
    assert small.state == LeaseState.SUSPENDED and gang.state == LeaseState.QUEUED
    assert small.id in m.state.queue
    m.release(big.id, BOB)
    assert gang.state == LeaseState.GRANTED and small.state == LeaseState.SUSPENDED
    m.release(gang.id, DAVE)
    assert small.state == LeaseState.GRANTED and small.reason == "resumed"


@pytest.mark.parametrize("after, spared", [(0.0, True), (3600.0, False)])
def test_a_gang_that_waited_long_enough_has_its_reserved_gpus_spared(after, spared):
    m, clock = make(suspend_spare_gangs=True, suspend_yield_after_seconds=after)
    small = grant(m, clock, ALICE, 1, 36000)
    grant(m, clock, BOB, 3, 2000)
    gang, _ = m.request(DAVE, {"gpus": 4, "duration_seconds": 3600})
    clock.advance(10)
    assert m.preemption.plan()[gang.id].gpu_ids  # its reservation: the node's 4 GPUs
    cell, _ = m.request(CAROL, {"gpus": 1, "duration_seconds": 600})
    assert cell.state == LeaseState.QUEUED
    assert asked(m) == (set() if spared else {small.id})
