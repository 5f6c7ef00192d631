"""A real broker process on a real Unix socket, with real concurrent clients."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from broker_process import raw_request, scrape_metrics
from users import SECOND_USER, as_user, second_user  # noqa: F401  (fixture)
from waiting import wait_for

from jupyter_gpulease.client import BrokerClient, BrokerError


def test_many_concurrent_clients_get_distinct_gpus_and_the_rest_queue(broker_factory):
    broker = broker_factory(gpus=8, args=["--tick=0.1"])

    def ask(_):
        c = broker.client()
        try:
            return c.request_lease(1, heartbeat=False)
        finally:
            c.close()

    with ThreadPoolExecutor(32) as pool:
        leases = list(pool.map(ask, range(40)))
    granted = [lease for lease in leases if lease["state"] == "granted"]
    queued = [lease for lease in leases if lease["state"] == "queued"]
    assert len(granted) == 8 and len(queued) == 32
    devices = [d["id"] for lease in granted for d in lease["devices"]]
    assert len(set(devices)) == 8
    assert sorted(q["position"] for q in broker.client().queue()) == list(range(1, 33))


def test_release_hands_the_gpu_to_the_next_in_line(broker_factory):
    broker = broker_factory(gpus=1, args=["--tick=0.1"])
    c = broker.client()
    first = c.request_lease(1, heartbeat=False)
    second = c.request_lease(1, heartbeat=False)
    third = c.request_lease(1, heartbeat=False)
    assert (first["state"], second["state"], third["state"]) == ("granted", "queued", "queued")
    assert (second["position"], third["position"]) == (1, 2)
    c.release(first["id"])
    got = c.lease(second["id"], wait=5)
    assert got["state"] == "granted" and got["devices"] == first["devices"]
    assert c.lease(third["id"])["position"] == 1


def test_long_poll_wait_returns_at_grant(broker_factory):
    broker = broker_factory(gpus=1, args=["--tick=0.1"])
    c = broker.client()
    first = c.request_lease(1, heartbeat=False)
    with ThreadPoolExecutor(1) as pool:
        t0 = time.monotonic()
        fut = pool.submit(lambda: broker.client().request_lease(1, wait=20, heartbeat=False))
        wait_for(lambda: c.queue(), 10, "the request to queue")
        c.release(first["id"])
        lease = fut.result(10)
    assert lease["state"] == "granted"
    assert time.monotonic() - t0 < 5


def test_gang_waits_for_all_gpus_never_holding_part(broker_factory):
    broker = broker_factory(gpus=4, args=["--tick=0.1"])
    c = broker.client()
    a = c.request_lease(2, heartbeat=False)
    gang = c.request_lease(4, heartbeat=False)
    assert gang["state"] == "queued" and gang["devices"] == []
    gpus = c.gpus()["gpus"]
    assert sum(g["state"] == "free" for g in gpus) == 2  # the free pair is not held by the waiting gang
    small = c.request_lease(1, duration_seconds=3600, heartbeat=False)
    assert small["state"] == "queued"  # it would end after the gang's planned start: no backfill
    c.release(a["id"])
    g = c.lease(gang["id"], wait=5)
    assert g["state"] == "granted" and len(g["devices"]) == 4


def test_expiry_ends_the_lease_and_frees_the_gpu(broker):
    c = broker.client()
    lease = c.request_lease(1, duration_seconds=1, heartbeat=False)
    assert lease["state"] == "granted"
    wait_for(lambda: c.lease(lease["id"])["state"] == "expired", timeout=5)
    assert c.gpus()["summary"]["free"] == 4


def test_heartbeat_loss_revokes(broker_factory):
    broker = broker_factory(gpus=1, args=["--tick=0.1", "--heartbeat-timeout=1"])
    c = broker.client()
    lease = c.request_lease(1)
    for _ in range(3):  # the scenario is time passing: beats 0.4 s apart keep it past its 1 s timeout
        time.sleep(0.4)
        c.heartbeat(lease["id"])
    assert c.lease(lease["id"])["state"] in ("granted", "active", "idle")
    got = wait_for(lambda: (x := c.lease(lease["id"]))["state"] == "revoked" and x, timeout=5)
    assert got["reason"] == "holder_gone"


def test_renew_beyond_maximum_refused(broker_factory):
    broker = broker_factory(gpus=1, args=["--tick=0.1", "--LeasePolicy.max_duration_seconds=600"])
    c = broker.client()
    lease = c.request_lease(1, duration_seconds=60, heartbeat=False)
    renewed = c.renew(lease["id"], "5m")
    assert renewed["expires_at"] > lease["expires_at"]
    with pytest.raises(BrokerError) as e:
        c.renew(lease["id"], "2h")
    assert e.value.status == 403 and e.value.reason == "max_duration"
    # the view says how far a renewal may go (the sidebar's Extend choices), and a renewal reaches exactly that
    limit = lease["granted_at"] + 600
    assert lease["max_expires_at"] == limit and e.value.body["max_expires_at"] == limit
    assert c.renew(lease["id"], limit - c.info()["time"] - 1)["expires_at"] <= limit
    # extend_seconds moves the current end, so the sidebar's "+15 min" can reach the limit exactly
    end = c.lease(lease["id"])["expires_at"]
    extended = c.request("POST", f"/api/v1/leases/{lease['id']}/renew", {"extend_seconds": limit - end})
    assert extended["expires_at"] == pytest.approx(limit)
    with pytest.raises(BrokerError) as e:
        c.request("POST", f"/api/v1/leases/{lease['id']}/renew", {"extend_seconds": "1m"})
    assert e.value.reason == "max_duration"


def test_revoke_stops_attached_processes_and_drains(broker):
    c = broker.client()
    lease = c.request_lease(1, heartbeat=False)
    # a worker in its own process group, as %%gpu starts it, with a grandchild
    worker = subprocess.Popen([sys.executable, "-c", "import subprocess,time; subprocess.Popen(['sleep','60']); time.sleep(60)"],
                              start_new_session=True)
    try:
        c.attach(lease["id"], worker.pid)
        c.release(lease["id"])
        assert worker.wait(5) == -15
        wait_for(lambda: c.gpus()["summary"]["free"] == 4, timeout=5)
    finally:
        worker.kill()


def test_ignoring_sigterm_gets_sigkill_after_term_timeout(broker_factory):
    broker = broker_factory(gpus=1, args=["--tick=0.1", "--LeasePolicy.term_timeout=0.5"])
    c = broker.client()
    lease = c.request_lease(1, heartbeat=False)
    worker = subprocess.Popen([sys.executable, "-c", "import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ok', flush=True); time.sleep(60)"],
                              start_new_session=True, stdout=subprocess.PIPE)
    try:
        assert worker.stdout.readline() == b"ok\n"
        c.attach(lease["id"], worker.pid)
        c.release(lease["id"])
        gpu = c.gpus()["gpus"][0]
        assert gpu["state"] == "draining"
        assert c.request_lease(1, heartbeat=False)["state"] == "queued"  # not granted while draining
        assert worker.wait(5) == -9
        wait_for(lambda: c.gpus()["gpus"][0]["state"] != "draining", timeout=5)
    finally:
        worker.kill()


def test_kill9_restart_keeps_every_lease_and_grants_nothing_twice(broker_factory):
    broker = broker_factory(gpus=4, args=["--tick=0.1"])
    c = broker.client()
    held = [c.request_lease(1, heartbeat=False) for _ in range(4)]
    queued = [c.request_lease(1 + i % 2, heartbeat=False) for i in range(6)]
    assert all(h["state"] == "granted" for h in held) and all(q["state"] == "queued" for q in queued)
    order = [q["lease_id"] for q in c.queue()]
    broker.kill9()
    broker.start()
    c = broker.client()
    after = {lease["id"]: lease for lease in c.leases()}
    assert set(after) == {x["id"] for x in held + queued}
    assert all(after[h["id"]]["state"] == "granted" and after[h["id"]]["devices"] == h["devices"] for h in held)
    assert [q["lease_id"] for q in c.queue()] == order
    c.release(held[0]["id"])
    now_granted = [lease for lease in c.leases() if lease["state"] == "granted"]
    devices = [d["id"] for lease in now_granted for d in lease["devices"]]
    assert len(devices) == len(set(devices)) == 4


@pytest.mark.parametrize(
    "body,status,reason",
    [
        (b"{not json", 400, "bad_request"),
        (b"[1,2]", 400, "bad_request"),
        (b'{"gpus": -1}', 400, "bad_request"),
        (b'{"gpus": 100000}', 400, "bad_request"),
        (b'{"gpus": 99}', 400, "too_large"),
        (b'{"gpus": "two"}', 400, "bad_request"),
        (b'{"gpus": 1, "duration_seconds": "forever"}', 400, "bad_request"),
        (b'{"gpus": 1, "labels": "x"}', 400, "bad_request"),
    ],
)
def test_bad_input_gives_clear_4xx_and_stores_nothing(broker, body, status, reason):
    req = b"POST /api/v1/leases HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)
    code, payload = raw_request(broker.socket, req)
    assert (code, payload["status"], payload["reason"]) == (status, status, reason)
    assert payload["message"] and "Traceback" not in payload["message"]
    c = broker.client()
    assert c.leases() == [] and c.info()["summary"]["free"] == 4  # still serving, nothing stored


def test_unknown_lease_and_endpoint(broker):
    c = broker.client()
    with pytest.raises(BrokerError) as e:
        c.lease("l-doesnotexist")
    assert e.value.status == 404
    with pytest.raises(BrokerError) as e:
        c.request("GET", "/api/v1/nope")
    assert e.value.status == 404
    lease = c.request_lease(1, heartbeat=False)
    c.release(lease["id"])
    with pytest.raises(BrokerError) as e:
        c.release(lease["id"])
    assert e.value.status == 409 and e.value.reason == "invalid_transition"


def test_tcp_requires_a_valid_token(broker_factory, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    broker = broker_factory(gpus=2, args=["--tick=0.1", f"--port={port}"])
    token = subprocess.run([sys.executable, "-m", "lease_broker", "token", "create", "carol", f"--db={broker.db}"],
                           capture_output=True, text=True, check=True).stdout.strip()
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(BrokerError) as e:
        BrokerClient(url, token="").info()
    assert e.value.status == 401
    with pytest.raises(BrokerError) as e:
        BrokerClient(url, token="gpl_wrong").info()
    assert e.value.status == 401
    info = BrokerClient(url, token=token).info()
    assert info["user"] == {"name": "carol", "uid": -1, "admin": False}
    assert token not in broker.log()  # secrets never logged


def test_metrics_endpoint(broker):
    c = broker.client()
    c.request_lease(1, heartbeat=False)

    text = scrape_metrics(broker.socket)
    assert 'gpulease_gpus{simulated="true",state="leased"} 1.0' in text
    assert 'gpulease_leases{state="granted"} 1.0' in text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith("gpulease_store")}
    # the request and its grant were stored in one group commit (the answer waited for it)
    commits, writes = values["gpulease_store_commits_total"], values["gpulease_store_writes_total"]
    assert commits >= 1 and commits < writes


def test_no_broker_message_says_how_to_start_one(tmp_path):
    with pytest.raises(BrokerError) as e:
        BrokerClient(f"unix://{tmp_path}/none.sock").info()
    assert e.value.reason == "unreachable" and "lease-broker --inventory=simulated" in e.value.message


def test_auto_inventory_without_driver_refuses_with_the_fix(tmp_path):
    if os.path.exists("/proc/driver/nvidia/version"):
        pytest.skip("an NVIDIA driver is present on this host, so --inventory=auto would use it")
    r = subprocess.run([sys.executable, "-m", "lease_broker", f"--socket={tmp_path}/s.sock", f"--db={tmp_path}/d.db"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "--inventory=simulated" in r.stderr


def test_second_user_cannot_see_renew_release_or_attach(broker_factory, second_user):  # noqa: F811
    sockdir = tempfile.mkdtemp(prefix="gl-iso")
    os.chmod(sockdir, 0o755)
    broker = broker_factory(gpus=2, args=["--tick=0.1"], socket_path=os.path.join(sockdir, "b.sock"))
    mine = broker.client().request_lease(1, heartbeat=False)
    out = as_user(second_user, lambda: _probe(broker.url, mine["id"]))
    assert out["whoami"] == {"name": SECOND_USER, "uid": second_user.pw_uid, "admin": False}
    assert out["leases"] == []
    assert all(out[k] == 403 for k in ("get", "renew", "release", "heartbeat", "attach", "all", "revoke"))
    assert out["own"] == "granted"
    held_by_root = [h for g in out["gpus"] for h in g["holders"] if h["user"] == "root"]
    assert held_by_root and all(h["lease_id"] is None for h in held_by_root)  # who holds it, not its details
    c = broker.client()
    assert c.lease(mine["id"])["state"] == "granted"  # untouched
    assert len(c.leases(everyone=True)) == 2  # root is admin


def _probe(url: str, lease_id: str) -> dict:
    c = BrokerClient(url)
    out = {"whoami": c.info()["user"], "leases": c.leases(), "gpus": c.gpus()["gpus"]}
    calls = {"get": lambda: c.lease(lease_id), "renew": lambda: c.renew(lease_id, 60),
             "release": lambda: c.release(lease_id), "heartbeat": lambda: c.heartbeat(lease_id),
             "attach": lambda: c.attach(lease_id, os.getpid()), "all": lambda: c.leases(everyone=True),
             "revoke": lambda: c.revoke(lease_id, "x")}
    for name, call in calls.items():
        try:
            call()
            out[name] = 200
        except BrokerError as e:
            out[name] = e.status
    out["own"] = c.request_lease(1, heartbeat=False)["state"]
    return out


def test_grafana_dashboard_queries_name_series_the_broker_exports(broker):
    """deploy/grafana-dashboard.json: every panel's query uses metric and label names /metrics really has."""
    import re
    from pathlib import Path

    c = broker.client()
    c.request_lease(1, heartbeat=False)

    text = scrape_metrics(broker.socket)
    exported: dict[str, set[str]] = {}
    sampled: set[str] = set()
    for line in text.splitlines():
        t = re.match(r"# TYPE (gpulease_\w+) (\w+)", line)
        if t:  # a family is declared even before it has samples (utilisation, unleased processes)
            exported.setdefault(t.group(1) + ("_total" if t.group(2) == "counter" else ""), set())
        m = re.match(r"(gpulease_\w+)(?:\{(.*)\})? ", line)
        if m:
            sampled.add(m.group(1))
            exported.setdefault(m.group(1), set()).update(re.findall(r'(\w+)="', m.group(2) or ""))
    dash = json.loads((Path(__file__).resolve().parents[3] / "deploy" / "grafana-dashboard.json").read_text())
    assert dash["panels"]
    for panel in dash["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            names = re.findall(r"gpulease_\w+", expr)
            assert names, (panel["title"], expr)
            for name in names:
                assert name in exported, (panel["title"], name, sorted(exported))
                used = set(re.findall(r"(\w+)\s*(?:=~|!=|=)\s*\"", expr)) | {
                    lab.strip() for grp in re.findall(r"by \(([^)]*)\)", expr) for lab in grp.split(",")}
                if name in sampled:  # label names are known from samples
                    assert used <= exported[name] | {""}, (panel["title"], used - exported[name])
