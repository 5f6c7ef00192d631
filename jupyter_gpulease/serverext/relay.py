"""The Jupyter server's asynchronous way to the broker (over a Unix socket or TCP), from the server's event loop:
REST requests (:class:`BrokerRelay`, what the allow-listed proxy forwards) and the event websocket
(:func:`connect_events`). Tornado's clients connect; :class:`UnixResolver` points them at the Unix socket.

Over a Unix socket, the socket and the server behind it are checked first (``address.connect_unix``, on a
connection of its own that sends nothing) before tornado connects and sends the request: with the socket's
path trusted, only this user or root could put another server behind it meanwhile. The token goes over TCP, and
over a Unix socket only when the broker asks for it (``address.asks_for_token``), as ``BrokerClient`` does."""

from __future__ import annotations

import asyncio
import socket
import urllib.parse
from typing import Any

from tornado import httpclient, netutil, simple_httpclient, websocket

from gpulease_protocol.address import asks_for_token, auth_headers, client_token, connect_unix


class UnixResolver(netutil.Resolver):
    """Resolve every host to one Unix socket path, so tornado's clients can talk to a Unix-socket broker; only a
    socket and a server of the user's own or root's (``address.connect_unix``, else ``UntrustedSocket``)."""

    def initialize(self, path: str, timeout: float = 5.0) -> None:
        self.path, self.timeout = path, timeout

    async def resolve(self, host: str, port: int, family: socket.AddressFamily = socket.AF_UNSPEC) -> list[Any]:
        await asyncio.get_running_loop().run_in_executor(None, self._check)
        return [(socket.AF_UNIX, self.path)]

    def _check(self) -> None:
        connect_unix(self.path, self.timeout).close()


class BrokerRelay:
    """Requests to the broker at ``broker_url`` as this process's user, each bounded by ``timeout`` seconds.
    Made in the running event loop (its HTTP client belongs to that loop); :meth:`close` when done."""

    def __init__(self, broker_url: str, timeout: float) -> None:
        parsed = urllib.parse.urlparse(broker_url)
        self.unix = (parsed.path or parsed.netloc) if parsed.scheme == "unix" else None
        self.origin = "http://localhost" if self.unix else f"http://{parsed.hostname or '127.0.0.1'}:{parsed.port or 80}"
        self.timeout = timeout
        self.token = client_token()
        self.asked = False  # the broker answered a Unix-socket request with a token challenge
        resolver = UnixResolver(path=self.unix, timeout=timeout) if self.unix else None
        self.http = simple_httpclient.SimpleAsyncHTTPClient(force_instance=True, resolver=resolver, max_clients=64)

    async def fetch(self, method: str, path: str, body: bytes | None) -> httpclient.HTTPResponse:
        """Send one request (``path`` from ``/api/v1/``) and return the broker's answer, an error status too;
        raises ``UntrustedSocket``, ``OSError`` or ``HTTPClientError`` (599: timed out) when none came."""
        async def send(token: str | None) -> httpclient.HTTPResponse:
            headers = {"Accept": "application/json", **auth_headers(token)}
            if body is not None:
                headers["Content-Type"] = "application/json"
            request = httpclient.HTTPRequest(self.origin + path, method, headers, body, connect_timeout=self.timeout,
                                             request_timeout=self.timeout)
            return await self.http.fetch(request, raise_error=False)

        answer = await send(self.token if self.unix is None or self.asked else None)
        if (self.unix is not None and self.token and not self.asked
                and asks_for_token(answer.code, answer.headers.get("WWW-Authenticate"))):
            self.asked = True  # this broker names its callers by token on its socket too (identity 'hub')
            answer = await send(self.token)
        return answer

    def close(self) -> None:
        self.http.close()


async def connect_events(broker_url: str, timeout: float = 5.0) -> websocket.WebSocketClientConnection:
    """Open the broker's ``/api/v1/events`` websocket as this process's user."""
    parsed = urllib.parse.urlparse(broker_url)
    resolver: netutil.Resolver | None = None
    if parsed.scheme == "unix":
        resolver = UnixResolver(path=parsed.path or parsed.netloc, timeout=timeout)
        url = "ws://localhost/api/v1/events"
    else:
        url = f"ws://{parsed.hostname or '127.0.0.1'}:{parsed.port or 80}/api/v1/events"
    token = client_token()

    async def connect(headers: dict[str, str]) -> websocket.WebSocketClientConnection:
        request = httpclient.HTTPRequest(url, headers=headers, connect_timeout=timeout, request_timeout=timeout)
        return await websocket.websocket_connect(request, resolver=resolver, ping_interval=20)

    if resolver is None:
        return await connect(auth_headers(token))
    try:
        return await connect({})  # the socket's uid names this user
    except httpclient.HTTPClientError as e:
        challenge = e.response.headers.get("WWW-Authenticate") if e.response is not None else None
        if not token or not asks_for_token(e.code, challenge):
            raise
    return await connect(auth_headers(token))  # the broker names its callers by token on its socket too
