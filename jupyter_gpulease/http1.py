"""A small blocking HTTP/1.1 client connection: what ``BrokerClient`` speaks to the broker over a kept-alive Unix
or TCP socket.

The broker's answers are small JSON documents, and a ``%%gpu`` cell waits for two of them (the grant, the release
comes later off its path). ``http.client`` sends the request's head and body in two writes and parses the answer's
headers with the ``email`` package; on a host whose CPUs were idle a moment before (a user between two cells) that
cost about 0.4 ms of the grant's 2.5 ms round trip (measured on a 2-core VM, the two clients interleaved against one
broker, 0.3 s apart: 2.51 vs 2.12 ms median). Here a request is one ``sendall`` and the answer is read with a split
on bytes.

What it handles: ``Content-Length`` and ``chunked`` bodies, an answer without either (read to the end),
``Connection: close``, and the one error a kept-alive connection may meet that is no one's fault: the server
closed it while it was idle (:class:`Stale`, so the caller may send again on a new one). A Unix socket is connected
through ``gpulease_protocol.address.connect_unix``: only to a socket and a server of the user's own or root's.
"""

from __future__ import annotations

import socket
from typing import NamedTuple

from gpulease_protocol.address import connect_unix

MAX_HEAD = 64 * 1024  # bytes of status line and headers an answer may have


class Stale(ConnectionError):
    """The server closed the kept-alive connection before it answered anything: the request was not read."""


class BadAnswer(ConnectionError):
    """The bytes that came back are not an HTTP/1.1 answer."""


class Answer(NamedTuple):
    status: int
    headers: dict[str, str]  # names in lower case
    body: bytes


class Connection:
    """One kept-alive connection (not thread-safe: one per thread); opened at the first request."""

    def __init__(self, unix_path: str | None, host: str, port: int, timeout: float) -> None:
        self.unix_path, self.host, self.port, self.timeout = unix_path, host, port, timeout
        self.sock: socket.socket | None = None
        self._buf = b""

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        self._buf = b""

    def request(self, method: str, path: str, headers: dict[str, str], body: bytes | None) -> Answer:
        """Send one request and read its answer. A connection used before that the server closed meanwhile raises
        :class:`Stale`; any other failure closes this connection and raises ``OSError``."""
        reused = self.sock is not None
        if self.sock is None:
            self.sock = self._connect()
        self.sock.settimeout(self.timeout)
        host = self.host if self.unix_path is not None or self.port == 80 else f"{self.host}:{self.port}"
        head = [f"{method} {path} HTTP/1.1", f"Host: {host}"]
        head += [f"{k}: {v}" for k, v in headers.items()]
        if body is not None or method in ("POST", "PUT", "PATCH"):
            head.append(f"Content-Length: {len(body or b'')}")
        data = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + (body or b"")
        try:
            self.sock.sendall(data)
            answer = self._read(method)
        except (Stale, BrokenPipeError, ConnectionResetError) as e:
            self.close()
            if reused:
                raise Stale(str(e) or "the server closed the connection") from None
            raise ConnectionError(f"the server closed the connection without answering ({e})") from None
        except BaseException:
            self.close()  # interrupted or failed mid-request: never reuse a connection with a pending answer
            raise
        if answer.headers.get("connection", "").lower() == "close":
            self.close()
        return answer

    def _connect(self) -> socket.socket:
        if self.unix_path is not None:  # only to a socket and a server of the user's own or root's
            return connect_unix(self.unix_path, self.timeout)
        sock = socket.create_connection((self.host, self.port), self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _more(self, first: bool = False) -> bool:
        """Read what has arrived into the buffer; False at the end of the stream."""
        assert self.sock is not None
        chunk = self.sock.recv(65536)
        if not chunk:
            if first:
                raise Stale("the server closed the connection")
            return False
        self._buf += chunk
        return True

    def _read(self, method: str) -> Answer:
        first = not self._buf
        while (end := self._buf.find(b"\r\n\r\n")) < 0:
            if len(self._buf) > MAX_HEAD:
                raise BadAnswer("the answer's headers are too long")
            if not self._more(first=first):
                raise BadAnswer("the connection closed in the middle of the answer's headers")
            first = False
        head, self._buf = self._buf[:end].decode("latin-1"), self._buf[end + 4:]
        status_line, *lines = head.split("\r\n")
        parts = status_line.split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise BadAnswer(f"not an HTTP/1.1 answer: {status_line[:80]!r}")
        headers: dict[str, str] = {}
        for line in lines:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        status = int(parts[1])
        if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            return Answer(status, headers, b"")
        if "chunked" in headers.get("transfer-encoding", "").lower():
            return Answer(status, headers, self._chunked())
        if "content-length" in headers:
            return Answer(status, headers, self._exactly(int(headers["content-length"])))
        while self._more():  # neither: the body ends with the connection
            pass
        body, self._buf = self._buf, b""
        headers["connection"] = "close"
        return Answer(status, headers, body)

    def _exactly(self, n: int) -> bytes:
        while len(self._buf) < n:
            if not self._more():
                raise BadAnswer("the connection closed in the middle of the answer's body")
        body, self._buf = self._buf[:n], self._buf[n:]
        return body

    def _line(self) -> bytes:
        while (end := self._buf.find(b"\r\n")) < 0:
            if not self._more():
                raise BadAnswer("the connection closed in the middle of a chunked body")
        line, self._buf = self._buf[:end], self._buf[end + 2:]
        return line

    def _chunked(self) -> bytes:
        parts: list[bytes] = []
        while True:
            size = int(self._line().split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                while self._line():  # trailers, up to the empty line
                    pass
                return b"".join(parts)
            parts.append(self._exactly(size))
            self._line()
