"""Suspended leases in the CLI, against a real broker: ``gpulease leases`` and ``gpulease show`` give the broker's
words for a suspended lease (since when, why, when it resumes), and the client's ``suspended``/``resume`` calls are
the holder's side of a suspension."""

from __future__ import annotations

import os
import subprocess
import sys


def gpulease(broker, *args: str) -> str:
    env = {**os.environ, "GPULEASE_BROKER": broker.url}
    r = subprocess.run([sys.executable, "-m", "jupyter_gpulease.cli", *args], capture_output=True, text=True,
                       env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_a_suspended_lease_shows_the_brokers_words_and_resumes(broker) -> None:
    c = broker.client()
    lease = c.request_lease(1, wait=10, suspendable=True, heartbeat=False)
    assert lease.holding, lease.raw
    view = c.suspended(lease.id, True, how="stop", host_bytes=0)  # of its own accord: why "user"
    assert view.get("phase") == "suspended" and not view.devices, view.raw
    text = view["suspended"]["text"]
    assert text and view["suspended"]["why"] == "user"
    assert text in gpulease(broker, "leases")
    assert text in gpulease(broker, "show", lease.id)

    resumed = c.resume(lease.id, wait_seconds=10)
    assert resumed.holding and resumed.devices, resumed.raw
    assert text not in gpulease(broker, "leases")
    c.release(lease.id)
