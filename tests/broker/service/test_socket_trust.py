"""Sockets a client can trust (issue 30, item 2), with real Unix users: a victim (the second user, with
GPULEASE_TOKEN and JUPYTERHUB_API_TOKEN set and no XDG_RUNTIME_DIR) and an attacker (the third user) who serves a
fake broker that records every byte it is sent.

- The attacker made the victim's per-user socket directory first: the CLI, ``BrokerClient`` and the server
  extension's event relay refuse it before sending anything, naming the socket and its owner.
- A socket in a directory others can write: refused, also the user's own.
- A socket whose path is trusted (root's directory, root's socket file) but that the attacker listens on: refused
  by the server's uid (SO_PEERCRED).
- The real broker: no token over its socket (identity 'unix+hub' would take one), a broker with identity 'hub'
  asks for it and gets it, and over TCP the token is sent as before.
- The broker refuses to make its socket or its store in a directory another user made or owns (one line), and
  makes the per-user socket's directory 0700.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import pwd  # also imported before the children drop their privileges: then they may not read the stdlib
import shutil
import signal
import socket
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from broker_process import BrokerProcess
from users import THIRD_USER, as_user, second_user, third_user  # noqa: F401  (fixtures)

from gpulease_protocol import address
from gpulease_protocol.address import UntrustedSocket
from jupyter_gpulease.cli.main import main as gpulease_cli
from jupyter_gpulease.client import BrokerClient, BrokerError
from jupyter_gpulease.serverext.relay import BrokerRelay, connect_events
from lease_broker.service import StartupError, bind_unix

pytestmark = pytest.mark.attack  # each test is an attack that must fail (BENCHMARKS.md: Reliability)

TOKEN = "victim-hub-token-" + "7" * 24
SENTINEL = b"SENTINEL / HTTP/1.1\r\n\r\n"


class FakeBroker:
    """A fake broker in a forked child, as ``pw`` (the attacker) when given: it answers every request with a
    plausible 200 and reports each connection it accepted with the bytes it was sent. ``bound``: a socket that
    someone else (root) bound, on which the child listens after dropping to ``pw``."""

    def __init__(self, path: str, pw: pwd.struct_passwd | None = None, dir_mode: int | None = None,
                 bound: socket.socket | None = None) -> None:
        self.path = path
        records_r, records_w = os.pipe()
        ready_r, ready_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the fake broker
            try:
                os.close(records_r)
                os.close(ready_r)
                if pw is not None:
                    os.setgroups([])
                    os.setgid(pw.pw_gid)
                    os.setuid(pw.pw_uid)
                sock = bound
                if sock is None:
                    if dir_mode is not None:
                        os.mkdir(os.path.dirname(path))
                        os.chmod(os.path.dirname(path), dir_mode)
                    sock = socket.socket(socket.AF_UNIX)
                    sock.bind(path)
                    os.chmod(path, 0o666)  # anyone may connect, as to a real broker
                sock.listen(16)  # SO_PEERCRED tells a client who called listen()
                os.write(ready_w, b"ok")
                self._serve(sock, records_w)
            except BaseException as e:
                os.write(ready_w, repr(e).encode())
            finally:
                os._exit(0)
        os.close(records_w)
        os.close(ready_w)
        ready = os.read(ready_r, 4096)
        os.close(ready_r)
        self._records = records_r
        if ready != b"ok":
            self.stop()
            raise RuntimeError(f"the fake broker did not start: {ready.decode(errors='replace')}")

    @staticmethod
    def _serve(sock: socket.socket, records: int) -> None:
        body = json.dumps({"version": "fake", "broker": "fake", "user": {"name": "you", "uid": 0, "admin": True}})
        answer = (f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                  f"Connection: close\r\n\r\n{body}").encode()
        while True:
            conn, _ = sock.accept()
            data = b""
            try:
                conn.settimeout(5)
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                if data and not data.startswith(SENTINEL):
                    conn.sendall(answer)
            except OSError:
                pass
            conn.close()
            os.write(records, json.dumps(data.decode("latin-1")).encode() + b"\n")

    def received(self) -> list[str]:
        """What each connection accepted so far was sent, in order (``""``: a connection that sent nothing). A
        connection of the test's own goes last, and its record is awaited, so every earlier one is counted."""
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(self.path)
            s.sendall(SENTINEL)
        seen: list[str] = []
        buf = b""
        while True:
            while b"\n" not in buf:
                buf += os.read(self._records, 65536)  # the child writes the sentinel's record (the test's timeout)
            line, buf = buf.split(b"\n", 1)
            text = json.loads(line)
            if text.startswith(SENTINEL.decode()):
                return seen
            seen.append(text)

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        with contextlib.suppress(OSError):
            os.close(self._records)


