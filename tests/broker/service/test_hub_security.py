"""Hub users and Unix users are two kinds of people, and a Hub token is trusted no longer than the Hub says
(issue 30, items 3 and 10), with a real JupyterHub and real brokers.

- Namespaces: under identity 'unix+hub' a Hub user named ``root`` is not Unix root, and a Hub user named like a
  Unix admin (``admin_users``) or in a Hub group named like a Unix admin group (``admin_groups``) is no admin;
  ``hub_admin_users``/``hub_admin_groups`` name Hub admins; ``hub_users_are_unix_users`` makes the two one.
- Hub tokens: a revoked token stops working within ``HubIdentity.cache_seconds``; an expired token is refused at
  its expiry although its answer is still kept; random tokens from one peer cause at most
  ``failed_lookups_per_minute`` Hub lookups (counted in the Hub's own log), then 429 with Retry-After; while the
  Hub is down only tokens it accepted within ``cache_seconds`` pass (last: it stops the Hub).

One Hub serves the module (users and tokens through its REST API; no single-user servers); each test starts its
own broker.
"""

from __future__ import annotations

import http.client
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from broker_process import BrokerProcess
from hub_process import HubProcess, hub_missing
from waiting import wait_for

from jupyter_gpulease.client import BrokerClient, BrokerError

pytestmark = [pytest.mark.timeout(300), pytest.mark.attack]

UNIX_ADMIN = "gl-unixadmin"  # a Unix admin's name (admin_users), also taken by a Hub user
UNIX_ADMIN_GROUP = "gl-gpuadmin"  # a Unix admin group's name (admin_groups), also a Hub group
SERVICE_TOKEN = "gpulease-service-" + uuid.uuid4().hex  # the broker's own Hub token: reads token models


@pytest.fixture(scope="module")
def hub() -> Iterator[HubProcess]:
    why = hub_missing()
    if why:
        pytest.skip(why)
    workdir = Path(tempfile.mkdtemp(prefix="gl-hubsec"))
    hub = HubProcess(workdir / "hub", config=f"""
c.JupyterHub.services.append({{"name": "gpulease", "api_token": {SERVICE_TOKEN!r}}})
c.JupyterHub.load_roles.append({{"name": "gpulease", "services": ["gpulease"], "scopes": ["read:tokens"]}})
""")
    hub.start()
    try:
        for name in ("root", UNIX_ADMIN, "mallory", "carol", "alice"):
            hub.user(name)
        hub.api("POST", f"/groups/{UNIX_ADMIN_GROUP}", {"users": ["mallory"]})
        hub.api("POST", "/groups/gpu-admins", {"users": ["carol"]})
        yield hub
    finally:
        hub.stop()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def start_broker(hub: HubProcess, tmp_path: Path) -> Iterator[Callable[..., BrokerProcess]]:
    started: list[BrokerProcess] = []

    def start(*args: str, identity: str = "unix+hub") -> BrokerProcess:
        b = BrokerProcess(tmp_path / f"b{len(started)}", gpus=2, args=[
            "--tick=0.1", f"--identity={identity}", f"--HubIdentity.api_url={hub.api_url}", *args]).start()
        started.append(b)
        return b

    yield start
    for b in started:
        b.stop()


def _client(broker: BrokerProcess, token: str = "") -> BrokerClient:
    return BrokerClient(broker.url, token=token)


def _status(call: Callable[[], object]) -> int:
    try:
        call()
    except BrokerError as e:
        return e.status
    return 200


# ----------------------------------------------------------------------------- separate namespaces
def test_a_hub_user_named_root_is_not_unix_root(hub: HubProcess, start_broker) -> None:
    broker = start_broker()
    unix_root = _client(broker)  # no token on the socket: the caller's uid (the tests run as root)
    held = unix_root.request_lease(1, heartbeat=False)
    assert held.state == "granted"
    hub_root = _client(broker, hub.token("root")[0])
    me = hub_root.info()["user"]
    assert (me["name"], me["admin"]) == ("hub:root", False)
    assert held.id not in [x.id for x in hub_root.leases()]
    assert [_status(lambda: hub_root.lease(held.id)), _status(lambda: hub_root.renew(held.id, 60)),
            _status(lambda: hub_root.release(held.id))] == [403, 403, 403]
    assert unix_root.lease(held.id).state == "granted"
    # the Hub user's own lease is theirs, owned by its Hub name
    theirs = hub_root.request_lease(1, heartbeat=False)
    assert theirs.user == "hub:root" and [x.id for x in hub_root.leases()] == [theirs.id]
    assert held.user == "root"


def test_a_hub_user_named_like_a_unix_admin_is_no_admin(hub: HubProcess, start_broker) -> None:
    broker = start_broker(f"--LeaseBroker.admin_users=['{UNIX_ADMIN}']",
                          f"--LeaseBroker.admin_groups=['{UNIX_ADMIN_GROUP}']",
                          "--LeaseBroker.hub_admin_groups=['gpu-admins']")
    victim = _client(broker).request_lease(1, heartbeat=False)
    for name in (UNIX_ADMIN, "mallory"):  # named like a Unix admin; in a Hub group named like a Unix admin group
        who = _client(broker, hub.token(name)[0])
        assert who.info()["user"]["admin"] is False, name
        assert _status(lambda c=who: c.revoke(victim.id, "mine now")) == 403, name
        assert _status(lambda c=who: c.request("PUT", "/api/v1/policy", {"max_gpus_per_user": 1})) == 403, name
        assert _status(lambda c=who: c.leases(everyone=True)) == 403, name
    assert _client(broker).lease(victim.id).state == "granted"
    # a Hub group named in hub_admin_groups makes Hub admins
    carol = _client(broker, hub.token("carol")[0])
    assert carol.info()["user"]["admin"] is True
    assert carol.revoke(victim.id, "maintenance").state == "revoked"


