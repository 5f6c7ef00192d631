"""Why a request waits, what is left of a quota, and why a lease ended, in words: a real broker process, real
clients of several users (bearer tokens over TCP), the answers of ``GET /leases/{id}``, ``GET /queue`` and
``GET /quota`` (issue 35, items 1 and 3)."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest
from broker_process import free_port, issue_token
from waiting import wait_for

from jupyter_gpulease.client import BrokerClient, BrokerError

CLOCK = re.compile(r"\b\d\d:\d\d\b")
#: A process that holds a lease that ends with it (``ends_with_caller``): prints the lease's id, then waits.
HOLDER = """
import sys, time
from jupyter_gpulease.client import BrokerClient
lease = BrokerClient(sys.argv[1]).request_lease(1, heartbeat=False, idle_timeout_seconds=0, ends_with_caller=True)
print(lease["id"], flush=True)
time.sleep(60)
"""


def _broker(broker_factory, gpus: int = 1, args: tuple[str, ...] = (), nodes: int = 1):
    """A broker on its socket (root: an admin) and on TCP, with clients for alice and bob (tokens)."""
    port = free_port()
    b = broker_factory(gpus=gpus, nodes=nodes, args=["--tick=0.1", f"--port={port}", *args])

    def client(user: str) -> BrokerClient:
        token = issue_token(b.db, user)
        return BrokerClient(f"http://127.0.0.1:{port}", token=token)

    return b.client(), client("alice"), client("bob")


def _waits(client: BrokerClient, lease_id: str, reason: str) -> dict:
    """The lease's ``wait`` once a pass has said ``reason``, and the same in its queue entry."""
    got = wait_for(lambda: (w := client.lease(lease_id)["wait"]) and w["reason"] == reason and w, 5,
                   f"lease {lease_id} to wait for {reason} (it says {client.lease(lease_id)['wait']})")
    entry = next(e for e in client.queue() if e["lease_id"] == lease_id)
    assert entry["wait"] == got
    assert got["text"] and "_" not in got["text"]  # words, not a slug
    return got


def test_busy_gpus_name_their_holders_and_when_they_are_expected_to_end(broker_factory):
    _, alice, bob = _broker(broker_factory, gpus=1)
    alice.request_lease(1, duration_seconds=1800, heartbeat=False)
    own = alice.request_lease(1, heartbeat=False)  # the words speak to the request's owner: "your" lease
    text = _waits(alice, own["id"], "gpus_busy")["text"]
    assert "your 1 GPU" in text and "end" in text
    alice.release(own["id"])
    waiting = bob.request_lease(1, heartbeat=False)
    text = _waits(bob, waiting["id"], "gpus_busy")["text"]
    assert "alice's 1 GPU" in text and CLOCK.search(text)
    # behind bob's request, another waits for earlier requests
    later = bob.request_lease(1, heartbeat=False)
    assert "1 earlier request" in _waits(bob, later["id"], "queue")["text"]


def test_the_users_concurrent_gpu_limit(broker_factory):
    _, alice, _ = _broker(broker_factory, gpus=2, args=("--LeasePolicy.max_gpus_per_user=1",))
    alice.request_lease(1, heartbeat=False)
    waiting = alice.request_lease(1, heartbeat=False)
    assert "1 of your 1 GPU at once" in _waits(alice, waiting["id"], "quota")["text"]


def test_the_daily_budget_says_what_is_left_and_when_it_refills(broker_factory):
    _, alice, _ = _broker(broker_factory, gpus=2, args=("--LeasePolicy.gpu_hours_per_day=1",))
    alice.request_lease(1, duration_seconds=2400, heartbeat=False)  # 40 of the 60 GPU-minutes
    waiting = alice.request_lease(1, duration_seconds=1800, heartbeat=False)
    text = _waits(alice, waiting["id"], "budget")["text"]
    assert "0.5 GPU-hours" in text and "0.33 GPU-hours left" in text and CLOCK.search(text)


def test_a_reservation_holding_the_free_gpus(broker_factory):
    admin, alice, _ = _broker(broker_factory, gpus=1)
    admin.request("POST", "/api/v1/reservations", {"user": "bob", "gpus": 1, "start": time.time(),
                                                   "duration_seconds": 3600})
    waiting = alice.request_lease(1, duration_seconds=600, heartbeat=False)
    text = _waits(alice, waiting["id"], "reservation")["text"]
    assert "reserved for bob" in text and len(CLOCK.findall(text)) == 2


def test_a_gang_that_needs_a_whole_node(broker_factory):
    _, alice, bob = _broker(broker_factory, args=("--SimulatedInventory.cluster=1x2:A100-40GB,1x2:H100:80G",))
    alice.request_lease(1, gpu_type="A100", heartbeat=False)
    alice.request_lease(1, gpu_type="H100", heartbeat=False)  # one GPU free on each node
    gang = bob.request_lease(2, heartbeat=False)
    assert "2 GPUs on one node" in _waits(bob, gang["id"], "whole_node")["text"]


def test_no_free_gpu_of_the_requested_type(broker_factory):
    _, alice, bob = _broker(broker_factory, args=("--SimulatedInventory.cluster=1x1:A100-40GB,1x1:H100:80G",))
    alice.request_lease(1, gpu_type="H100", heartbeat=False)
    waiting = bob.request_lease(1, gpu_type="H100", heartbeat=False)  # an A100 is free, no H100
    assert "H100" in _waits(bob, waiting["id"], "no_gpu_type")["text"]


