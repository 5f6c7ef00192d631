"""`gpulease admin` and the admin API against a real broker process: policy show/set/audit and hot reload
(API and SIGHUP) without dropping leases, revoke, reservations (create, list, cancel, shown by `gpulease
status`), the usage report, and what a user who is no admin may not do. Answers are checked against the
OpenAPI document."""

from __future__ import annotations

import getpass
import http.client
import json
import os
import signal
import subprocess
import sys

import pytest
from test_openapi import Caller, Unix, free_port, token_for
from waiting import wait_for

ME = getpass.getuser()


def gpulease(url, *args, check=True, token=None):
    env = {**os.environ, "GPULEASE_BROKER": url}
    env.pop("GPULEASE_TOKEN", None)
    if token:
        env["GPULEASE_TOKEN"] = token
    r = subprocess.run([sys.executable, "-m", "jupyter_gpulease.cli", *args], capture_output=True, text=True,
                       env=env, timeout=60)
    if check:
        assert r.returncode == 0, r.stderr
    return r


@pytest.fixture
def admin_broker(tmp_path):
    """A real broker (4 simulated GPUs) where the test's user is an admin, with a config file in its working
    directory (read at start and on SIGHUP), a TCP port and a token of the user 'bob' who is no admin."""
    from broker_process import BrokerProcess

    port = free_port()
    b = BrokerProcess(tmp_path / "b", gpus=4, args=["--tick=0.1", f"--port={port}",
                                                     f"--LeaseBroker.admin_users=['{ME}']"])
    (b.workdir / "lease_broker_config.py").write_text("c.LeasePolicy.max_duration_seconds = 7200\n")
    bob = token_for(b, "bob")
    b.start()
    b.port, b.bob = port, bob
    try:
        yield b
    finally:
        b.stop()


def test_policy_show_set_audit_keeps_leases(admin_broker):
    b = admin_broker
    c = b.client()
    held = c.request_lease(2, heartbeat=False, duration_seconds=600)
    shown = json.loads(gpulease(b.url, "--json", "admin", "policy", "show").stdout)
    assert shown["max_duration_seconds"] == 7200 and "gpu_hours_per_day" in shown and "user_limits" in shown
    table = gpulease(b.url, "admin", "policy", "show", "max_gpus_per_user").stdout
    assert "max_gpus_per_user" in table and "max_duration" not in table

    out = gpulease(b.url, "admin", "policy", "set", "max_gpus_per_user=2", "user_limits.alice.max_gpus=3",
                   "user_limits.alice.gpu_hours_per_day=10", 'preempt_grace_seconds={"high": 30}').stdout
    assert "max_gpus_per_user: 0.0 -> 2" in out and "preempt_grace_seconds: {} -> {\"high\": 30.0}" in out
    policy = json.loads(gpulease(b.url, "--json", "admin", "policy", "show").stdout)
    assert policy["user_limits"] == {"alice": {"max_gpus": 3, "gpu_hours_per_day": 10}}
    assert c.lease(held["id"])["state"] == "granted"  # not dropped, although it now holds the new maximum
    assert c.info()["policy"]["max_gpus_per_user"] == 2

    # an invalid value is refused naming the field; nothing of the request applies
    bad = gpulease(b.url, "admin", "policy", "set", "max_gpus_per_user=3", "fairshare_weight=-1", check=False)
    assert bad.returncode == 1 and "fairshare_weight" in bad.stderr
    assert json.loads(gpulease(b.url, "--json", "admin", "policy", "show").stdout)["max_gpus_per_user"] == 2
    unknown = gpulease(b.url, "admin", "policy", "set", "colour=red", check=False)
    assert unknown.returncode == 2 and "unknown policy option 'colour'" in unknown.stderr
    assert "Nothing changed" in gpulease(b.url, "admin", "policy", "set", "max_gpus_per_user=2").stdout

    audit = json.loads(gpulease(b.url, "--json", "admin", "policy", "audit").stdout)
    assert audit[0]["who"] == ME and audit[0]["source"] == "api"
    assert audit[0]["diff"]["max_gpus_per_user"] == [0.0, 2.0]
    assert ME in gpulease(b.url, "admin", "policy", "audit").stdout

    # a user who is no admin reads the policy but may not change it
    bob_url = f"http://127.0.0.1:{b.port}"
    assert gpulease(bob_url, "admin", "policy", "show", token=b.bob).returncode == 0
    refused = gpulease(bob_url, "admin", "policy", "set", "max_gpus_per_user=8", token=b.bob, check=False)
    assert refused.returncode == 1 and "admins" in refused.stderr and "policy" in refused.stderr


