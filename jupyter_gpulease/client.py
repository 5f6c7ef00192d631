"""BrokerClient: the only way the notebook side talks to the broker (its REST API).

Synchronous and dependency-free (http.client), so it works in a kernel, a worker,
a CLI and a thread alike. The broker is found from ``GPULEASE_BROKER``
(``unix:///path/to.sock`` or ``http://host:port``), else the default socket path.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import urllib.parse
from typing import Any

SYSTEM_SOCKET = "/run/gpulease/broker.sock"


def default_broker_url() -> str:
    """``GPULEASE_BROKER``, else the system socket if a system broker runs, else the per-user socket."""
    env = os.environ.get("GPULEASE_BROKER")
    if env:
        return env
    if os.path.exists(SYSTEM_SOCKET):
        return "unix://" + SYSTEM_SOCKET
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if os.geteuid() == 0:
        return "unix://" + SYSTEM_SOCKET
    if runtime:
        return "unix://" + os.path.join(runtime, "gpulease", "broker.sock")
    return f"unix:///tmp/gpulease-{os.getuid()}/broker.sock"


class BrokerError(Exception):
    """An error answer of the broker: ``status``, ``reason`` slug and a message for the user."""

    def __init__(self, status: int, reason: str, message: str, body: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message
        self.body = body or {}


class BrokerUnreachable(BrokerError):
    def __init__(self, url: str, err: BaseException) -> None:
        super().__init__(
            503,
            "unreachable",
            f"No GPU lease broker answers at {url} ({err}). Start one with "
            "'lease-broker --inventory=simulated --gpus=4' (demo) or ask your admin; "
            "point GPULEASE_BROKER at it if it listens elsewhere.",
        )


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.unix_path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


class BrokerClient:
    """Thread-safe (one connection per thread) client of the broker's REST API."""

    def __init__(self, url: str | None = None, token: str | None = None, timeout: float = 30.0) -> None:
        self.url = url or default_broker_url()
        self.token = token if token is not None else os.environ.get("GPULEASE_TOKEN")
        self.timeout = timeout
        parsed = urllib.parse.urlparse(self.url)
        if parsed.scheme == "unix":
            self._unix: str | None = parsed.path or parsed.netloc
            self._host, self._port = "localhost", 0
        elif parsed.scheme in ("http", ""):
            self._unix = None
            self._host, self._port = parsed.hostname or "127.0.0.1", parsed.port or 80
        else:
            raise ValueError(f"Unsupported broker URL {self.url!r}: use unix:///path/to.sock or http://host:port")
        self._local = threading.local()

    # ---------------------------------------------------------------- transport
    def _conn(self, timeout: float) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is None:
            if self._unix is not None:
                conn = _UnixConnection(self._unix, timeout)
            else:
                conn = http.client.HTTPConnection(self._host, self._port, timeout=timeout)
            self._local.conn = conn
        conn.timeout = timeout
        if conn.sock is not None:
            conn.sock.settimeout(timeout)
        return conn

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    def request(self, method: str, path: str, body: Any = None, timeout: float | None = None) -> dict[str, Any]:
        headers = {"Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        to = timeout if timeout is not None else self.timeout
        for attempt in (0, 1):
            conn = self._conn(to)
            try:
                conn.request(method, path, body=data, headers=headers)
                resp = conn.getresponse()
                raw = resp.read()
                break
            except (ConnectionError, http.client.HTTPException, OSError) as e:
                self.close()
                # one retry on a kept-alive connection the server closed meanwhile
                if attempt == 0 and isinstance(e, (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)):
                    continue
                raise BrokerUnreachable(self.url, e) from None
            except BaseException:
                self.close()  # interrupted mid-request: never reuse a connection with a pending response
                raise
        payload: dict[str, Any]
        try:
            payload = json.loads(raw) if raw else {}
        except ValueError:
            payload = {"message": raw.decode(errors="replace")[:500]}
        if resp.status >= 400:
            raise BrokerError(
                resp.status, payload.get("reason", "error"), payload.get("message", f"HTTP {resp.status}"), payload
            )
        return payload

    # ---------------------------------------------------------------- API
    def info(self) -> dict[str, Any]:
        return self.request("GET", "/api/v1/info")

    def gpus(self) -> dict[str, Any]:
        return self.request("GET", "/api/v1/gpus")

    def queue(self) -> list[dict[str, Any]]:
        return list(self.request("GET", "/api/v1/queue")["queue"])

    def leases(self, everyone: bool = False, ended: int = 0) -> list[dict[str, Any]]:
        q = f"?all={int(everyone)}&ended={ended}"
        return list(self.request("GET", "/api/v1/leases" + q)["leases"])

    def request_lease(self, gpus: Any = 1, wait: float = 0.0, **fields: Any) -> dict[str, Any]:
        """Ask for a lease. ``wait`` > 0 long-polls for the grant up to that many seconds."""
        body = {"gpus": gpus, **{k: v for k, v in fields.items() if v is not None}}
        if wait:
            body["wait_seconds"] = wait
        return self.request("POST", "/api/v1/leases", body, timeout=self.timeout + wait)

    def lease(self, lease_id: str, wait: float = 0.0) -> dict[str, Any]:
        q = f"?wait={wait:g}" if wait else ""
        return self.request("GET", f"/api/v1/leases/{lease_id}{q}", timeout=self.timeout + wait)

    def release(self, lease_id: str, reason: str = "released") -> dict[str, Any]:
        return self.request("POST", f"/api/v1/leases/{lease_id}/release", {"reason": reason})

    def renew(self, lease_id: str, duration_seconds: float | None = None) -> dict[str, Any]:
        return self.request("POST", f"/api/v1/leases/{lease_id}/renew", {"duration_seconds": duration_seconds})

    def heartbeat(self, lease_id: str, active: bool = False) -> dict[str, Any]:
        return self.request("POST", f"/api/v1/leases/{lease_id}/heartbeat", {"active": active})

    def attach(self, lease_id: str, pid: int) -> dict[str, Any]:
        return self.request("POST", f"/api/v1/leases/{lease_id}/processes", {"pid": pid})

    def revoke(self, lease_id: str, reason: str) -> dict[str, Any]:
        return self.request("POST", f"/api/v1/leases/{lease_id}/revoke", {"reason": reason})

    def reservations(self) -> list[dict[str, Any]]:
        """Advance reservations that have not ended (booked and active)."""
        return list(self.request("GET", "/api/v1/reservations")["reservations"])

    def history(self, lease_id: str) -> list[dict[str, Any]]:
        return list(self.request("GET", f"/api/v1/leases/{lease_id}/history")["transitions"])
