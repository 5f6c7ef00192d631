"""A lease ends with its holder process (issue 31): a real broker on its Unix socket, real child processes that ask
for leases with ``ends_with_caller`` and then die (kill -9) or exit, and broker restarts around them."""

from __future__ import annotations

import getpass
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest
from broker_process import free_port, issue_token, scrape_metrics
from waiting import process_alive, wait_for

from jupyter_gpulease.client import BrokerClient

#: A process that asks for leases (the bodies in argv[2]) over the broker's socket, prints their views, and waits
#: for a line on stdin (then exits cleanly) or to be killed.
CHILD = r"""
import json, sys
from jupyter_gpulease.client import BrokerClient
c = BrokerClient(sys.argv[1])
print(json.dumps([dict(c.request_lease(**body)) for body in json.loads(sys.argv[2])]), flush=True)
sys.stdin.readline()
"""

ENDS_WITH_ME = {"ends_with_caller": True}
ENDED_WITHIN = 1.0  # seconds from the holder's end to every one of its leases ended (the issue's goal)


class Holder:
    """A real child process holding leases."""

    def __init__(self, url: str, *bodies: dict) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, url, json.dumps(list(bodies))],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        assert line, f"the holder process exited with {self.proc.wait(10)}"
        self.leases: list[dict] = json.loads(line)
        self.pid = self.proc.pid

    def kill(self) -> float:
        """kill -9; returns when it was sent (monotonic)."""
        self.proc.send_signal(signal.SIGKILL)
        return time.monotonic()

    def exit(self) -> float:
        """A clean exit (it reads its line and returns); returns when it was asked to (monotonic)."""
        assert self.proc.stdin is not None
        t0 = time.monotonic()
        self.proc.stdin.write("exit\n")
        self.proc.stdin.flush()
        return t0

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def holders():
    started: list[Holder] = []

    def start(url: str, *bodies: dict) -> Holder:
        h = Holder(url, *bodies)
        started.append(h)
        return h

    yield start
    for h in started:
        h.close()


def ended(c: BrokerClient, lease_ids: list[str]) -> dict[str, tuple[str, str]] | None:
    """{lease id: (state, reason)} once every lease has ended, else None."""
    views = {i: c.lease(i) for i in lease_ids}
    if any(v["ended_at"] is None for v in views.values()):
        return None
    return {i: (v["state"], v["reason"]) for i, v in views.items()}


@pytest.mark.parametrize("how", ["kill -9", "exit"])
def test_a_holders_leases_end_within_a_second_of_its_end_and_others_stay(broker_factory, holders, how):
    broker = broker_factory(gpus=4, args=["--tick=5"])  # no tick in time: the end comes from the watch
    c = broker.client()
    h = holders(broker.url, {"gpus": 1, "heartbeat": False}, {"gpus": 2, **ENDS_WITH_ME}, {"gpus": 4, **ENDS_WITH_ME})
    plain, held, queued = h.leases
    assert (held["state"], queued["state"], plain["state"]) == ("granted", "queued", "granted")
    assert held["holder"] == {"pid": h.pid, "watched": True, "alive": True, "text": f"process {h.pid}"}
    assert queued["holder"]["pid"] == h.pid and plain["holder"]["pid"] is None

    t0 = h.kill() if how == "kill -9" else h.exit()
    got = wait_for(lambda: ended(c, [held["id"], queued["id"]]), timeout=ENDED_WITHIN, interval=0.01,
                   what="the holder's leases to end")
    took = time.monotonic() - t0
    assert got == {held["id"]: ("revoked", "holder_exited"), queued["id"]: ("cancelled", "holder_exited")}
    assert took < ENDED_WITHIN
    assert c.lease(plain["id"])["state"] == "granted"  # a lease without the field outlives its requester
    nxt = c.request_lease(3, heartbeat=False)  # the GPUs it held are free for the next request
    assert nxt["state"] == "granted"
    assert c.lease(plain["id"])["state"] == "granted"
    assert any(held["id"] in line and getpass.getuser() in line and "holder_exited" in line
               for line in broker.log().splitlines())


def test_a_watched_holder_keeps_its_lease_without_heartbeats_and_ends_are_counted_by_cause(broker_factory, holders):
    broker = broker_factory(gpus=4, args=["--tick=0.1", "--heartbeat-timeout=1"])
    c = broker.client()
    h = holders(broker.url, {"gpus": 1, **ENDS_WITH_ME})  # heartbeats expected, never sent
    (watched,) = h.leases
    silent = c.request_lease(1)  # heartbeats expected, never sent, no holder process
    got = wait_for(lambda: (x := c.lease(silent["id"]))["ended_at"] and x, timeout=10, what="the heartbeat timeout")
    assert (got["state"], got["reason"]) == ("revoked", "holder_gone")
    view = c.lease(watched["id"])
    assert view["state"] in ("granted", "active", "idle") and view["holder"]["watched"]  # its exit ends it instead
    h.kill()
    wait_for(lambda: ended(c, [watched["id"]]), timeout=ENDED_WITHIN, interval=0.01, what="the watched lease to end")
    text = scrape_metrics(broker.socket)
    assert 'gpulease_leases_holder_ended_total{cause="exited"} 1.0' in text
    assert 'gpulease_leases_holder_ended_total{cause="heartbeat"} 1.0' in text


