"""JupyterHub as the broker's source of identity, with a real Hub, real single-user servers and real kernels.

A container-like deployment: every single-user server runs under the same uid (SimpleLocalProcessSpawner), all
reach the broker's one Unix socket, and the broker runs with ``LeaseBroker.identity = 'hub'``, so the Hub token
that servers and kernels present by themselves ($JUPYTERHUB_API_TOKEN) names the user, never the uid. One Hub and
one broker serve the whole module; the test that stops the Hub runs last.

The broker asks the Hub on every request here (``HubIdentity.cache_seconds = 0``), so a revoked token is refused
at once; with the default cache it would keep working for up to that many seconds.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from broker_process import BrokerProcess
from hub_process import HubProcess, hub_missing
from receivers import SmtpReceiver

from jupyter_gpulease.client import BrokerClient, BrokerError

pytestmark = pytest.mark.timeout(600)

ADMIN_SCOPE = "custom:gpulease:admin"
BROKER_SERVICE_TOKEN = "gpulease-service-" + "0" * 32


def _hub_config(broker_url: str, workdir: Path) -> str:
    return textwrap.dedent(f"""
        c.JupyterHub.spawner_class = "simple"  # every user's server under the Hub's own uid, as in containers
        c.SimpleLocalProcessSpawner.home_dir_template = "{workdir}/home/{{username}}"
        c.Spawner.args = {["--allow-root"] if os.geteuid() == 0 else []!r}
        c.Spawner.environment = {{"GPULEASE_BROKER": {broker_url!r},
                                  "GPULEASE_ARTIFACT_ROOT": "{workdir}/artifacts"}}
        c.JupyterHub.custom_scopes = {{{ADMIN_SCOPE!r}: {{"description": "Act on every GPU lease"}}}}
        c.JupyterHub.load_roles.append({{"name": "gpulease-admin", "users": ["carol"], "scopes": [{ADMIN_SCOPE!r}]}})
        # servers' tokens carry the admin scope for the users who hold it (the Hub drops it for the others)
        c.Spawner.server_token_scopes = ["access:servers!server", "users:activity!user", "read:users:name!user",
                                         "read:users:groups!user", {ADMIN_SCOPE!r}]
        c.JupyterHub.load_groups = {{"ml-team": {{"users": ["alice", "dave"]}}}}
        # the broker as an external service: it needs no scopes to identify users by their own tokens; its own
        # token reads users' e-mail addresses from their auth_state, for notifications
        c.JupyterHub.services.append({{"name": "gpulease", "api_token": {BROKER_SERVICE_TOKEN!r}}})
        c.JupyterHub.load_roles.append({{"name": "gpulease-mail", "services": ["gpulease"],
                                         "scopes": ["read:users", "admin:auth_state"]}})
        # an authenticator that keeps an e-mail address in auth_state, as GitHub's or Generic OAuth's can
        from jupyterhub.auth import DummyAuthenticator

        class MailAuthenticator(DummyAuthenticator):
            async def authenticate(self, handler, data):
                name = await super().authenticate(handler, data)
                name = name["name"] if isinstance(name, dict) else name
                return name and {{"name": name, "auth_state": {{"email": name + "@example.org"}}}}

        c.JupyterHub.authenticator_class = MailAuthenticator
        c.Authenticator.enable_auth_state = True
        """)


@pytest.fixture(scope="module")
def mailbox() -> Iterator[SmtpReceiver]:
    r = SmtpReceiver()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def hub_broker(mailbox: SmtpReceiver) -> Iterator[tuple[HubProcess, BrokerProcess]]:
    why = hub_missing()
    if why:
        pytest.skip(why)
    workdir = Path(tempfile.mkdtemp(prefix="gl-hub"))
    os.chmod(workdir, 0o755)
    hub_dir = workdir / "hub"
    hub_dir.mkdir()
    broker_dir = workdir / "broker"
    broker_dir.mkdir()
    # one group quota: ml-team (a Hub group) holds at most 1 GPU at once
    (broker_dir / "lease_broker_config.py").write_text(
        "c.LeasePolicy.group_quotas = {'ml-team': {'max_gpus': 1}}\nc.LeasePolicy.unix_groups = False\n"
        # mail to the address the Hub keeps for a user (no c.Notifier.emails entry)
        f"c.Notifier.smtp_host = '127.0.0.1'\nc.Notifier.smtp_port = {mailbox.port}\n"
        "c.Notifier.default_events = ['ended']\n")
    socket_path = os.path.join(workdir, "b.sock")  # one socket for every server, as when mounted into containers
    hub = HubProcess(hub_dir, env={"JUPYTERHUB_CRYPT_KEY": "ab" * 32})  # auth_state is kept encrypted
    broker = BrokerProcess(broker_dir, gpus=4, socket_path=socket_path, args=[
        "--tick=0.1", "--identity=hub", f"--HubIdentity.api_url={hub.api_url}", "--HubIdentity.cache_seconds=0",
        f"--HubIdentity.api_token={BROKER_SERVICE_TOKEN}"])
    hub_dir.joinpath("jupyterhub_config.py").write_text(
        hub_dir.joinpath("jupyterhub_config.py").read_text() + _hub_config(broker.url, workdir))
    hub.start()
    try:
        for name in ("alice", "bob", "carol", "dave"):
            hub.user(name)
        broker.start()
        yield hub, broker
    finally:
        broker.stop()
        hub.shutdown()
        shutil.rmtree(workdir, ignore_errors=True)


def _client(broker: BrokerProcess, token: str | None) -> BrokerClient:
    return BrokerClient(broker.url, token=token or "")


def _status(call) -> int:  # type: ignore[no-untyped-def]
    try:
        call()
    except BrokerError as e:
        return e.status
    return 200


# ----------------------------------------------------------------------------- same uid, one socket
def test_same_uid_servers_are_told_apart_by_their_hub_tokens(hub_broker) -> None:
    """Two users' servers run under one uid and share the socket: each kernel is its Hub user (with no
    configuration), sees only its own leases, and cannot renew, release or attach to the other's."""
    hub, broker = hub_broker
    alice_token, _ = hub.token("alice")
    bob_token, _ = hub.token("bob")
    hub.start_server("alice")
    hub.start_server("bob")
    # alice's kernel: a %%gpu cell, then a lease held past the cell, found by nothing but its environment
    # (alice is in ml-team, which may hold 1 GPU at once: the cell's lease ends before the next is asked for)
    out = hub.run_in_kernel(
        "alice", alice_token, "%load_ext jupyter_gpulease",
        "%%gpu 1\nimport os\nprint('devices', os.environ['CUDA_VISIBLE_DEVICES'] or '(none)')",
        textwrap.dedent("""
            from jupyter_gpulease.client import BrokerClient
            c = BrokerClient()
            print("user", c.info()["user"]["name"], "admin", c.info()["user"]["admin"])
            held = c.request_lease(1, heartbeat=False, wait=30)  # the cell's lease is released as its worker exits
            print("held", held.id, held.state)
            """))
    assert out["error"] is None, out
    assert "devices " in out["stdout"] and "devices (none)" not in out["stdout"], out
    assert "user alice admin False" in out["stdout"], out
    held = out["stdout"].split("held ")[1].split()[0]
    assert out["stdout"].split("held ")[1].split()[1] == "granted", out
    # bob's kernel, same uid, same socket: alice's lease is not his
    out = hub.run_in_kernel("bob", bob_token, textwrap.dedent(f"""
        import os
        from jupyter_gpulease.client import BrokerClient, BrokerError
        c = BrokerClient()
        def status(call):
            try:
                call()
                return 200
            except BrokerError as e:
                return e.status
        print("user", c.info()["user"]["name"])
        print("listed", [x.id for x in c.leases()])
        print("see", status(lambda: c.lease({held!r})))
        print("renew", status(lambda: c.renew({held!r}, 60)))
        print("release", status(lambda: c.release({held!r})))
        print("revoke", status(lambda: c.revoke({held!r}, "x")))
        print("attach", status(lambda: c.attach({held!r}, os.getpid())))
        """))
    assert out["error"] is None, out
    lines = dict(line.split(" ", 1) for line in out["stdout"].splitlines())
    assert lines == {"user": "bob", "listed": "[]", "see": "403", "renew": "403", "release": "403",
                     "revoke": "403", "attach": "403"}, out
    # the lease is untouched, and alice still holds it
    alice = _client(broker, alice_token)
    assert alice.lease(held).state == "granted"
    assert [x.id for x in alice.leases()] == [held]
    alice.release(held)