def _as_victim(pw: pwd.struct_passwd, broker: str | None = None) -> dict:
    """As the victim, with both tokens in the environment and no XDG_RUNTIME_DIR: `gpulease status` (its exit
    status and stderr) and ``BrokerClient().info()`` (the error it raised, or what it believed)."""

    def victim() -> dict:
        os.environ.update({"GPULEASE_TOKEN": TOKEN, "JUPYTERHUB_API_TOKEN": TOKEN})
        for name in ("XDG_RUNTIME_DIR", "GPULEASE_BROKER"):
            os.environ.pop(name, None)
        if broker:
            os.environ["GPULEASE_BROKER"] = broker
        err, out = io.StringIO(), io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                code: object = gpulease_cli(["status"])
            except Exception as e:  # the old client believed the fake's answers and crashed on their shape
                code = repr(e)
        try:
            client: dict = {"believed": BrokerClient().info()}
        except BrokerError as e:
            client = {"status": e.status, "reason": e.reason, "message": e.message}
        return {"url": address.broker_url(), "code": code, "stderr": err.getvalue(), "client": client}

    return as_user(pw, victim)


@pytest.fixture
def victim_dir(second_user) -> Iterator[str]:  # noqa: F811
    """The victim's per-user socket directory, ``/tmp/gpulease-<uid>``: absent before and after the test."""
    if os.path.exists(address.SYSTEM_SOCKET):
        pytest.skip(f"{address.SYSTEM_SOCKET} exists on this host: clients would use it, not the per-user socket")
    path = f"/tmp/gpulease-{second_user.pw_uid}"
    shutil.rmtree(path, ignore_errors=True)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _refusal(message: str, path: str, owner: str) -> None:
    assert path in message and owner in message and "Traceback" not in message, message


# ----------------------------------------------------------------------------- a squatted per-user socket
def test_a_socket_another_user_squatted_gets_nothing(victim_dir, second_user, third_user) -> None:  # noqa: F811
    fake = FakeBroker(os.path.join(victim_dir, "broker.sock"), pw=third_user, dir_mode=0o755)
    try:
        out = _as_victim(second_user)
        sock = os.path.join(victim_dir, "broker.sock")
        assert out["url"] == "unix://" + sock  # the default the victim looks at
        assert out["code"] == 1 and out["stderr"].startswith("gpulease: ") and len(out["stderr"].splitlines()) == 1
        _refusal(out["stderr"], sock, THIRD_USER)
        assert (out["client"]["status"], out["client"]["reason"]) == (503, "untrusted_socket")
        _refusal(out["client"]["message"], sock, THIRD_USER)
        # the Jupyter server's event relay (as root here: the attacker is no one root trusts either)
        with pytest.raises(UntrustedSocket) as relay:
            asyncio.run(connect_events("unix://" + sock))
        _refusal(str(relay.value), sock, THIRD_USER)
        assert fake.received() == []  # not even a connection: no request, no token
    finally:
        fake.stop()


