"""A gang suspended for a small request keeps its GPUs (``suspend_keep_gpus``): they are lent only to that request
('asker') or to other requests that may suspend others ('small'), nobody else is granted them, and the gang resumes
on them as soon as they are free again (or takes them back at ``suspend_keep_max_seconds``: its borrowers are asked
to suspend). Through the real LeaseManager on a virtual clock and an in-memory store; 2 nodes of 4 GPUs."""

from __future__ import annotations

import pytest
from suspension_setup import ALICE, BOB, CAROL, DAVE, ERIN, report_suspended, suspending_manager

from lease_broker.core.lease import LeaseState


def make(**policy):
    return suspending_manager(8, 2, **{"suspend_max_gpus": 1, "suspend_max_duration_seconds": 3600.0, **policy})


def request(m, clock, who, gpus, duration, suspendable=True):
    lease, _ = m.request(who, {"gpus": gpus, "duration_seconds": duration, "suspendable": suspendable})
    clock.advance(10)
    return lease


def gang_suspended_for_a_cell(m, clock):
    """alice's suspendable 4-GPU gang holds one node, bob's (not suspendable) the other; dave's 2-GPU request waits
    (it may not suspend anyone); carol's 1-GPU cell suspends alice's gang."""
    gang = request(m, clock, ALICE, 4, 36000)
    other = request(m, clock, BOB, 4, 36000, suspendable=False)
    pair = request(m, clock, DAVE, 2, 3600)
    cell = request(m, clock, CAROL, 1, 600)
    assert gang.state == other.state == LeaseState.GRANTED and pair.state == LeaseState.QUEUED
    assert gang.suspension is not None and gang.suspension.by_lease == cell.id
    node = list(gang.devices)
    report_suspended(m, gang)
    assert gang.state == LeaseState.SUSPENDED and cell.state == LeaseState.GRANTED
    assert set(cell.devices) <= set(node)
    return gang, node, pair, cell


@pytest.mark.parametrize("keep", ["off", "asker", "small"])
def test_a_gang_suspended_for_a_cell_resumes_on_its_own_gpus_when_they_free(keep):
    m, clock = make(suspend_keep_gpus=keep)
    gang, node, pair, cell = gang_suspended_for_a_cell(m, clock)
    if keep == "off":  # as before: the 2-GPU request takes two of the GPUs the gang left; the gang waits for a node
        assert pair.state == LeaseState.GRANTED and set(pair.devices) <= set(node)
        m.release(cell.id, CAROL)
        assert gang.state == LeaseState.SUSPENDED
        return
    assert pair.state == LeaseState.QUEUED  # the gang's other 3 GPUs are kept for it: nobody else gets them
    assert m.holds.kept() == dict.fromkeys(node, gang.id)
    clock.advance(300)
    m.release(cell.id, CAROL)
    # its GPUs are free again: it resumes on them at once, before the request that waited longer
    assert gang.state == LeaseState.GRANTED and gang.reason == "resumed" and sorted(gang.devices) == sorted(node)
    assert pair.state == LeaseState.QUEUED and m.holds.kept() == {}


@pytest.mark.parametrize("keep", ["asker", "small"])
def test_only_the_asker_or_small_requests_borrow_kept_gpus(keep):
    m, clock = make(suspend_keep_gpus=keep)
    gang, node, pair, cell = gang_suspended_for_a_cell(m, clock)
    short = request(m, clock, ERIN, 1, 300)  # a small request that ends before the gang could resume
    longer = request(m, clock, ERIN, 1, 3000)  # ... and one that would end after carol's cell
    if keep == "asker":
        assert short.state == longer.state == LeaseState.QUEUED
        assert not m.preemption.asked  # (the kept GPUs are no suspension's to take: nobody is asked for them)
        return
    assert short.state == LeaseState.GRANTED and set(short.devices) <= set(node)
    assert longer.state == LeaseState.QUEUED  # without a deadline it would hold the gang's GPU past carol's cell
    m.release(short.id, ERIN)
    m.release(cell.id, CAROL)
    assert gang.state == LeaseState.GRANTED and sorted(gang.devices) == sorted(node)


def test_the_gang_takes_its_gpus_back_at_the_deadline():
    m, clock = make(suspend_keep_gpus="small", suspend_keep_max_seconds=120.0)
    gang, node, pair, cell = gang_suspended_for_a_cell(m, clock)
    longer = request(m, clock, ERIN, 1, 3000)  # borrows too: it will be asked to give the GPU back
    assert longer.state == LeaseState.GRANTED and set(longer.devices) <= set(node)
    clock.advance(120)
    m.tick()
    borrowers = [cell, longer]
    for lease in borrowers:  # asked to suspend (preempted, for no request of their own: they keep nothing)
        assert lease.suspension is not None and not lease.suspension.suspended and not lease.suspension.by_lease
        report_suspended(m, lease)
        assert lease.state == LeaseState.SUSPENDED
    assert gang.state == LeaseState.GRANTED and sorted(gang.devices) == sorted(node)
    assert pair.state == LeaseState.QUEUED and all(x.state == LeaseState.SUSPENDED for x in borrowers)
    assert m.holds.kept() == {}
    m.release(gang.id, ALICE)  # the borrowers resume on what the gang gave back, before the request behind them
    assert all(x.state == LeaseState.GRANTED and x.reason == "resumed" for x in borrowers)
    held = [d for x in m.leases.values() if x.state == LeaseState.GRANTED for d in x.devices]
    assert len(held) == len(set(held))


def test_a_one_gpu_victim_keeps_nothing():
    m, clock = make(suspend_keep_gpus="small", suspend_keep_min_gpus=2)
    small = request(m, clock, ALICE, 1, 36000)
    request(m, clock, BOB, 4, 36000, suspendable=False)
    request(m, clock, DAVE, 3, 36000, suspendable=False)
    cell = request(m, clock, CAROL, 1, 600)
    report_suspended(m, small)
    assert small.state == LeaseState.SUSPENDED and cell.state == LeaseState.GRANTED
    assert m.holds.kept() == {}
