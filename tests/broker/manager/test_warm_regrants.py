"""Warm re-grants (LeasePolicy.warm_regrant_seconds): a notebook's next request gets the GPUs its last lease gave
back while they are free; nothing is held for it. A LeaseManager on a virtual clock, then a real broker."""

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


@pytest.fixture
def make():
    def _make(gpus: int = 4, **policy):
        clock = VirtualClock()
        pol = LeasePolicy(**{"heartbeat_timeout": 0.0, "default_idle_timeout_seconds": 0, **policy})
        m = LeaseManager(Store(":memory:"), SimulatedInventory(gpus=gpus, nodes=1), pol, clock=clock)
        m.restore()
        return m, clock

    return _make


def cell(m: LeaseManager, who: Identity, notebook: str, **body):
    lease, _ = m.request(who, {"gpus": 1, "heartbeat": False, "labels": {"source": "%%gpu", "notebook": notebook},
                               **body})
    return lease


def two_notebooks_then_the_second_asks_again(m: LeaseManager, clock: VirtualClock, who2: Identity = ALICE,
                                             after: float = 5.0):
    """Notebooks one and two each run a cell (two gets the GPU best fit gives second), both end; ``after``
    seconds later notebook two (as ``who2``) runs its next cell."""
    one, two = cell(m, ALICE, "one.ipynb"), cell(m, ALICE, "two.ipynb")
    assert one.devices != two.devices
    m.release(one.id, ALICE)
    m.release(two.id, ALICE)
    clock.advance(after)
    return one, two, cell(m, who2, "two.ipynb")


def test_a_notebooks_next_cell_gets_the_gpu_its_last_cell_gave_back(make):
    m, clock = make()
    one, two, again = two_notebooks_then_the_second_asks_again(m, clock)
    assert again.state == LeaseState.GRANTED and again.devices == two.devices
    # the same cells without warm re-grants: best fit gives the second notebook the first one's GPU
    m, clock = make(warm_regrant_seconds=0)
    one, two, again = two_notebooks_then_the_second_asks_again(m, clock)
    assert again.devices == one.devices


def test_no_warm_regrant_after_the_window_or_for_another_user_with_the_same_notebook_name(make):
    m, clock = make(warm_regrant_seconds=30)
    one, two, again = two_notebooks_then_the_second_asks_again(m, clock, after=31)
    assert again.devices == one.devices
    m, clock = make(warm_regrant_seconds=30)
    one, two, again = two_notebooks_then_the_second_asks_again(m, clock, who2=BOB)
    assert again.devices == one.devices


def test_a_waiting_request_gets_the_gpu_first_and_an_idle_revocation_counts_as_an_end(make):
    m, clock = make(gpus=1, default_idle_timeout_seconds=600)
    mine = cell(m, ALICE, "one.ipynb")
    theirs, _ = m.request(BOB, {"gpus": 1, "heartbeat": False})
    assert theirs.state == LeaseState.QUEUED
    m.release(mine.id, ALICE)
    assert theirs.state == LeaseState.GRANTED and theirs.devices == mine.devices  # the waiting one first
    again = cell(m, ALICE, "one.ipynb")
    assert again.state == LeaseState.QUEUED  # nothing was held for the notebook
    m.release(theirs.id, BOB)
    assert again.state == LeaseState.GRANTED
    # revoked for idleness (nobody waiting): the notebook's next cell within the window finds its GPU
    m, clock = make(gpus=4, default_idle_timeout_seconds=600)
    one, two = cell(m, ALICE, "one.ipynb"), cell(m, ALICE, "two.ipynb")
    m.release(one.id, ALICE)
    clock.advance(600)
    m.tick()
    assert two.state == LeaseState.REVOKED and two.reason == "idle"
    clock.advance(10)
    assert cell(m, ALICE, "two.ipynb").devices == two.devices


def test_a_real_broker_gives_a_notebook_its_gpu_again(broker_factory) -> None:
    """The same through a real broker process: labels as %%gpu sends them."""
    broker = broker_factory(gpus=4, args=["--tick=0.1"])
    c = broker.client()

    def run_cell(notebook: str) -> dict:
        return c.request_lease(1, heartbeat=False, labels={"source": "%%gpu", "notebook": notebook})

    one, two = run_cell("one.ipynb"), run_cell("two.ipynb")
    c.release(one["id"])
    c.release(two["id"])
    again = run_cell("two.ipynb")
    assert again["state"] == "granted" and again["devices"] == two["devices"] != one["devices"]