@pytest.mark.parametrize("mode", [0o775, 0o1777])
def test_a_socket_in_a_directory_others_can_write_is_refused(tmp_path: Path, mode: int) -> None:
    """The user's own directory (root's here), but writable by its group or by everyone (sticky or not): someone
    else could have put the socket there, or replace it."""
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, mode)
    fake = FakeBroker(str(d / "b.sock"))
    try:
        with pytest.raises(BrokerError) as e:
            BrokerClient(f"unix://{d}/b.sock", token=TOKEN).info()
        assert e.value.reason == "untrusted_socket"
        assert str(d) in e.value.message and f"{mode:o}" in e.value.message
        async def proxied() -> None:  # the server extension's proxy refuses it too
            await BrokerRelay(f"unix://{d}/b.sock", 5.0).fetch("GET", "/api/v1/info", None)

        with pytest.raises(UntrustedSocket):
            asyncio.run(proxied())
        assert fake.received() == []
    finally:
        fake.stop()


def test_a_server_of_another_user_behind_a_trusted_path_is_refused_by_its_uid(second_user, third_user) -> None:  # noqa: F811
    """Root made the directory (0755) and the socket; the attacker listens on it (the bound socket handed over):
    the path passes, the server's uid does not."""
    d = tempfile.mkdtemp(prefix="gl-peer")
    os.chmod(d, 0o755)
    path = os.path.join(d, "broker.sock")
    bound = socket.socket(socket.AF_UNIX)
    bound.bind(path)
    os.chmod(path, 0o666)
    fake = FakeBroker(path, pw=third_user, bound=bound)
    bound.close()
    try:
        out = _as_victim(second_user, broker="unix://" + path)
        assert out["code"] == 1
        _refusal(out["stderr"], path, THIRD_USER)
        assert "served by" in out["stderr"] and str(fake.pid) in out["stderr"]  # the process, by its pid
        assert out["client"]["reason"] == "untrusted_socket"
        with pytest.raises(UntrustedSocket) as relay:
            asyncio.run(connect_events("unix://" + path))
        _refusal(str(relay.value), path, THIRD_USER)
        received = fake.received()
        assert received and set(received) == {""}  # connected, checked, closed: not one byte sent
    finally:
        fake.stop()
        shutil.rmtree(d, ignore_errors=True)


# ----------------------------------------------------------------------------- tokens and the real broker
def _hub_args(mode: str) -> list[str]:
    # the Hub is never asked: a broker token (gpl_...) is checked by the broker itself
    return ["--tick=0.1", f"--identity={mode}", "--HubIdentity.api_url=http://127.0.0.1:9/hub/api"]


def _token(b: BrokerProcess, user: str) -> str:
    from test_openapi import token_for

    return token_for(b, user)


