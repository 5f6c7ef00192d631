"""Thin handlers under ``{base_url}/gpulease/``: the broker's REST API as the server's user (one allow-listed,
asynchronous proxy), events, artifacts."""

from __future__ import annotations

import asyncio
import json
import os
import re
from typing import Any, Protocol
from urllib.parse import urlencode

from jupyter_core.utils import ensure_async
from jupyter_server.auth.decorator import authorized, ws_authenticated
from jupyter_server.base.handlers import APIHandler, JupyterHandler
from tornado import web, websocket

from gpulease_protocol.address import UntrustedSocket

from ..client import BrokerError, BrokerUnreachable, BrokerUntrusted
from .artifacts import recent_artifacts
from .relay import BrokerRelay, connect_events


class GpuLease(Protocol):
    """What the handlers use of the extension (``app.GpuLease``, in ``settings["gpulease_app"]``)."""

    broker_url: str
    artifact_root: str

    def relay(self) -> BrokerRelay: ...

    def status(self) -> dict[str, Any]: ...

AUTH_RESOURCE = "gpulease"
LEASE = r"leases/[A-Za-z0-9_-]{1,64}"
#: what the browser may ask of the broker through the proxy, by method: paths under /api/v1/ (the sidebar's calls);
#: anything else is a 404 here, whatever the broker would answer
ALLOWED = {method: re.compile("|".join(paths)) for method, paths in {
    "GET": ["info", "gpus", "queue", "leases", LEASE, LEASE + "/history"],
    "POST": ["leases", LEASE + "/(release|renew|revoke|heartbeat)"],
    "DELETE": [LEASE],
}.items()}
PASSED_QUERY = ("all", "ended")
PASSED_HEADERS = ("Content-Type", "Retry-After")


class GpuLeaseHandler(APIHandler):
    auth_resource = AUTH_RESOURCE

    @property
    def gl(self) -> GpuLease:
        app: GpuLease = self.settings["gpulease_app"]
        return app

    def reply(self, data: Any, status: int = 200) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.set_header("Cache-Control", "no-store")
        self.finish(json.dumps(data))

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(exc, web.HTTPError):
            message = exc.log_message % exc.args if exc.log_message and exc.args else exc.log_message
            body = {"status": status_code, "reason": exc.reason or "http_error", "message": message or self._reason}
        else:
            body = {"status": 500, "reason": "internal", "message": "Unhandled error"}
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(body))


class ProxyHandler(GpuLeaseHandler):
    """Forward an allow-listed request (``ALLOWED``) to the broker without blocking the server; the broker's
    answer, an error too, passes through as it is."""

    async def forward(self, path: str) -> None:
        method = self.request.method or "GET"
        allowed = ALLOWED.get(method)
        if allowed is None or not allowed.fullmatch(path):
            raise web.HTTPError(404, "Not a GPU lease API path: %s %s", method, path, reason="not_found")
        query = urlencode({k: v for k in PASSED_QUERY if (v := self.get_query_argument(k, None)) is not None})
        target = "/api/v1/" + path + ("?" + query if query else "")
        body = self.request.body if method == "POST" else None
        try:
            answer = await self.gl.relay().fetch(method, target, body)
        except Exception as e:  # no answer: unreachable, timed out, or a socket we do not trust
            error: BrokerError = (BrokerUntrusted(e) if isinstance(e, UntrustedSocket)
                                  else BrokerUnreachable(self.gl.broker_url, e))
            self.log.warning("GPU lease broker %s %s: %s", method, target, error.message)
            self.reply({"status": error.status, "reason": error.reason, "message": error.message}, error.status)
            return
        if answer.code >= 500:
            self.log.warning("GPU lease broker %s %s: %s", method, target, answer.code)
        self.set_status(answer.code, answer.reason)
        for name in PASSED_HEADERS:
            if name in answer.headers:
                self.set_header(name, answer.headers[name])
        self.set_header("Cache-Control", "no-store")
        self.finish(answer.body)

    @web.authenticated
    @authorized
    async def get(self, path: str) -> None:
        await self.forward(path)

    @web.authenticated
    @authorized
    async def post(self, path: str) -> None:
        await self.forward(path)

    @web.authenticated
    @authorized
    async def put(self, path: str) -> None:
        await self.forward(path)

    @web.authenticated
    @authorized
    async def patch(self, path: str) -> None:
        await self.forward(path)

    @web.authenticated
    @authorized
    async def delete(self, path: str) -> None:
        await self.forward(path)