# ----------------------------------------------------------------------------- groups and admins
def test_hub_group_quota_holds(hub_broker) -> None:
    """ml-team (a Hub group: alice, dave) may hold 1 GPU at once: dave waits while alice holds one, bob (not in
    the group) does not, and dave gets the GPU when alice releases hers."""
    hub, broker = hub_broker
    alice, bob, dave = (_client(broker, hub.token(n)[0]) for n in ("alice", "bob", "dave"))
    first = alice.request_lease(1, heartbeat=False)
    assert first.state == "granted"
    waiting = dave.request_lease(1, heartbeat=False)
    other = bob.request_lease(1, heartbeat=False)
    assert (waiting.state, other.state) == ("queued", "granted")
    alice.release(first.id)
    assert dave.lease(waiting.id, wait=30).state == "granted"
    dave.release(waiting.id)
    bob.release(other.id)


def test_hub_groups_are_known_after_a_restart_before_their_users_call(hub_broker) -> None:
    """The broker stores the Hub groups it learned: after a restart, alice's lease counts for ml-team although
    alice has not called since, so dave (ml-team) waits."""
    hub, broker = hub_broker
    alice, dave = (_client(broker, hub.token(n)[0]) for n in ("alice", "dave"))
    held = alice.request_lease(1, heartbeat=False)
    assert held.state == "granted"
    broker.kill9()
    broker.start()
    waiting = dave.request_lease(1, heartbeat=False)
    assert waiting.state == "queued", waiting.raw
    alice.release(held.id)
    assert dave.lease(waiting.id, wait=30).state == "granted"
    dave.release(waiting.id)


