"""BrokerClient: the only way the notebook side talks to the broker (its REST API).

Synchronous and dependency-free (``http.client``, one kept-alive connection per thread), so it works in a kernel,
a worker, a CLI and a thread alike. The broker is found from ``GPULEASE_BROKER``
(``unix:///path/to.sock`` or ``http://host:port``), else the default socket; a Unix socket is used only if it and
the server behind it are the user's own or root's. ``GPULEASE_TOKEN`` or, under JupyterHub, ``JUPYTERHUB_API_TOKEN``
is presented over TCP, and over a Unix socket only when the broker asks for it (``gpulease_protocol.address``).
A lease comes back as a ``LeaseView``.
"""

from __future__ import annotations

import http.client
import json
import threading
import urllib.parse
from typing import Any

from gpulease_protocol.address import (
    UntrustedSocket,
    asks_for_token,
    auth_headers,
    broker_url,
    check_broker_url,
    client_token,
    connect_unix,
)

from .lease_view import LeaseView as LeaseView  # the name clients import from here


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


class BrokerUntrusted(BrokerError):
    """The client refused the broker's Unix socket before sending anything: another user owns it or its directory,
    can replace it, or serves it (``gpulease_protocol.address.UntrustedSocket``)."""

    def __init__(self, err: UntrustedSocket) -> None:
        super().__init__(503, "untrusted_socket", str(err))


