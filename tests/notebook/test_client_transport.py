"""The client's transport (``http.client`` on a kept-alive connection, ``BrokerClient``) against a server that
answers what each test scripts, byte for byte, on a real Unix socket: the answer shapes HTTP allows (length, chunked, until close), a
kept-alive connection the server closed while idle (sent again once, on a new connection), and answers that are
not HTTP. The broker itself is the peer in every other client test."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from jupyter_gpulease.client import BrokerClient, BrokerError, BrokerUnreachable

Script = Callable[[socket.socket, bytes], bool]  # (connection, request bytes) -> keep the connection open


class Server:
    """Accepts connections on a Unix socket; each request (head and body) read is handed to ``script``."""

    def __init__(self, path: str, script: Script) -> None:
        self.path, self.script = path, script
        self.requests: list[bytes] = []
        self.connections = 0
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(path)
        self.sock.listen()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._talk, args=(conn,), daemon=True).start()

    def _talk(self, conn: socket.socket) -> None:
        buf = b""
        with conn:
            while True:
                while b"\r\n\r\n" not in buf:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    buf += chunk
                head, _, buf = buf.partition(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                while len(buf) < length:
                    buf += conn.recv(65536)
                request, buf = head + b"\r\n\r\n" + buf[:length], buf[length:]
                self.requests.append(request)
                if not self.script(conn, request):
                    return


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[[Script], tuple[Server, BrokerClient]]]:
    servers: list[Server] = []

    def start(script: Script) -> tuple[Server, BrokerClient]:
        server = Server(str(tmp_path / f"s{len(servers)}.sock"), script)
        servers.append(server)
        return server, BrokerClient(f"unix://{server.path}", token="", timeout=5)

    yield start
    for server in servers:
        server.sock.close()


def answer(body: bytes, status: str = "200 OK", extra: str = "") -> bytes:
    return f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


def test_requests_share_a_kept_alive_connection(serve) -> None:
    server, client = serve(lambda conn, req: conn.sendall(answer(b'{"ok": 1}')) or True)
    assert client.request("POST", "/api/v1/leases", {"gpus": 1}) == {"ok": 1}
    assert client.request("GET", "/api/v1/info") == {"ok": 1}
    assert server.connections == 1
    head, _, body = server.requests[0].partition(b"\r\n\r\n")
    assert head.startswith(b"POST /api/v1/leases HTTP/1.1\r\n") and b"\r\nContent-Length: 11" in head
    assert body == b'{"gpus": 1}'


def test_chunked_and_until_close_answers(serve) -> None:
    def chunked(conn: socket.socket, req: bytes) -> bool:
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"4\r\n{\"a\"\r\n3;ext=1\r\n: 1\r\n1\r\n}\r\n0\r\nX-Trailer: t\r\n\r\n")
        return True

    _, client = serve(chunked)
    assert client.request("GET", "/x") == {"a": 1}
    assert client.request("GET", "/x") == {"a": 1}  # the connection is still usable after a chunked answer

    def until_close(conn: socket.socket, req: bytes) -> bool:
        conn.sendall(b'HTTP/1.1 200 OK\r\n\r\n{"b": ')
        conn.sendall(b"2}")
        return False

    server, client = serve(until_close)
    assert client.request("GET", "/y") == {"b": 2}
    assert client.request("GET", "/y") == {"b": 2}  # a new connection: the last one ended with its body
    assert server.connections == 2


def test_a_kept_alive_connection_the_server_closed_is_replaced_once(serve) -> None:
    def once(conn: socket.socket, req: bytes) -> bool:
        conn.sendall(answer(b"{}"))
        return False  # the server closes after each answer, without saying so (an idle timeout)

    server, client = serve(once)
    for _ in range(3):
        assert client.request("POST", "/api/v1/leases/l-1/heartbeat", {"active": True}) == {}
    assert server.connections == 3 and len(server.requests) == 3  # each request sent once

    def never(conn: socket.socket, req: bytes) -> bool:
        return False  # closes without answering: not stale on a new connection, the broker is away

    _, client = serve(never)
    with pytest.raises(BrokerUnreachable):
        client.request("GET", "/api/v1/info")


def test_errors_and_answers_that_are_not_http(serve) -> None:
    _, client = serve(lambda conn, req: conn.sendall(
        answer(b'{"status": 409, "reason": "conflict", "message": "ended"}', "409 Conflict")) or True)
    with pytest.raises(BrokerError) as e:
        client.request("POST", "/api/v1/leases/l-1/release", {})
    assert (e.value.status, e.value.reason, e.value.message) == (409, "conflict", "ended")

    _, client = serve(lambda conn, req: conn.sendall(b"SSH-2.0-OpenSSH_9.2\r\n\r\n") or False)
    with pytest.raises(BrokerUnreachable):
        client.request("GET", "/api/v1/info")

    _, client = serve(lambda conn, req: conn.sendall(answer(b"<html>proxy error</html>", "502 Bad Gateway")) or True)
    with pytest.raises(BrokerError) as e:
        client.request("GET", "/api/v1/info")
    assert e.value.status == 502 and "proxy error" in e.value.message

    _, client = serve(lambda conn, req: conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n{}") or False)
    with pytest.raises(BrokerUnreachable):
        client.request("GET", "/api/v1/info")


def test_a_timeout_closes_the_connection_and_says_the_broker_did_not_answer(serve) -> None:
    gate = threading.Event()
    _, client = serve(lambda conn, req: gate.wait(5) and False)
    client.timeout = 0.2
    with pytest.raises(BrokerUnreachable, match="timed out"):
        client.request("GET", "/api/v1/info")
    gate.set()
    assert client._local.conn.sock is None  # never reused with an answer pending


def test_the_token_goes_over_the_socket_only_when_the_server_asks_for_it(serve, monkeypatch) -> None:
    """Over a Unix socket the uid names the caller: the environment's token is not sent, unless an answer is a 401
    with a Bearer challenge; then that request again with it, and every later one (the same checked server)."""
    monkeypatch.setenv("GPULEASE_TOKEN", "tok-1")

    def hub_mode(conn: socket.socket, req: bytes) -> bool:
        if b"\r\nAuthorization: Bearer tok-1" in req:
            conn.sendall(answer(b'{"ok": 1}'))
        else:
            conn.sendall(answer(b'{"status": 401, "reason": "unauthorized", "message": "token"}', "401 Unauthorized",
                                'WWW-Authenticate: Bearer realm="gpulease"\r\n'))
        return True

    server, _ = serve(hub_mode)
    client = BrokerClient(f"unix://{server.path}", timeout=5)
    assert client.request("POST", "/api/v1/leases", {"gpus": 1}) == {"ok": 1}
    assert client.request("GET", "/api/v1/info") == {"ok": 1}
    sent = [r.lower() for r in server.requests]
    assert [b"authorization" in r for r in sent] == [False, True, True]
    assert sent[1].endswith(b'{"gpus": 1}')  # the same request, body and all

    def no_challenge(conn: socket.socket, req: bytes) -> bool:
        conn.sendall(answer(b'{"status": 401, "reason": "unauthorized", "message": "no"}', "401 Unauthorized"))
        return True

    server, _ = serve(no_challenge)
    with pytest.raises(BrokerError) as e:
        BrokerClient(f"unix://{server.path}", timeout=5).request("GET", "/api/v1/info")
    assert e.value.status == 401 and len(server.requests) == 1 and b"authorization" not in server.requests[0].lower()
