"""Wall-clock steps under a real broker process (issue 30, item 6): a +2,000 s step revoked a lease whose holder
heartbeated every 2 s, and a -600 s step kept a 20 s lease for 620 s.

The broker's wall clock is stepped through its test hook (``GPULEASE_TEST_CLOCK_FILE``: an offset its clock adds to
``time.time()``), never with ``date -s``, which would step every process on the host.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
from waiting import wait_for

from lease_broker.core.clock import TEST_CLOCK_FILE

pytestmark = pytest.mark.attack


def set_offset(path: Path, seconds: float) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(str(seconds))
    os.replace(tmp, path)  # the broker never reads half a number


def steps_logged(broker) -> list[float]:
    """The steps the broker logged, in seconds (measured: a step of -600 s may read -599.996 on a loaded host)."""
    return [float(m.group(1)) for line in broker.log_path.read_text(errors="replace").splitlines()
            if (m := re.search(r"Wall clock stepped ([-+]?[0-9.]+) s", line))]


def test_a_forward_step_revokes_no_lease_whose_holder_heartbeats(broker_factory, tmp_path: Path) -> None:
    offset = tmp_path / "clock-offset"
    set_offset(offset, 0)
    broker = broker_factory(gpus=1, args=["--tick=0.1", "--LeasePolicy.heartbeat_timeout=5"],
                            env={TEST_CLOCK_FILE: str(offset)})
    c = broker.client()
    lease = c.request_lease(1, duration_seconds=3600)
    granted, expires = time.monotonic(), lease["expires_at"]
    assert lease["state"] == "granted"
    set_offset(offset, 2000)

    def heartbeat_until_moved():
        got = c.heartbeat(lease["id"])  # about every second, as a kernel does every 2 s (the timeout is 5 s)
        return got if got["expires_at"] > expires + 1000 else None

    moved = wait_for(heartbeat_until_moved, timeout=15, what="the lease's times moved with the step", interval=1.0)
    assert moved["state"] in ("granted", "active", "idle")
    assert moved["expires_at"] == pytest.approx(expires + 2000, abs=1.0)
    # what people read: the (stepped) wall time at which it really ends
    assert moved["expires_at"] == pytest.approx(time.time() + 2000 + 3600 - (time.monotonic() - granted), abs=1.5)
    for _ in range(7):  # past the heartbeat timeout, heartbeating: it stays
        time.sleep(1)  # a real broker's ticks are observed
        assert c.heartbeat(lease["id"])["state"] in ("granted", "active", "idle")
    assert steps_logged(broker) == [pytest.approx(2000, abs=1)]
    broker.restart()  # the stored times are the truth after a restart: they were moved
    c = broker.client()
    again = c.lease(lease["id"])
    assert again["state"] in ("granted", "active", "idle")
    assert again["expires_at"] == pytest.approx(moved["expires_at"], abs=0.01)


def test_a_backward_step_keeps_no_lease_past_its_time(broker_factory, tmp_path: Path) -> None:
    offset = tmp_path / "clock-offset"
    set_offset(offset, 0)
    broker = broker_factory(gpus=1, args=["--tick=0.1"], env={TEST_CLOCK_FILE: str(offset)})
    c = broker.client()
    lease = c.request_lease(1, duration_seconds=20, heartbeat=False)
    granted, expires = time.monotonic(), lease["expires_at"]
    assert lease["state"] == "granted"
    set_offset(offset, -600)
    seen = []  # (its view, the stepped wall clock, seconds since the grant) while it held, once its times moved

    def its_end():
        view, wall, since = c.lease(lease["id"]), time.time() - 600, time.monotonic() - granted
        if view["state"] in ("granted", "active", "idle"):
            if view["expires_at"] < expires - 500:
                seen.append((view, wall, since))
            return None
        return view

    ended = wait_for(its_end, timeout=40, what="the 20 s lease's end", interval=0.1)
    took = time.monotonic() - granted
    assert (ended["state"], ended["reason"]) == ("expired", "expired")
    assert 19 <= took <= 23, took  # 20 s of real time, not 620
    assert seen, "its times never moved with the wall clock"
    for view, wall, since in seen:  # what people read: the (stepped) wall time at which it really ends
        assert view["expires_at"] == pytest.approx(wall + 20 - since, abs=1.5)
    assert steps_logged(broker) == [pytest.approx(-600, abs=1)]