def test_a_restarted_broker_keeps_a_live_holders_leases_and_watches_them_again(broker_factory, holders):
    broker = broker_factory(gpus=4, args=["--tick=5"])  # watched again from the start, not from a tick
    h = holders(broker.url, {"gpus": 2, **ENDS_WITH_ME}, {"gpus": 4, **ENDS_WITH_ME})
    held, queued = h.leases
    broker.kill9()
    broker.start()
    c = broker.client()
    assert c.lease(held["id"])["state"] == "granted" and c.lease(queued["id"])["state"] == "queued"
    assert c.lease(held["id"])["holder"] == {"pid": h.pid, "watched": True, "alive": True, "text": f"process {h.pid}"}
    h.kill()
    got = wait_for(lambda: ended(c, [held["id"], queued["id"]]), timeout=ENDED_WITHIN, interval=0.01,
                   what="the holder's leases to end")
    assert got == {held["id"]: ("revoked", "holder_exited"), queued["id"]: ("cancelled", "holder_exited")}


def test_a_holder_that_died_while_the_broker_was_down_ends_its_leases_at_the_restart(broker_factory, holders):
    broker = broker_factory(gpus=4, args=["--tick=0.1"])
    h = holders(broker.url, {"gpus": 2, **ENDS_WITH_ME}, {"gpus": 4, **ENDS_WITH_ME})
    held, queued = h.leases
    broker.kill9()
    h.kill()
    h.proc.wait(10)
    broker.start()
    c = broker.client()
    assert ended(c, [held["id"], queued["id"]]) == {held["id"]: ("revoked", "holder_exited"),
                                                   queued["id"]: ("cancelled", "holder_exited")}
    assert c.request_lease(4, heartbeat=False)["state"] == "granted"


def test_a_recycled_pid_is_not_the_holder(broker_factory, holders):
    """The stored holder names a live pid with another start time (the pid was reused): the lease ends at the
    restart, and the process that has the pid now is left alone."""
    broker = broker_factory(gpus=4, args=["--tick=0.1"])
    h = holders(broker.url, {"gpus": 2, **ENDS_WITH_ME})
    (held,) = h.leases
    broker.kill9()
    with sqlite3.connect(broker.db) as db:
        (holder,) = db.execute("SELECT holder FROM leases WHERE id=?", (held["id"],)).fetchone()
        pid, start = map(int, holder.split())
        assert pid == h.pid
        db.execute("UPDATE leases SET holder=? WHERE id=?", (f"{pid} {start + 1}", held["id"]))
    broker.start()
    c = broker.client()
    assert ended(c, [held["id"]]) == {held["id"]: ("revoked", "holder_exited")}
    assert process_alive(h.pid)


def test_over_tcp_the_field_is_accepted_and_the_heartbeat_stays_the_bound(broker_factory):
    port = free_port()
    broker = broker_factory(gpus=2, args=["--tick=0.1", f"--port={port}"])
    token = issue_token(broker.db, "carol")
    lease = BrokerClient(f"http://127.0.0.1:{port}", token=token).request_lease(1, **ENDS_WITH_ME)
    assert lease["state"] == "granted"
    assert lease["holder"]["pid"] is None and not lease["holder"]["watched"]


def test_gpulease_leases_all_shows_the_holder(broker_factory, holders):
    broker = broker_factory(gpus=4, args=["--tick=0.1", f"--LeaseBroker.admin_users=['{getpass.getuser()}']"])
    h = holders(broker.url, {"gpus": 1, **ENDS_WITH_ME})
    (held,) = h.leases
    plain = broker.client().request_lease(1, heartbeat=False)
    env = {**os.environ, "GPULEASE_BROKER": broker.url}
    env.pop("GPULEASE_TOKEN", None)
    r = subprocess.run([sys.executable, "-m", "jupyter_gpulease.cli", "leases", "--all"], capture_output=True,
                       text=True, env=env, timeout=60, check=True)
    lines = r.stdout.splitlines()
    assert "HOLDER" in lines[0].split()
    assert f"process {h.pid}" in next(line for line in lines if held["id"] in line)
    assert "process" not in next(line for line in lines if plain["id"] in line)