def test_hub_admin_scope_makes_a_broker_admin(hub_broker) -> None:
    """carol holds custom:gpulease:admin through a Hub role: she sees and revokes alice's lease; bob cannot."""
    hub, broker = hub_broker
    alice = _client(broker, hub.token("alice")[0])
    carol = _client(broker, hub.token("carol")[0])
    bob = _client(broker, hub.token("bob")[0])
    assert (carol.info()["user"]["admin"], bob.info()["user"]["admin"]) == (True, False)
    lease = alice.request_lease(1, heartbeat=False)
    assert _status(lambda: bob.revoke(lease.id, "x")) == 403
    assert lease.id in [x.id for x in carol.leases(everyone=True)]
    assert carol.revoke(lease.id, "admin").state == "revoked"
    assert alice.lease(lease.id).state == "revoked"


def test_admin_scope_reaches_the_admin_through_her_server(hub_broker) -> None:
    """The admin scope travels in carol's server token (Spawner.server_token_scopes): her kernel is an admin."""
    hub, broker = hub_broker
    token, _ = hub.token("carol")
    hub.start_server("carol")
    out = hub.run_in_kernel("carol", token, "from jupyter_gpulease.client import BrokerClient\n"
                            "print(BrokerClient().info()['user'])")
    assert out["error"] is None, out
    assert "'name': 'carol'" in out["stdout"] and "'admin': True" in out["stdout"], out


@pytest.mark.browser
def test_a_hub_admin_revokes_another_users_lease_from_the_sidebar(hub_broker) -> None:
    """carol logs in through the Hub in a real Chromium, opens her JupyterLab at /user/carol/lab behind the Hub's
    proxy, and revokes bob's lease from the sidebar's admin list (her server's token carries the admin scope)."""
    from browser_support import CHROMIUM, WAIT_MS, screenshot, show_panel
    from playwright.sync_api import expect, sync_playwright

    hub, broker = hub_broker
    bob = _client(broker, hub.token("bob")[0])
    lease = bob.request_lease(1, heartbeat=False, duration_seconds=600)
    hub.start_server("carol")
    expect.set_options(timeout=WAIT_MS)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.set_default_timeout(WAIT_MS)
        try:
            page.goto(f"{hub.url}/hub/login?next=/user/carol/lab")
            page.fill("#username_input", "carol")
            page.fill("#password_input", "test-password")
            page.click("#login_submit")
            page.wait_for_url(f"{hub.url}/user/carol/lab**")
            page.wait_for_selector("#jupyterlab-splash", state="detached")
            show_panel(page)
            row = page.locator(f'#gpulease-panel [data-section="all-leases"] [data-lease-id="{lease.id}"]')
            expect(row).to_contain_text(f"bob: {lease.id}")
            screenshot(page, "hub-admin-sidebar.png")
            row.get_by_role("button", name=f"Revoke lease {lease.id}").click()
            dialog = page.locator(".jp-Dialog")
            dialog.locator("input").fill("maintenance window")
            dialog.get_by_role("button", name="Revoke").click()
            expect(row).to_have_count(0)
        finally:
            browser.close()
    ended = bob.lease(lease.id)
    assert ended.state == "revoked" and "maintenance" in ended.reason