class StatusHandler(GpuLeaseHandler):
    """Which broker this server uses, and whether it started it (embedded)."""

    @web.authenticated
    @authorized
    async def get(self) -> None:
        self.reply(self.gl.status())


class ArtifactsHandler(GpuLeaseHandler):
    @web.authenticated
    @authorized
    async def get(self) -> None:
        try:
            limit = int(self.get_query_argument("limit", "20"))
        except ValueError:
            raise web.HTTPError(400, f"Invalid limit={self.get_query_argument('limit')!r}: give a count",
                                reason="bad_request") from None
        root_dir = self.settings.get("server_root_dir") or os.getcwd()
        data = await asyncio.get_running_loop().run_in_executor(  # (the loop's threads: it lists directories)
            None, recent_artifacts, self.gl.artifact_root, root_dir, max(0, min(limit, 200)))
        self.reply(data)


class EventsHandler(JupyterHandler, websocket.WebSocketHandler):
    """Relay the broker's event websocket to the browser.

    If the broker cannot be reached (or goes away), the browser gets one ``{"type": "broker_unreachable"}``
    message and the socket closes; the sidebar reconnects with backoff.
    """

    auth_resource = AUTH_RESOURCE
    upstream: websocket.WebSocketClientConnection | None = None
    pump: asyncio.Task[None] | None = None

    @property
    def gl(self) -> GpuLease:
        app: GpuLease = self.settings["gpulease_app"]
        return app

    async def pre_get(self) -> None:
        user = self.current_user
        if user is None:
            raise web.HTTPError(403)
        ok = await ensure_async(self.authorizer.is_authorized(self, user, "read", AUTH_RESOURCE))
        if not ok:
            raise web.HTTPError(403)

    @ws_authenticated
    async def get(self, *args: Any, **kwargs: Any) -> None:
        await self.pre_get()
        res = super().get(*args, **kwargs)
        if res is not None:
            await res

    async def open(self, *args: Any, **kwargs: Any) -> None:
        try:
            self.upstream = await connect_events(self.gl.broker_url)
        except Exception as e:
            self.log.info("GPU lease events: broker at %s unreachable: %s", self.gl.broker_url, e)
            self._unreachable(f"No GPU lease broker answers at {self.gl.broker_url} ({e})")
            return
        self.pump = asyncio.ensure_future(self._pump())

    def _unreachable(self, message: str) -> None:
        try:
            self.write_message(json.dumps({"schema": "gpulease.event/1", "type": "broker_unreachable",
                                           "message": message}))
            self.close(1011, "broker unreachable")
        except websocket.WebSocketClosedError:
            pass

    async def _pump(self) -> None:
        assert self.upstream is not None
        while True:
            msg = await self.upstream.read_message()
            if msg is None:
                self._unreachable(f"The GPU lease broker at {self.gl.broker_url} closed the event stream")
                return
            try:
                await self.write_message(msg)
            except websocket.WebSocketClosedError:
                return

    def on_message(self, message: str | bytes) -> None:
        pass  # the relay is one-way

    def on_close(self) -> None:
        if self.pump is not None:
            self.pump.cancel()
        if self.upstream is not None:
            self.upstream.close()
            self.upstream = None


default_handlers: list[tuple[str, type[web.RequestHandler]]] = [
    (r"/gpulease/api/status", StatusHandler),
    (r"/gpulease/api/artifacts", ArtifactsHandler),
    (r"/gpulease/api/(.*)", ProxyHandler),
    (r"/gpulease/events", EventsHandler),
]