def test_hub_users_mapped_onto_unix_users_are_one(hub: HubProcess, start_broker) -> None:
    broker = start_broker("--LeaseBroker.hub_users_are_unix_users=True", f"--LeaseBroker.admin_users=['{UNIX_ADMIN}']")
    unix_root = _client(broker)
    held = unix_root.request_lease(1, heartbeat=False)
    hub_root = _client(broker, hub.token("root")[0])
    assert hub_root.info()["user"]["name"] == "root"
    assert hub_root.lease(held.id).state == "granted"
    assert _client(broker, hub.token(UNIX_ADMIN)[0]).info()["user"]["admin"] is True
    assert hub_root.release(held.id).state == "released"


# ----------------------------------------------------------------------------- Hub tokens
def test_a_revoked_token_stops_working_within_cache_seconds(hub: HubProcess, start_broker) -> None:
    cache = 2.0
    broker = start_broker(f"--HubIdentity.cache_seconds={cache}", identity="hub")
    token, token_id = hub.token("alice")
    alice = _client(broker, token)
    assert alice.info()["user"]["name"] == "alice"
    hub.revoke("alice", token_id)
    revoked = time.monotonic()
    wait_for(lambda: _status(alice.info) == 401, cache + 3, "the revoked token to be refused")
    assert time.monotonic() - revoked < cache + 3


def test_an_expired_token_is_refused_at_its_expiry_although_its_answer_is_kept(hub: HubProcess,
                                                                                 start_broker) -> None:
    broker = start_broker("--HubIdentity.cache_seconds=600", f"--HubIdentity.api_token={SERVICE_TOKEN}",
                          identity="hub")
    made = time.monotonic()
    short = hub.api("POST", "/users/alice/tokens", {"note": "short", "expires_in": 3})["token"]
    alice = _client(broker, short)
    assert alice.info()["user"]["name"] == "alice"
    wait_for(lambda: _status(alice.info) == 401, 10, "the expired token to be refused (its answer is kept 600 s)")
    assert time.monotonic() - made >= 2.5  # not before its expiry
    with pytest.raises(BrokerError) as expired:
        alice.info()
    assert expired.value.reason == "invalid_token"


def _hub_lookups(hub: HubProcess) -> int:
    """Refused token lookups the Hub logged (403 on its 'who am I' endpoint)."""
    return sum(1 for line in hub.log_path.read_text(errors="replace").splitlines()
               if "403 GET /hub/api/user " in line)


def _raw_info(sock_path: str, token: str) -> tuple[int, str | None]:
    class Conn(http.client.HTTPConnection):
        def connect(self) -> None:
            self.sock = socket.socket(socket.AF_UNIX)
            self.sock.connect(sock_path)

    conn = Conn("localhost", timeout=30)
    try:
        conn.request("GET", "/api/v1/info", headers={"Authorization": f"token {token}"})
        resp = conn.getresponse()
        resp.read()
        return resp.status, resp.getheader("Retry-After")
    finally:
        conn.close()


def test_random_tokens_from_one_peer_cause_at_most_the_rate_of_hub_lookups(hub: HubProcess, start_broker) -> None:
    rate = 10
    broker = start_broker(f"--HubIdentity.failed_lookups_per_minute={rate}", identity="hub")
    known, _ = hub.token("alice")
    assert _client(broker, known).info()["user"]["name"] == "alice"  # seen valid before the flood
    unseen, _ = hub.token("carol")
    before = _hub_lookups(hub)
    started = time.monotonic()
    answers = [_raw_info(broker.socket, uuid.uuid4().hex) for _ in range(300)]
    refill = (time.monotonic() - started) * rate / 60
    statuses = [status for status, _ in answers]
    assert set(statuses) <= {401, 429}, statuses
    assert statuses.count(401) <= rate + refill + 1
    assert all(after is not None and int(after) >= 1 for status, after in answers if status == 429)
    wait_for(lambda: _hub_lookups(hub) - before >= statuses.count(401), 10, "the Hub's log of the lookups")
    assert _hub_lookups(hub) - before <= rate + refill + 1
    # a token seen valid still works; one never seen waits its turn (the Hub is not asked)
    assert _client(broker, known).info()["user"]["name"] == "alice"
    assert _raw_info(broker.socket, unseen)[0] == 429


# ----------------------------------------------------------------------------- the Hub down (last: stops it)
def test_during_a_hub_outage_only_tokens_accepted_within_cache_seconds_pass(hub: HubProcess, start_broker) -> None:
    cache = 8.0
    broker = start_broker(f"--HubIdentity.cache_seconds={cache}", identity="hub")
    token, _ = hub.token("alice")
    unseen, _ = hub.token("carol")
    alice = _client(broker, token)
    lease = alice.request_lease(1, heartbeat=False)
    seen = time.monotonic()
    hub.stop()
    try:
        assert time.monotonic() - seen < cache, "the Hub took too long to stop for this test"
        assert alice.lease(lease.id).state == "granted"  # accepted within cache_seconds: passes
        with pytest.raises(BrokerError) as down:
            _client(broker, unseen).info()
        assert (down.value.status, down.value.reason) == (503, "hub_unavailable")
        # once its answer is older than cache_seconds, the Hub must be asked again: 503 while it is down
        wait_for(lambda: _status(alice.info) == 503, cache + 3, "alice's token to need the Hub again")
        assert time.monotonic() - seen >= cache - 0.5
    finally:
        hub.start()
    assert alice.lease(lease.id).state == "granted"  # the lease ran on through the outage
    assert _client(broker, unseen).info()["user"]["name"] == "carol"
