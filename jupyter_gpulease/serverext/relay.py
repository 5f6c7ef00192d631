"""Connect to the broker's event websocket (over a Unix socket or TCP) from the Jupyter server's event loop."""

from __future__ import annotations

import socket
import urllib.parse
from typing import Any

from tornado import httpclient, netutil, websocket

from gpulease_protocol.address import auth_headers, client_token


class UnixResolver(netutil.Resolver):
    """Resolve every host to one Unix socket path, so tornado's clients can talk to a Unix-socket broker."""

    def initialize(self, path: str) -> None:  # type: ignore[override]
        self.path = path

    async def resolve(self, host: str, port: int, family: socket.AddressFamily = socket.AF_UNSPEC) -> list[Any]:
        return [(socket.AF_UNIX, self.path)]


async def connect_events(broker_url: str, timeout: float = 5.0) -> websocket.WebSocketClientConnection:
    """Open the broker's ``/api/v1/events`` websocket as this process's user."""
    parsed = urllib.parse.urlparse(broker_url)
    resolver: netutil.Resolver | None = None
    if parsed.scheme == "unix":
        resolver = UnixResolver(path=parsed.path or parsed.netloc)
        url = "ws://localhost/api/v1/events"
    else:
        url = f"ws://{parsed.hostname or '127.0.0.1'}:{parsed.port or 80}/api/v1/events"
    headers = auth_headers(client_token())
    request = httpclient.HTTPRequest(url, headers=headers, connect_timeout=timeout, request_timeout=timeout)
    return await websocket.websocket_connect(request, resolver=resolver, ping_interval=20)