class _UnixConnection(http.client.HTTPConnection):
    """``http.client`` over the broker's Unix socket, connected only through ``address.connect_unix`` (a socket and a
    server of the user's own or root's)."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        self.sock = connect_unix(self.unix_path, self.timeout)


class BrokerClient:
    """Thread-safe (one connection per thread) client of the broker's REST API.

    ``token``: presented on every request (``""``: none). None (the default): the environment's
    (``address.client_token()``), presented over TCP, and over a Unix socket only once the broker asked for it."""

    def __init__(self, url: str | None = None, token: str | None = None, timeout: float = 30.0) -> None:
        self.url = check_broker_url(url) if url else broker_url()  # ValueError: not a broker address
        self.token = token
        self._ambient = client_token() if token is None else None
        self._asked = False  # the broker answered a Unix-socket request with a token challenge
        self.timeout = timeout
        parsed = urllib.parse.urlparse(self.url)
        if parsed.scheme == "unix":
            self._unix: str | None = parsed.path or parsed.netloc
            self._host, self._port = "localhost", 0
        else:  # http://host:port (check_broker_url)
            self._unix = None
            self._host, self._port = parsed.hostname or "127.0.0.1", parsed.port or 80
        self._local = threading.local()

    # ---------------------------------------------------------------- transport
    def _conn(self, timeout: float) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = (_UnixConnection(self._unix, timeout) if self._unix is not None
                    else http.client.HTTPConnection(self._host, self._port, timeout))
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

    def _token(self) -> str | None:
        """The token to present now: an explicit one always; the environment's over TCP, and over a Unix socket
        once the broker asked for it (the connection was checked by ``address.connect_unix`` before anything)."""
        if self.token is not None:
            return self.token or None
        return self._ambient if self._unix is None or self._asked else None

    def _send(self, method: str, path: str, data: bytes | None, timeout: float) -> tuple[int, str | None, bytes]:
        """One request on this thread's kept-alive connection: (status, WWW-Authenticate, body). A kept-alive
        connection the server closed while idle is replaced once and the request sent again on the new one."""
        headers = {"Accept": "application/json", **auth_headers(self._token())}
        if data is not None:
            headers["Content-Type"] = "application/json"
        for attempt in (0, 1):
            conn = self._conn(timeout)
            reused = conn.sock is not None
            try:
                conn.request(method, path, data, headers)
                response = conn.getresponse()
                return response.status, response.getheader("WWW-Authenticate"), response.read()
            except UntrustedSocket as e:
                conn.close()
                raise BrokerUntrusted(e) from None
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as e:
                conn.close()
                if not (reused and attempt == 0):
                    raise BrokerUnreachable(self.url, e) from None
            except (OSError, http.client.HTTPException) as e:  # refused, timed out, not an HTTP answer, cut short
                conn.close()
                raise BrokerUnreachable(self.url, e) from None
            except BaseException:
                conn.close()  # interrupted mid-request: never reuse a connection with an answer pending
                raise
        raise AssertionError("not reached: the loop returns or raises")

    def request(self, method: str, path: str, body: Any = None, timeout: float | None = None) -> dict[str, Any]:
        data = json.dumps(body).encode() if body is not None else None
        to = timeout if timeout is not None else self.timeout
        status, challenge, answer = self._send(method, path, data, to)
        if (self._unix is not None and self.token is None and self._ambient and not self._asked
                and asks_for_token(status, challenge)):
            self._asked = True  # this broker names its callers by token on its socket too (identity 'hub')
            status, challenge, answer = self._send(method, path, data, to)
        payload: dict[str, Any]
        try:
            payload = json.loads(answer) if answer else {}
        except ValueError:
            payload = {"message": answer.decode(errors="replace")[:500]}
        if status >= 400:
            raise BrokerError(status, payload.get("reason", "error"), payload.get("message", f"HTTP {status}"), payload)
        return payload

    # ---------------------------------------------------------------- API
    def info(self) -> dict[str, Any]:
        return self.request("GET", "/api/v1/info")

    def gpus(self) -> dict[str, Any]:
        return self.request("GET", "/api/v1/gpus")

    def status(self) -> dict[str, Any]:
        """``info``, ``gpus``, ``queue`` and ``reservations`` in one dict (what ``gpulease status`` shows)."""
        return {"info": self.info(), "gpus": self.gpus()["gpus"], "queue": self.queue(),
                "reservations": self.reservations()}

    def queue(self) -> list[dict[str, Any]]:
        return list(self.request("GET", "/api/v1/queue")["queue"])

    def leases(self, everyone: bool = False, ended: int = 0) -> list[LeaseView]:
        q = f"?all={int(everyone)}&ended={ended}"
        return [LeaseView.from_json(x) for x in self.request("GET", "/api/v1/leases" + q)["leases"]]

    def request_lease(self, gpus: Any = 1, wait: float = 0.0, **fields: Any) -> LeaseView:
        """Ask for a lease. ``wait`` > 0 long-polls for the grant up to that many seconds."""
        body = {"gpus": gpus, **{k: v for k, v in fields.items() if v is not None}}
        if wait:
            body["wait_seconds"] = wait
        return LeaseView.from_json(self.request("POST", "/api/v1/leases", body, timeout=self.timeout + wait))

    def lease(self, lease_id: str, wait: float = 0.0) -> LeaseView:
        q = f"?wait={wait:g}" if wait else ""
        return LeaseView.from_json(self.request("GET", f"/api/v1/leases/{lease_id}{q}", timeout=self.timeout + wait))

    def release(self, lease_id: str, reason: str = "released") -> LeaseView:
        return self._action(lease_id, "release", {"reason": reason})

    def renew(self, lease_id: str, duration_seconds: float | None = None) -> LeaseView:
        return self._action(lease_id, "renew", {"duration_seconds": duration_seconds})

    def heartbeat(self, lease_id: str, active: bool = False) -> LeaseView:
        return self._action(lease_id, "heartbeat", {"active": active})

    def attach(self, lease_id: str, pid: int) -> LeaseView:
        return self._action(lease_id, "processes", {"pid": pid})

    def revoke(self, lease_id: str, reason: str) -> LeaseView:
        return self._action(lease_id, "revoke", {"reason": reason})

    def suspended(self, lease_id: str, ok: bool, how: str = "", host_bytes: int = 0, why: str = "") -> LeaseView:
        """Report the lease's processes suspended (``ok``: ``how`` "checkpoint" or "stop", ``host_bytes`` of GPU
        state now in host memory; the broker frees its GPUs), or that they could not be (``why``: the broker then
        does what it would have done without suspension, e.g. revokes it)."""
        body: dict[str, Any] = {"ok": True, "how": how, "host_bytes": int(host_bytes)} if ok else {"ok": False,
                                                                                                   "why": why}
        return self._action(lease_id, "suspended", body)

    def resume(self, lease_id: str, wait_seconds: float = 0.0) -> LeaseView:
        """Ask for a suspended lease's GPUs back; waits up to ``wait_seconds`` for the grant (the view: granted with
        its new ``devices``, or still suspended). A lease that is not suspended: ``BrokerError`` 409."""
        body = {"wait_seconds": wait_seconds} if wait_seconds else {}
        return LeaseView.from_json(self.request("POST", f"/api/v1/leases/{lease_id}/resume", body,
                                                timeout=self.timeout + wait_seconds))

    def _action(self, lease_id: str, action: str, body: dict[str, Any]) -> LeaseView:
        return LeaseView.from_json(self.request("POST", f"/api/v1/leases/{lease_id}/{action}", body))

    def notify(self, events: list[str] | None = None) -> dict[str, Any]:
        """The kinds of events the broker tells you about (and over which channels); ``events``: choose them."""
        if events is None:
            return self.request("GET", "/api/v1/notify")
        return self.request("PUT", "/api/v1/notify", {"events": events})

    def reservations(self) -> list[dict[str, Any]]:
        """Advance reservations that have not ended (booked and active)."""
        return list(self.request("GET", "/api/v1/reservations")["reservations"])

    def quota(self, user: str | None = None) -> dict[str, Any]:
        """What is left of each limit and budget that applies to the caller (an admin: to ``user``):
        ``{"user", "limits": [{"name", "text", "used", "limit", "unit", "refills_at"}]}``."""
        q = "?" + urllib.parse.urlencode({"user": user}) if user else ""
        return self.request("GET", "/api/v1/quota" + q)

    def history(self, lease_id: str) -> list[dict[str, Any]]:
        return list(self.request("GET", f"/api/v1/leases/{lease_id}/history")["transitions"])