def test_fair_share_and_priority_put_others_ahead(broker_factory):
    _, alice, bob = _broker(broker_factory, gpus=1)
    alice.request_lease(1, heartbeat=False)  # held from now on: her usage grows above bob's (none)
    mine = alice.request_lease(1, heartbeat=False)
    theirs = bob.request_lease(1, heartbeat=False)  # later, but bob has used less: ahead of alice's
    assert "fair share" in _waits(alice, mine["id"], "fair_share")["text"]
    assert _waits(bob, theirs["id"], "gpus_busy")
    low = bob.request_lease(1, priority="low", heartbeat=False)
    assert "higher priority" in _waits(bob, low["id"], "priority")["text"]


def test_quota_shows_used_limit_and_refill_for_gpus_and_the_daily_budget(broker_factory):
    admin, alice, bob = _broker(broker_factory, gpus=4, args=("--LeasePolicy.max_gpus_per_user=3",
                                                              "--LeasePolicy.gpu_hours_per_day=10"))
    lease = alice.request_lease(2, duration_seconds=3600, heartbeat=False)
    q = alice.quota()
    assert q["user"] == "alice"
    limits = {x["name"]: x for x in q["limits"]}
    gpus, hours = limits["gpus"], limits["gpu_hours"]
    assert (gpus["used"], gpus["limit"], gpus["unit"], gpus["refills_at"]) == (2, 3, "gpus", None)
    assert "2 of 3 GPUs" in gpus["text"]
    assert hours["used"] == pytest.approx(2, abs=0.01) and hours["limit"] == 10 and hours["unit"] == "gpu_hours"
    assert hours["refills_at"] == pytest.approx(lease["granted_at"] + 86400, abs=1)
    assert "8 GPU-hours left" in hours["text"] and CLOCK.search(hours["text"])
    # bob has used nothing: no refill to wait for
    mine = {x["name"]: x for x in bob.quota()["limits"]}
    assert mine["gpu_hours"]["used"] == 0 and mine["gpu_hours"]["refills_at"] is None
    # an admin may ask for another user; a user may not
    assert {x["name"]: x for x in admin.quota(user="alice")["limits"]}["gpus"]["used"] == 2
    with pytest.raises(BrokerError) as e:
        bob.quota(user="alice")
    assert e.value.status == 403


def test_renewal_refusal_speaks_in_durations_and_times(broker_factory):
    _, alice, _ = _broker(broker_factory, gpus=1, args=("--LeasePolicy.max_duration_seconds=3600",))
    lease = alice.request_lease(1, duration_seconds=600, heartbeat=False)
    with pytest.raises(BrokerError) as e:
        alice.renew(lease["id"], "2h")
    assert e.value.reason == "max_duration"
    msg = e.value.message
    assert "1 h" in msg and CLOCK.search(msg) and "max_duration_seconds" not in msg
    assert not re.search(r"\d s\b", msg)  # no raw seconds


@pytest.mark.parametrize("how, state, reason, words", [
    ("release", "released", "released", "released"),
    ("cancel", "cancelled", "cancelled", "cancelled while it waited"),
    ("expire", "expired", "expired", "expired: its time limit ran out"),
    ("idle", "revoked", "idle", "revoked: idle for"),
    ("idle_pressure", "revoked", "idle_pressure", "while others waited"),
    ("holder_gone", "revoked", "holder_gone", "no heartbeat"),
    ("holder_exited", "revoked", "holder_exited", "the process that held it exited"),
    ("preempted", "revoked", "preempted", "preempted"),
])
def test_an_ended_lease_says_why_in_a_sentence(broker_factory, how, state, reason, words):
    args = ["--LeasePolicy.default_idle_timeout_seconds=1", "--LeasePolicy.idle_mark_seconds=0.5",
            "--LeasePolicy.heartbeat_timeout=1", "--LeasePolicy.pressure_idle_timeout_seconds=0.5"]
    if how == "preempted":
        args = ["--LeasePolicy.preempt_grace_seconds={'high': 0}"]
    admin, alice, bob = _broker(broker_factory, gpus=1, args=tuple(args))
    quiet = {"heartbeat": False, "idle_timeout_seconds": 0}
    if how == "release":
        lease = alice.request_lease(1, **quiet)
        alice.release(lease["id"])
    elif how == "cancel":
        alice.request_lease(1, **quiet)
        lease = alice.request_lease(1, **quiet)
        alice.release(lease["id"])
    elif how == "expire":
        lease = alice.request_lease(1, duration_seconds=1, **quiet)
    elif how == "idle":
        lease = alice.request_lease(1, heartbeat=False, idle_timeout_seconds=1)
    elif how == "idle_pressure":
        lease = alice.request_lease(1, heartbeat=False, idle_timeout_seconds=3600)
        bob.request_lease(1, **quiet)  # waits: presses the idle lease
    elif how == "holder_gone":
        lease = alice.request_lease(1, heartbeat=True, idle_timeout_seconds=0)
    elif how == "holder_exited":
        child = subprocess.Popen([sys.executable, "-c", HOLDER, admin.url], stdout=subprocess.PIPE, text=True)
        lease = admin.lease(child.stdout.readline().strip())
        child.kill()
        child.wait()
    else:
        lease = alice.request_lease(1, priority="low", **quiet)
        admin.request_lease(1, priority="high", **quiet)
    viewer = admin if how == "holder_exited" else alice
    got = wait_for(lambda: (x := viewer.lease(lease["id"]))["state"] == state and x, 15,
                   f"lease to end {state} by {how}")
    assert got["reason"] == reason  # the slug stays, for scripts
    assert words in got["reason_text"] and "_" not in got["reason_text"]
    assert viewer.lease(lease["id"])["wait"] is None
