"""Thin handlers under ``{base_url}/gpulease/``: the broker's REST API as the server's user, events, artifacts."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from typing import Any, Protocol, TypeVar
from urllib.parse import urlencode

from jupyter_core.utils import ensure_async
from jupyter_server.auth.decorator import authorized, ws_authenticated
from jupyter_server.base.handlers import APIHandler, JupyterHandler
from tornado import web, websocket

from ..client import BrokerError
from .artifacts import recent_artifacts
from .relay import connect_events

T = TypeVar("T")


class GpuLease(Protocol):
    """What the handlers use of the extension (``app.GpuLease``, in ``settings["gpulease_app"]``)."""

    broker_url: str
    artifact_root: str

    async def broker_call(self, method: str, path: str, body: Any = None) -> dict[str, Any]: ...

    async def in_thread(self, work: Callable[[], T]) -> T: ...  # blocking work (broker calls, listing artifacts)

    def status(self) -> dict[str, Any]: ...

AUTH_RESOURCE = "gpulease"
LEASE_ID = r"([A-Za-z0-9_-]{1,64})"
PASSED_QUERY = ("all", "ended")


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

    async def proxy(self, method: str, path: str, body: Any = None) -> None:
        query = urlencode({k: v for k in PASSED_QUERY if (v := self.get_query_argument(k, None)) is not None})
        path = "/api/v1/" + path + ("?" + query if query else "")
        try:
            data = await self.gl.broker_call(method, path, body)
        except BrokerError as e:
            if e.status >= 500:
                self.log.warning("GPU lease broker %s %s: %s", method, path, e.message)
            self.reply({"status": e.status, "reason": e.reason, "message": e.message}, e.status)
            return
        self.reply(data)

    def json_body(self) -> dict[str, Any]:
        if not self.request.body:
            return {}
        try:
            data = json.loads(self.request.body)
        except ValueError as e:
            raise web.HTTPError(400, f"Malformed JSON body: {e}", reason="bad_request") from None
        if not isinstance(data, dict):
            raise web.HTTPError(400, "Request body must be a JSON object", reason="bad_request")
        return data


class ResourceHandler(GpuLeaseHandler):
    """GET info, gpus, queue."""

    @web.authenticated
    @authorized
    async def get(self, resource: str) -> None:
        await self.proxy("GET", resource)


class LeasesHandler(GpuLeaseHandler):
    @web.authenticated
    @authorized
    async def get(self) -> None:
        await self.proxy("GET", "leases")

    @web.authenticated
    @authorized
    async def post(self) -> None:
        await self.proxy("POST", "leases", self.json_body())


class LeaseHandler(GpuLeaseHandler):
    @web.authenticated
    @authorized
    async def get(self, lease_id: str) -> None:
        await self.proxy("GET", f"leases/{lease_id}")

    @web.authenticated
    @authorized
    async def delete(self, lease_id: str) -> None:
        await self.proxy("DELETE", f"leases/{lease_id}")


class LeaseActionHandler(GpuLeaseHandler):
    @web.authenticated
    @authorized
    async def post(self, lease_id: str, action: str) -> None:
        await self.proxy("POST", f"leases/{lease_id}/{action}", self.json_body())


class HistoryHandler(GpuLeaseHandler):
    @web.authenticated
    @authorized
    async def get(self, lease_id: str) -> None:
        await self.proxy("GET", f"leases/{lease_id}/history")


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
        data = await self.gl.in_thread(
            lambda: recent_artifacts(self.gl.artifact_root, root_dir, max(0, min(limit, 200))))
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
    (r"/gpulease/api/(info|gpus|queue)", ResourceHandler),
    (r"/gpulease/api/leases", LeasesHandler),
    (rf"/gpulease/api/leases/{LEASE_ID}", LeaseHandler),
    (rf"/gpulease/api/leases/{LEASE_ID}/(release|renew|revoke|heartbeat)", LeaseActionHandler),
    (rf"/gpulease/api/leases/{LEASE_ID}/history", HistoryHandler),
    (r"/gpulease/api/status", StatusHandler),
    (r"/gpulease/api/artifacts", ArtifactsHandler),
    (r"/gpulease/events", EventsHandler),
]