def _challenge(path: str) -> tuple[int, str]:
    """Status and WWW-Authenticate of GET /api/v1/info sent without a token."""
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(path)
        s.sendall(b"GET /api/v1/info HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head = data.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:])}
    return int(head[0].split()[1]), headers.get("www-authenticate", "")


def test_no_token_over_the_socket_unless_the_broker_asks(tmp_path: Path, monkeypatch) -> None:
    me = pwd.getpwuid(os.geteuid()).pw_name
    # 'unix+hub' takes a token when one is sent: the client sends none over the socket, so it is its uid
    both = BrokerProcess(tmp_path / "both", gpus=1, args=_hub_args("unix+hub"))
    bob = _token(both, "bob")
    both.start()
    try:
        monkeypatch.setenv("GPULEASE_TOKEN", bob)
        assert BrokerClient(both.url).info()["user"]["name"] == me
        assert "bob" in BrokerClient(both.url, token=bob).info()["user"]["name"]  # a token given on purpose: sent
    finally:
        both.stop()
    # 'hub' names callers by token on its socket too: it asks (401 with a Bearer challenge), the client answers
    hub = BrokerProcess(tmp_path / "hub", gpus=1, args=_hub_args("hub"))
    carol = _token(hub, "carol")
    hub.start()
    try:
        status, challenge = _challenge(hub.socket)
        assert status == 401 and challenge.lower().startswith("bearer")
        monkeypatch.setenv("GPULEASE_TOKEN", carol)
        c = BrokerClient(hub.url)
        assert "carol" in c.info()["user"]["name"]
        lease = c.request_lease(1, heartbeat=False)
        assert "carol" in c.release(lease.id).user

        async def first_event() -> dict:  # the server extension's event relay: the same challenge, the same answer
            ws = await connect_events(hub.url)
            try:
                return dict(json.loads(await ws.read_message()))
            finally:
                ws.close()

        assert asyncio.run(first_event())["type"] == "hello"

        async def proxied_info() -> dict:  # the server extension's proxy: the same challenge, the same answer
            relay = BrokerRelay(hub.url, 5.0)
            try:
                return dict(json.loads((await relay.fetch("GET", "/api/v1/info", None)).body))
            finally:
                relay.close()

        assert "carol" in asyncio.run(proxied_info())["user"]["name"]
        monkeypatch.delenv("GPULEASE_TOKEN")
        monkeypatch.delenv("JUPYTERHUB_API_TOKEN", raising=False)
        with pytest.raises(BrokerError) as none:
            BrokerClient(hub.url).info()  # no token to give: the broker's 401 as it is
        assert none.value.status == 401
    finally:
        hub.stop()


def test_the_token_still_goes_over_tcp(tmp_path: Path, monkeypatch) -> None:
    from test_openapi import free_port

    port = free_port()
    b = BrokerProcess(tmp_path / "tcp", gpus=1, args=["--tick=0.1", f"--port={port}"])
    bob = _token(b, "bob")
    b.start()
    try:
        monkeypatch.setenv("GPULEASE_TOKEN", bob)
        assert "bob" in BrokerClient(f"http://127.0.0.1:{port}").info()["user"]["name"]
    finally:
        b.stop()


# ----------------------------------------------------------------------------- the broker's own socket and store
@pytest.fixture
def theirs(third_user) -> Iterator[Callable[[int], Path]]:  # noqa: F811
    """A directory the attacker owns, with the given mode, in a directory of root's."""
    base = Path(tempfile.mkdtemp(prefix="gl-theirs"))
    os.chmod(base, 0o755)

    def make(mode: int) -> Path:
        d = base / f"d{mode:o}"
        d.mkdir()
        os.chown(d, third_user.pw_uid, third_user.pw_gid)
        os.chmod(d, mode)
        return d

    yield make
    shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("what", ["socket", "store"])
@pytest.mark.parametrize("mode", [0o1777, 0o755])
def test_broker_refuses_a_socket_or_store_in_another_users_directory(tmp_path: Path, theirs, what: str,
                                                                     mode: int) -> None:
    d = theirs(mode)
    b = BrokerProcess(tmp_path / "b", gpus=1, socket_path=str(d / "b.sock") if what == "socket" else None)
    if what == "store":
        b.db = str(d / "leases.db")
    try:
        with pytest.raises(RuntimeError) as e:
            b.start()
    finally:
        b.stop()  # a broker that started anyway (the attack worked) is not left running
    (line,) = [x for x in str(e.value).splitlines() if x.startswith("lease-broker:")]
    target = str(d / ("b.sock" if what == "socket" else "leases.db"))
    assert "Traceback" not in str(e.value)
    _refusal(line, target, THIRD_USER)
    assert ("--socket" if what == "socket" else "--db") in line
    assert os.listdir(d) == []  # nothing made there


def test_per_user_socket_directory_is_private_and_a_squatted_one_is_refused(victim_dir, second_user,  # noqa: F811
                                                                            third_user) -> None:  # noqa: F811
    def bind() -> dict:
        os.environ.pop("XDG_RUNTIME_DIR", None)
        path = address.per_user_socket()
        try:
            bind_unix(path).close()
        except StartupError as e:
            return {"refused": e.message}
        st = os.stat(os.path.dirname(path))
        return {"path": path, "mode": stat.S_IMODE(st.st_mode), "uid": st.st_uid}

    out = as_user(second_user, bind)
    assert out == {"path": os.path.join(victim_dir, "broker.sock"), "mode": 0o700, "uid": second_user.pw_uid}
    shutil.rmtree(victim_dir)

    def squat() -> None:
        os.mkdir(victim_dir)
        os.chmod(victim_dir, 0o1777)

    as_user(third_user, squat)
    out = as_user(second_user, bind)
    _refusal(out["refused"], victim_dir, THIRD_USER)
    assert os.listdir(victim_dir) == []

