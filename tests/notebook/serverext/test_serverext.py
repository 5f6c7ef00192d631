"""The Jupyter server extension against a real broker process and a real in-process Jupyter server."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import tempfile
from pathlib import Path

import pytest
from tornado.httpclient import AsyncHTTPClient, HTTPClientError
from tornado.websocket import websocket_connect

from gpulease_protocol.address import SYSTEM_SOCKET
from jupyter_gpulease.client import BrokerClient, BrokerError
from jupyter_gpulease.serverext.embedded import EmbeddedBroker, EmbeddedBrokerError


def enabled(extra: dict | None = None) -> dict:
    return {"ServerApp": {"jpserver_extensions": {"jupyter_gpulease": True}}, "GpuLease": extra or {}}


@pytest.fixture
def jp_server_config(request, tmp_path, broker_factory, monkeypatch):
    """The extension pointed at a live broker (default), a stopped one ("down"), or at none ("embedded")."""
    mode = getattr(request, "param", "live")
    if mode == "embedded":
        if os.path.exists(SYSTEM_SOCKET):
            pytest.skip(f"a system broker socket exists at {SYSTEM_SOCKET}; this test needs a host without one")
        monkeypatch.delenv("GPULEASE_BROKER", raising=False)
        monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
        sock = os.path.join(tempfile.mkdtemp(prefix="gle"), "run", "broker.sock")
        return enabled({"embedded_socket": sock, "embedded_gpus": 3})
    if mode == "down":
        b = broker_factory(name="down")
        b.stop()
        return enabled({"broker_url": b.url})
    b = request.getfixturevalue("broker")
    return enabled({"broker_url": b.url, "artifact_root": str(tmp_path / "artifacts")})


def gpulease(serverapp):
    (app,) = serverapp.extension_manager.extension_apps["jupyter_gpulease"]
    return app


async def get_json(jp_fetch, *parts, **kw):
    r = await jp_fetch("gpulease", "api", *parts, **kw)
    assert r.headers["Content-Type"].startswith("application/json")
    return json.loads(r.body)


async def test_proxied_data_matches_the_broker(jp_fetch, client):
    lease = client.request_lease(1, duration_seconds=1800)
    assert await get_json(jp_fetch, "gpus") == client.gpus()
    assert await get_json(jp_fetch, "queue") == {"queue": client.queue()}
    assert await get_json(jp_fetch, "leases") == {"leases": client.leases()}
    info = await get_json(jp_fetch, "info")
    assert info["simulated"] is True and info["user"]["uid"] == os.getuid()
    assert info["summary"] == client.info()["summary"]
    one = await get_json(jp_fetch, "leases", lease["id"])
    assert one["id"] == lease["id"] and one["state"] == client.lease(lease["id"])["state"]


async def test_release_through_the_proxy_releases_the_broker_lease(jp_fetch, client):
    lease = client.request_lease(1, duration_seconds=1800)
    assert client.lease(lease["id"])["state"] in ("granted", "active")
    r = await get_json(jp_fetch, "leases", lease["id"], "release", method="POST", body=json.dumps({}))
    assert r["id"] == lease["id"] and r["state"] == "released"
    assert client.lease(lease["id"])["state"] == "released"
    assert client.gpus()["summary"]["free"] == 4


async def test_renew_and_broker_errors_pass_through(jp_fetch, client):
    lease = client.request_lease(1, duration_seconds=600)
    r = await get_json(jp_fetch, "leases", lease["id"], "renew", method="POST",
                       body=json.dumps({"duration_seconds": 1200}))
    assert r["expires_at"] >= lease["expires_at"]
    with pytest.raises(HTTPClientError) as e:
        await jp_fetch("gpulease", "api", "leases", "no-such-lease")
    assert e.value.code == 404
    body = json.loads(e.value.response.body)
    assert body["status"] == 404 and body["message"]
    with pytest.raises(BrokerError):
        client.lease("no-such-lease")


async def test_only_allow_listed_calls_reach_the_broker(jp_fetch, client):
    lease = client.request_lease(1, duration_seconds=1800)
    assert client.notify()  # the broker answers these paths; the proxy does not pass them on
    for method, parts, body in [("GET", ("notify",), None), ("PUT", ("notify",), "{}"),
                                ("POST", ("leases", lease["id"], "processes"), json.dumps({"pid": os.getpid()})),
                                ("PUT", ("leases",), "{}"), ("GET", ("leases", lease["id"], "nothing"), None),
                                ("GET", ("reservations",), None), ("GET", ("leases", "a" * 65), None)]:
        with pytest.raises(HTTPClientError) as e:
            await jp_fetch("gpulease", "api", *parts, method=method, body=body)
        assert e.value.code == 404, (method, parts)
        assert json.loads(e.value.response.body)["reason"] == "not_found"
    assert client.lease(lease["id"])["pids"] == []
    history = await get_json(jp_fetch, "leases", lease["id"], "history")
    assert history["transitions"][0]["to"] == client.history(lease["id"])[0]["to"]
    await get_json(jp_fetch, "leases", lease["id"], method="DELETE")
    assert client.lease(lease["id"])["state"] not in ("granted", "active", "idle")


async def test_broker_refusals_pass_through_with_their_status(jp_fetch):
    with pytest.raises(HTTPClientError) as e:
        await jp_fetch("gpulease", "api", "leases", method="POST", body="{not json")
    assert e.value.code == 400
    assert json.loads(e.value.response.body)["status"] == 400
    with pytest.raises(HTTPClientError) as e:
        await jp_fetch("gpulease", "api", "leases", method="POST", body=json.dumps({"gpus": 99}))
    assert 400 <= e.value.code < 500
    body = json.loads(e.value.response.body)
    assert body["status"] == e.value.code and body["reason"]


async def test_many_proxied_calls_at_once_do_not_queue_behind_each_other(jp_fetch, client):
    lease = client.request_lease(1, duration_seconds=1800)
    answers = await asyncio.gather(*(get_json(jp_fetch, "leases", lease["id"]) for _ in range(40)))
    assert {a["id"] for a in answers} == {lease["id"]}


async def test_requires_authentication(jp_fetch, jp_http_port, jp_base_url):
    await jp_fetch("gpulease", "api", "gpus")  # authenticated: fine
    http = AsyncHTTPClient()
    for path in ("gpulease/api/gpus", "gpulease/api/leases", "gpulease/api/artifacts", "gpulease/api/status"):
        r = await http.fetch(f"http://localhost:{jp_http_port}{jp_base_url}{path}", raise_error=False)
        assert r.code == 403, path
    r = await http.fetch(f"http://localhost:{jp_http_port}{jp_base_url}gpulease/api/leases/x/release",
                         method="POST", body="{}", raise_error=False)
    assert r.code == 403
    with pytest.raises(HTTPClientError) as e:
        await websocket_connect(f"ws://localhost:{jp_http_port}{jp_base_url}gpulease/events")
    assert e.value.code == 403


async def test_base_url_is_respected(jp_fetch, jp_http_port, jp_base_url):
    assert jp_base_url != "/"
    await jp_fetch("gpulease", "api", "gpus")
    r = await AsyncHTTPClient().fetch(f"http://localhost:{jp_http_port}/gpulease/api/gpus", raise_error=False)
    assert r.code == 404


async def test_event_relay_forwards_broker_events(jp_ws_fetch, client):
    ws = await jp_ws_fetch("gpulease", "events")
    hello = json.loads(await ws.read_message())
    assert hello["type"] == "hello" and hello["summary"]["total"] == 4
    lease = client.request_lease(1, duration_seconds=1800)
    seen = []
    while True:  # the grant shows up as lease events about our lease (bounded by the test timeout)
        event = json.loads(await ws.read_message())
        seen.append(event)
        if event["type"] == "lease" and event["lease"]["id"] == lease["id"] and event["change"] == "granted":
            break
    assert all(e["schema"] == "gpulease.event/1" for e in seen)
    ws.close()


@pytest.mark.parametrize("jp_server_config", ["down"], indirect=True)
async def test_broker_down_answers_503_with_a_clear_message(jp_fetch, jp_serverapp):
    url = gpulease(jp_serverapp).broker_url
    with pytest.raises(HTTPClientError) as e:
        await jp_fetch("gpulease", "api", "gpus")
    assert e.value.code == 503
    body = json.loads(e.value.response.body)
    assert body["status"] == 503 and body["reason"] == "unreachable"
    assert url in body["message"] and "lease-broker" in body["message"]


@pytest.mark.parametrize("jp_server_config", ["embedded"], indirect=True)
async def test_embedded_broker_starts_when_none_is_configured(jp_fetch, jp_serverapp):
    gl = gpulease(jp_serverapp)
    url = "unix://" + gl.embedded_socket
    assert os.environ["GPULEASE_BROKER"] == url  # kernels started by this server use it
    status = await get_json(jp_fetch, "status")
    assert status["embedded"] is True and status["broker_url"] == url
    info = await get_json(jp_fetch, "info")
    assert info["simulated"] is True and info["summary"]["simulated"] is True  # no NVIDIA driver here
    gpus = await get_json(jp_fetch, "gpus")
    assert len(gpus["gpus"]) == 3 and all(g["simulated"] for g in gpus["gpus"])
    assert BrokerClient(url).info()["simulated"] is True
    # the server's shutdown stops the embedded broker and restores the environment
    proc = gl.embedded.proc
    await gl.stop_extension()
    assert proc.poll() is not None
    assert "GPULEASE_BROKER" not in os.environ


def test_embedded_broker_readiness_and_failure_come_from_its_status_line(tmp_path):
    if os.path.exists(SYSTEM_SOCKET):
        pytest.skip(f"a system broker socket exists at {SYSTEM_SOCKET}; this test needs a host without one")
    log = logging.getLogger("test-embedded")
    run = Path(tempfile.mkdtemp(prefix="gle")) / "run"
    first = EmbeddedBroker(str(run / "a.sock"), 2, log)
    try:
        assert first.start() == "simulated"  # --inventory=auto said no_driver on this host: simulated GPUs
        assert len(BrokerClient(first.url).gpus()["gpus"]) == 2
        second = EmbeddedBroker(str(run / "b.sock"), 2, log)  # the same store, which the first one holds
        with pytest.raises(EmbeddedBrokerError) as e:
            second.start()
        assert e.value.code == 2 and e.value.reason == "store_locked"
        assert second.proc is None or second.proc.poll() is not None
    finally:
        first.stop()
    assert first.proc is None


async def test_artifacts_lists_recent_runs_relative_to_the_root_dir(jp_fetch, jp_root_dir, jp_serverapp):
    gl = gpulease(jp_serverapp)
    gl.artifact_root = str(jp_root_dir / "gpulease-artifacts")
    old = Path(gl.artifact_root) / "L-old"
    new = Path(gl.artifact_root) / "L-new"
    for d in (old, new):
        d.mkdir(parents=True)
        (d / "output.log").write_text("hello\n")
    (new / "meta.json").write_text(json.dumps({"lease_id": "L-new", "gpus": 1}))
    os.utime(old, (1_000_000, 1_000_000))
    data = await get_json(jp_fetch, "artifacts")
    assert [a["lease_id"] for a in data["artifacts"]] == ["L-new", "L-old"]
    first = data["artifacts"][0]
    assert first["relative_path"] == "gpulease-artifacts/L-new"
    assert first["meta"] == {"lease_id": "L-new", "gpus": 1}
    assert first["files"] == ["meta.json", "output.log"]
    assert data["artifacts"][1]["meta"] is None


async def test_artifacts_outside_the_root_dir_have_no_relative_path(jp_fetch, tmp_path):
    d = tmp_path / "artifacts" / "L1"
    d.mkdir(parents=True)
    data = await get_json(jp_fetch, "artifacts")
    assert data["artifacts"][0]["lease_id"] == "L1" and data["artifacts"][0]["relative_path"] is None