def test_unix_plus_hub_takes_a_token_when_sent_else_the_socket_uid(hub_broker, tmp_path) -> None:
    """identity 'unix+hub' (a host where some callers are Unix users and some are Hub servers): a Hub token names
    its Hub user (written 'hub:NAME': not the Unix user of that name); a caller without a token is its Unix uid; a
    bad token is refused, never taken as the uid."""
    import pwd

    hub, _ = hub_broker
    both = BrokerProcess(tmp_path / "both", gpus=2, args=[
        "--tick=0.1", "--identity=unix+hub", f"--HubIdentity.api_url={hub.api_url}"]).start()
    try:
        assert _client(both, hub.token("bob")[0]).info()["user"]["name"] == "hub:bob"
        me = pwd.getpwuid(os.getuid()).pw_name
        assert _client(both, None).info()["user"]["name"] == me
        assert _status(lambda: _client(both, "f" * 32).info()) == 401
    finally:
        both.stop()


def test_mail_goes_to_the_address_the_hub_keeps(hub_broker, mailbox: SmtpReceiver) -> None:
    """Notifications by e-mail with no address in the broker's config: bob logs in to the Hub, whose
    authenticator keeps his address in auth_state; the broker reads it with its own service token."""
    import http.cookiejar
    import urllib.parse
    import urllib.request

    from waiting import wait_for

    hub, broker = hub_broker
    jar = http.cookiejar.CookieJar()
    web = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    web.open(f"{hub.url}/hub/login", timeout=30).read()
    xsrf = next(c.value for c in jar if c.name == "_xsrf")
    form = urllib.parse.urlencode({"username": "bob", "password": "test-password", "_xsrf": xsrf}).encode()
    web.open(urllib.request.Request(f"{hub.url}/hub/login?next=/hub/home", data=form), timeout=60).read()
    bob = _client(broker, hub.token("bob")[0])
    carol = _client(broker, hub.token("carol")[0])
    lease = bob.request_lease(1, heartbeat=False)
    carol.revoke(lease.id, "maintenance")  # an end bob did not ask for: 'ended'
    wait_for(lambda: [m for to, m in mailbox.mails if to == ["bob@example.org"]], timeout=30,
             what="the mail to bob's Hub address")
    (mail,) = [m for to, m in mailbox.mails if to == ["bob@example.org"]]
    assert lease.id in mail["Subject"] and "revoked" in mail["Subject"] and "maintenance" in mail.get_payload()
    assert BROKER_SERVICE_TOKEN not in broker.log_path.read_text()


# ----------------------------------------------------------------------------- bad tokens
def test_no_forged_or_revoked_token_is_refused_with_the_fix(hub_broker) -> None:
    hub, broker = hub_broker
    with pytest.raises(BrokerError) as none:
        _client(broker, None).info()  # the socket's uid alone names no one in 'hub' mode
    assert none.value.status == 401
    assert "JupyterHub token" in none.value.message and "JUPYTERHUB_API_TOKEN" in none.value.message
    with pytest.raises(BrokerError) as forged:
        _client(broker, "f" * 32).info()
    assert (forged.value.status, forged.value.reason) == (401, "invalid_token")
    assert hub.api_url in forged.value.message and "Restart your server" in forged.value.message
    token, token_id = hub.token("alice")
    alice = _client(broker, token)
    assert alice.info()["user"]["name"] == "alice"
    hub.revoke("alice", token_id)
    with pytest.raises(BrokerError) as revoked:
        alice.info()
    assert (revoked.value.status, revoked.value.reason) == (401, "invalid_token")
    with pytest.raises(BrokerError) as broker_token:
        _client(broker, "gpl_" + "x" * 40).info()  # a broker token that was never issued
    assert broker_token.value.status == 401 and "lease-broker token create" in broker_token.value.message


# ----------------------------------------------------------------------------- the Hub down (last: stops it)
def test_hub_down_keeps_leases_and_refuses_tokens_it_cannot_check_with_503(hub_broker) -> None:
    """With cache_seconds = 0 no answer is kept: while the Hub is down every Hub token gets 503 naming the Hub,
    and granted leases run on (test_hub_security checks what a kept answer does through an outage)."""
    hub, broker = hub_broker
    token, _ = hub.token("alice")
    unseen, _ = hub.token("bob")  # issued while the Hub is up, never shown to the broker
    alice = _client(broker, token)
    lease = alice.request_lease(1, heartbeat=False)
    assert lease.state == "granted"
    hub.stop()
    try:
        for who in (alice, _client(broker, unseen)):
            with pytest.raises(BrokerError) as down:
                who.info()
            assert (down.value.status, down.value.reason) == (503, "hub_unavailable")
            assert hub.api_url in down.value.message
    finally:
        hub.start()
    # back: the token the broker could not check is accepted, nothing was lost
    assert _client(broker, unseen).info()["user"]["name"] == "bob"
    assert alice.lease(lease.id).state == "granted"
    alice.release(lease.id)