def test_sighup_reloads_the_config_file(admin_broker):
    b = admin_broker
    c = b.client()
    held = c.request_lease(1, heartbeat=False)
    (b.workdir / "lease_broker_config.py").write_text(
        "c.LeasePolicy.max_duration_seconds = 3600\nc.LeasePolicy.gpu_hours_per_day = 48\n")
    b.proc.send_signal(signal.SIGHUP)
    policy = wait_for(lambda: (p := c.request("GET", "/api/v1/policy")["policy"])["gpu_hours_per_day"] == 48 and p)
    assert policy["max_duration_seconds"] == 3600
    assert c.lease(held["id"])["state"] == "granted"
    audit = c.request("GET", "/api/v1/policy/audit")["audit"][0]
    assert audit["source"].startswith("sighup:") and audit["diff"]["gpu_hours_per_day"] == [0.0, 48.0]
    # a broken file is refused, the broker keeps running with the policy it had
    (b.workdir / "lease_broker_config.py").write_text("c.LeasePolicy.max_gpus_per_user = 'many'\n")
    b.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: "Policy reload" in b.log() and "refused" in b.log())
    assert b.proc.poll() is None
    assert c.request("GET", "/api/v1/policy")["policy"]["max_gpus_per_user"] == 0


def test_revoke_reserve_status_usage(admin_broker):
    b = admin_broker
    c = b.client()
    lease = c.request_lease(1, heartbeat=False)
    out = gpulease(b.url, "admin", "revoke", lease["id"], "--reason", "maintenance").stdout
    assert f"{lease['id']} revoked (admin:maintenance)" in out
    assert c.lease(lease["id"])["reason"] == "admin:maintenance"

    # a reservation open now: its GPUs show as reserved and are held for alice
    made = gpulease(b.url, "admin", "reserve", "create", "2", "--user", "alice", "--time", "2h",
                    "--note", "deadline").stdout
    rid = made.split(":")[0]
    assert rid.startswith("r-") and "2 GPUs for alice" in made
    listed = json.loads(gpulease(b.url, "--json", "admin", "reserve", "list").stdout)
    assert [r["id"] for r in listed] == [rid] and listed[0]["state"] == "active" and len(listed[0]["gpu_ids"]) == 2
    wait_for(lambda: c.info()["summary"]["states"].get("reserved") == 2)
    status = gpulease(b.url, "status").stdout
    assert "2/4 GPUs free, 2 reserved" in status and status.count("reserved (alice until") == 2
    assert rid in status and "deadline" in status
    mine = c.request_lease(4, heartbeat=False, duration_seconds=60)  # only 2 are free for others
    assert mine["state"] == "queued"
    later = gpulease(b.url, "admin", "reserve", "create", "1", "--group", "ml", "--start", "+3h", "--time", "1h").stdout
    assert "for @ml" in later
    assert "booked" in gpulease(b.url, "admin", "reserve", "list").stdout
    assert f"{rid} cancelled" in gpulease(b.url, "admin", "reserve", "cancel", rid).stdout
    assert wait_for(lambda: c.lease(mine["id"])["state"] == "granted")  # the GPUs are free for others again
    assert rid not in gpulease(b.url, "admin", "reserve", "list").stdout
    assert rid in gpulease(b.url, "admin", "reserve", "list", "--all").stdout
    bad = gpulease(b.url, "admin", "reserve", "create", "9", "--user", "alice", check=False)
    assert bad.returncode == 1 and "the inventory has 4 GPUs" in bad.stderr
    c.release(mine["id"])

    # users reserve only for themselves, within policy (user_reservation_max_gpus = 0: admins only)
    bob_url = f"http://127.0.0.1:{b.port}"
    refused = gpulease(bob_url, "admin", "reserve", "create", "1", "--user", "bob", token=b.bob, check=False)
    assert refused.returncode == 1 and "user_reservation_max_gpus" in refused.stderr
    gpulease(b.url, "admin", "policy", "set", "user_reservation_max_gpus=1")
    assert "1 GPU for bob" in gpulease(bob_url, "admin", "reserve", "create", "1", "--user", "bob",
                                       "--start", "+1h", token=b.bob).stdout
    other = gpulease(bob_url, "admin", "reserve", "create", "1", "--user", "alice", token=b.bob, check=False)
    assert other.returncode == 1 and "admins" in other.stderr and "other users" in other.stderr

    usage = json.loads(gpulease(b.url, "--json", "admin", "usage", "--since", "1d").stdout)
    me = next(u for u in usage["users"] if u["user"] == ME)
    assert me["leases"] == 2 and me["revocations"] == 1 and me["gpu_hours_held"] > 0
    text = gpulease(b.url, "admin", "usage", "--since", "7d").stdout
    assert "GPU-H HELD" in text and ME in text
    # a user sees their own usage only
    bob_usage = json.loads(gpulease(bob_url, "--json", "admin", "usage", token=b.bob).stdout)
    assert all(u["user"] == "bob" for u in bob_usage["users"])


