"""The suspended lease over REST, against a real broker process: the ask in the view, the holder's report
(``POST .../suspended``), heartbeats while suspended, the resume (``POST .../resume``), the fallback, and another
user who can neither report nor resume."""

from __future__ import annotations

import os
import tempfile

import pytest
from users import as_user, second_user  # noqa: F401  (fixture)
from waiting import wait_for

from jupyter_gpulease.client import BrokerClient, BrokerError

ARGS = ["--tick=0.1", "--LeasePolicy.suspend_report_seconds=30"]


def test_ask_report_heartbeat_and_resume_over_rest(broker_factory) -> None:
    broker = broker_factory(gpus=1, args=ARGS, name="suspend")
    c = broker.client()
    a = c.request_lease(1, suspendable=True, idle_timeout_seconds=1, heartbeat=False)
    assert a["state"] == "granted" and a["suspend"] is None and a["suspended"] is None
    asked = wait_for(lambda: c.lease(a["id"])["suspend"], 10, "the idle lease to be asked to suspend")
    assert asked["why"] == "idle" and "asked to suspend" in asked["text"]
    b = c.request_lease(1, heartbeat=False)
    assert b["state"] == "queued"
    view = c.suspended(a["id"], ok=True, how="stop", host_bytes=0)
    assert view["state"] == "suspended" and view["phase"] == "suspended" and view["devices"] == []
    assert view["suspended"]["why"] == "idle" and view["suspended"]["how"] == "stop"
    assert len(view["suspended"]["devices"]) == 1 and "resumes with its next cell" in view["suspended"]["text"]
    wait_for(lambda: c.lease(b["id"])["state"] == "granted", 10, "the queued request to get the freed GPU")
    beat = c.heartbeat(a["id"])  # the holder keeps beating while suspended
    assert beat["state"] == "suspended"
    waiting = c.resume(a["id"], wait_seconds=0.5)
    assert waiting["state"] == "suspended" and waiting["suspended"]["resume"]
    c.release(b["id"])  # its GPU frees: the lease that asked to resume gets it back
    back = wait_for(lambda: (v := c.lease(a["id"]))["state"] == "granted" and v, 10, "the suspended lease to resume")
    assert back["state"] == "granted" and back["reason"] == "resumed" and back["suspended"] is None
    assert back["devices"][0]["id"] == view["suspended"]["devices"][0] and back["suspended_seconds"] > 0
    with pytest.raises(BrokerError) as e:
        c.resume(a["id"])
    assert e.value.status == 409
    c.release(a["id"])


def test_a_holder_that_cannot_suspend_is_revoked(broker_factory) -> None:
    broker = broker_factory(gpus=1, args=ARGS, name="fallback")
    c = broker.client()
    a = c.request_lease(1, suspendable=True, idle_timeout_seconds=1, heartbeat=False)
    wait_for(lambda: c.lease(a["id"])["suspend"], 10, "the idle lease to be asked to suspend")
    view = c.suspended(a["id"], ok=False, why="cuCheckpointProcessLock failed: CUDA_ERROR_NOT_SUPPORTED")
    assert view["state"] == "revoked" and view["reason"].startswith("idle")
    assert "could not be suspended" in view["reason_text"] and "CUDA_ERROR_NOT_SUPPORTED" in view["reason_text"]


def test_another_user_can_neither_report_nor_resume(broker_factory, second_user) -> None:  # noqa: F811
    d = tempfile.mkdtemp(prefix="gl-susp")
    os.chmod(d, 0o755)
    broker = broker_factory(gpus=1, args=[*ARGS, "--LeaseBroker.root_is_admin=False"],
                            socket_path=os.path.join(d, "b.sock"), name="users")
    c = broker.client()
    a = c.request_lease(1, suspendable=True, heartbeat=False)

    def theirs() -> dict:
        t = BrokerClient(broker.url)
        out = {}
        for name, call in (("report", lambda: t.suspended(a["id"], ok=True, how="stop")),
                           ("resume", lambda: t.resume(a["id"]))):
            try:
                call()
                out[name] = 200
            except BrokerError as e:
                out[name] = e.status
        return out

    assert as_user(second_user, theirs) == {"report": 403, "resume": 403}
    assert c.lease(a["id"])["state"] == "granted"
    c.suspended(a["id"], ok=True, how="stop")
    assert as_user(second_user, theirs) == {"report": 403, "resume": 403}
    assert c.lease(a["id"])["suspended"]["resume"] is False
    c.release(a["id"])