def test_admin_answers_match_the_document(admin_broker):
    b = admin_broker
    call = Caller(Unix(b.socket))
    call("GET", "/api/v1/policy", 200)
    changed = call("PUT", "/api/v1/policy", 200, {"policy": {"max_gpus_per_user": 3}})
    assert changed["changed"] == {"max_gpus_per_user": [0.0, 3.0]}
    call("PUT", "/api/v1/policy", 200, {"backfill_depth": 4})
    bad = call("PUT", "/api/v1/policy", 400, {"max_gpus_per_user": "lots"})
    assert bad["field"] == "max_gpus_per_user"
    call("PUT", "/api/v1/policy", 400, {"nope": 1})
    call("GET", "/api/v1/policy/audit", 200, query="?limit=5")
    call("GET", "/api/v1/policy/audit", 400, query="?limit=x")
    r = call("POST", "/api/v1/reservations", 201, {"gpus": 1, "user": "alice", "start": "+1h", "duration_seconds": "1h"})
    call("POST", "/api/v1/reservations", 400, {"gpus": 1})
    call("POST", "/api/v1/reservations", 409, {"gpus": 4, "group": "ml", "start": "+1h", "end": "+90m"})
    call("GET", "/api/v1/reservations", 200, query="?all=1&ended=3600")
    call("GET", "/api/v1/reservations/{reservation_id}", 200, reservation_id=r["id"])
    call("GET", "/api/v1/reservations/{reservation_id}", 404, reservation_id="r-0000000000")
    now = call("POST", "/api/v1/reservations", 201, {"gpus": 1, "user": "alice"})
    gpus = call("GET", "/api/v1/gpus", 200)
    assert [g["reservation"]["id"] for g in gpus["gpus"] if g["state"] == "reserved"] == [now["id"]]
    call("DELETE", "/api/v1/reservations/{reservation_id}", 200, reservation_id=r["id"])
    call("GET", "/api/v1/usage", 200, query="?since=2h")
    call("GET", "/api/v1/usage", 400, query="?since=soon")
    bob = Caller(http.client.HTTPConnection("127.0.0.1", b.port, timeout=30),
                 {"Authorization": f"Bearer {b.bob}"})
    bob("PUT", "/api/v1/policy", 403, {"max_gpus_per_user": 8})
    bob("GET", "/api/v1/policy/audit", 403)
    bob("DELETE", "/api/v1/reservations/{reservation_id}", 403, reservation_id=now["id"])


def test_generate_config_documents_admin_policy():
    out = subprocess.run([sys.executable, "-m", "lease_broker", "--generate-config"], capture_output=True,
                         text=True, cwd="/tmp", timeout=60, check=True).stdout
    for option in ("gpu_hours_per_day", "allowed_priority_classes", "fairshare_weight", "fairshare_half_life_seconds",
                   "user_limits", "group_limits", "group_quotas", "group_members", "preempt_grace_seconds",
                   "user_reservation_max_gpus", "max_reservation_seconds", "default_idle_timeout_seconds",
                   "max_idle_timeout_seconds", "default_duration_seconds", "max_duration_seconds"):
        assert f"# c.LeasePolicy.{option} = " in out, option
    assert "Half-life" in out  # with each option its help
