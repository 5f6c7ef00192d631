"""Thin handlers: parse, authenticate, call the LeaseManager, answer JSON."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from tornado import web, websocket

from ..core.errors import BadRequest, LeaseError
from ..core.identity import Identity
from ..core.lease import LeaseState, parse_duration
from ..manager.manager import LeaseManager
from .auth import Authenticator

log = logging.getLogger("lease_broker")

MAX_WAIT = 300.0


class BaseHandler(web.RequestHandler):
    manager: LeaseManager
    who: Identity

    def initialize(self, manager: LeaseManager, auth: Authenticator, info: dict[str, Any]) -> None:
        self.manager = manager
        self.auth = auth
        self.info = info

    def prepare(self) -> None:
        stream = getattr(self.request.connection, "stream", None)
        sock = getattr(stream, "socket", None)
        self.who = self.auth.identify(sock, self.request.headers.get("Authorization"))

    def set_default_headers(self) -> None:
        self.set_header("Content-Type", "application/json")
        self.set_header("Cache-Control", "no-store")

    def body(self) -> dict[str, Any]:
        if not self.request.body:
            return {}
        try:
            data = json.loads(self.request.body)
        except (ValueError, UnicodeDecodeError) as e:
            raise BadRequest(f"Malformed JSON body: {e}") from None
        except RecursionError:
            raise BadRequest("Malformed JSON body: nested too deeply") from None
        if not isinstance(data, dict):
            raise BadRequest(f"Request body must be a JSON object, not {type(data).__name__}")
        return data

    def reply(self, data: Any, status: int = 200) -> None:
        self.set_status(status)
        self.finish(json.dumps(data, separators=(",", ":")))

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(exc, LeaseError):
            body = exc.to_json()
            if exc.retry_after is not None:
                self.set_header("Retry-After", str(int(max(1, exc.retry_after))))
        elif isinstance(exc, web.HTTPError):
            body = {"status": status_code, "reason": "http_error", "message": exc.log_message or self._reason}
        else:
            body = {"status": 500, "reason": "internal", "message": "Unhandled error"}
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(body))

    def log_exception(self, typ: Any, value: Any, tb: Any) -> None:
        if isinstance(value, LeaseError):
            if value.status_code >= 500:
                log.error("%s %s: %s", self.request.method, self.request.path, value.message)
            return
        if isinstance(value, web.HTTPError):
            return
        log.error("Unhandled error in %s %s", self.request.method, self.request.path, exc_info=(typ, value, tb))

    def _handle_request_exception(self, e: BaseException) -> None:
        if isinstance(e, LeaseError):
            self.log_exception(type(e), e, e.__traceback__)
            if not self._finished:
                self.send_error(e.status_code, exc_info=(type(e), e, e.__traceback__))
            return
        super()._handle_request_exception(e)

    def query_float(self, name: str, default: float) -> float:
        raw = self.get_query_argument(name, None)
        if raw is None:
            return default
        return parse_duration(raw, name)


class InfoHandler(BaseHandler):
    def get(self) -> None:
        m = self.manager
        self.reply(
            {
                **self.info,
                "inventory": m.inventory.describe(),
                "simulated": m.inventory.simulated,
                "user": {"name": self.who.user, "uid": self.who.uid, "admin": self.who.admin},
                "time": m.clock.now(),
                "summary": m.summary(),
                "policy": {
                    "default_duration_seconds": m.policy.default_duration_seconds,
                    "max_duration_seconds": m.policy.max_duration_seconds,
                    "default_idle_timeout_seconds": m.policy.default_idle_timeout_seconds,
                    "heartbeat_timeout": m.policy.heartbeat_timeout,
                    "priority_classes": dict(m.policy.priority_classes),
                    "max_gpus_per_user": m.policy.user_cap(self.who.user),
                },
            }
        )


class GpusHandler(BaseHandler):
    def get(self) -> None:
        m = self.manager
        self.reply({"simulated": m.inventory.simulated, "summary": m.summary(), "gpus": m.gpu_views(self.who)})


class LeasesHandler(BaseHandler):
    def get(self) -> None:
        everyone = self.get_query_argument("all", "0") in ("1", "true", "yes")
        try:
            ended = int(self.get_query_argument("ended", "0"))
        except ValueError:
            raise BadRequest(f"Invalid ended={self.get_query_argument('ended')!r}: give a count") from None
        leases = self.manager.list_leases(self.who, everyone=everyone, include_ended=max(0, min(ended, 1000)))
        self.reply({"leases": [self.manager.view(lease, self.who) for lease in leases]})

    async def post(self) -> None:
        body = self.body()
        wait = parse_duration(body.pop("wait_seconds", 0), "wait_seconds")
        lease, secret = self.manager.request(self.who, body)
        if lease.state == LeaseState.QUEUED:
            await asyncio.sleep(0)  # the pass it queued runs first (one pass for all requests of the iteration)
        if wait and lease.state == LeaseState.QUEUED:
            lease = await self.manager.wait(lease, min(wait, MAX_WAIT))
        view = self.manager.view(lease)
        view["secret"] = secret
        self.reply(view, 202 if lease.state == LeaseState.QUEUED else 201)


class LeaseHandler(BaseHandler):
    async def get(self, lease_id: str) -> None:
        lease = self.manager.lookup(lease_id, self.who)
        wait = self.query_float("wait", 0.0)
        if wait and lease.state == LeaseState.QUEUED:
            lease = await self.manager.wait(lease, min(wait, MAX_WAIT))
        self.reply(self.manager.view(lease, self.who))

    def delete(self, lease_id: str) -> None:
        reason = self.get_query_argument("reason", "released")
        lease = self.manager.release(lease_id, self.who, reason)
        self.reply(self.manager.view(lease))


class LeaseActionHandler(BaseHandler):
    def post(self, lease_id: str, action: str) -> None:
        m = self.manager
        body = self.body()
        if action == "release":
            lease = m.release(lease_id, self.who, str(body.get("reason", "released")))
        elif action == "renew":
            lease = m.renew(lease_id, self.who, body.get("duration_seconds"))
        elif action == "heartbeat":
            active = body.get("active", False)
            if not isinstance(active, bool):
                raise BadRequest(f"Invalid active {active!r}: must be true or false")
            lease = m.heartbeat(lease_id, self.who, active)
        elif action == "processes":
            lease = m.attach(lease_id, self.who, body.get("pid"))
        elif action == "revoke":
            lease = m.revoke(lease_id, self.who, str(body.get("reason", "admin")))
        else:  # pragma: no cover - the route only matches known actions
            raise web.HTTPError(404)
        self.reply(m.view(lease))


class HistoryHandler(BaseHandler):
    def get(self, lease_id: str) -> None:
        self.manager.lookup(lease_id, self.who)
        self.reply({"lease_id": lease_id, "transitions": self.manager.store.history(lease_id)})


class QueueHandler(BaseHandler):
    def get(self) -> None:
        self.reply({"queue": self.manager.queue_views(self.who)})


def visible_to(event: dict[str, Any], who: Identity) -> bool:
    owner = event.get("user")
    return owner is None or who.admin or owner == who.user


class EventsHandler(websocket.WebSocketHandler, BaseHandler):
    """A websocket of events: lease changes (yours; all for admins), GPU changes, warnings."""

    queue: asyncio.Queue[dict[str, Any]] | None = None
    task: asyncio.Task[None] | None = None

    def set_default_headers(self) -> None:
        pass

    def check_origin(self, origin: str) -> bool:
        return True  # no cookies are used: identity is the socket peer or a bearer token

    def open(self) -> None:
        self.queue = self.manager.events.subscribe()
        self.write_message(json.dumps({"schema": "gpulease.event/1", "type": "hello", "summary": self.manager.summary()}))
        self.task = asyncio.ensure_future(self._pump())

    async def _pump(self) -> None:
        assert self.queue is not None
        while True:
            event = await self.queue.get()
            if visible_to(event, self.who):
                try:
                    await self.write_message(json.dumps(event, separators=(",", ":")))
                except websocket.WebSocketClosedError:
                    return

    def on_message(self, message: str | bytes) -> None:
        pass

    def on_close(self) -> None:
        if self.queue is not None:
            self.manager.events.unsubscribe(self.queue)
        if self.task is not None:
            self.task.cancel()


class EventStreamHandler(BaseHandler):
    """The same events as Server-Sent Events (for clients without websockets)."""

    async def get(self) -> None:
        self.set_header("Content-Type", "text/event-stream")
        q = self.manager.events.subscribe()
        try:
            self.write("retry: 2000\n\n")
            await self.flush()
            while True:
                try:
                    event = await asyncio.wait_for(q.get(), 15.0)
                except asyncio.TimeoutError:
                    self.write(": keepalive\n\n")
                    await self.flush()
                    continue
                if visible_to(event, self.who):
                    self.write(f"id: {event['seq']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n")
                    await self.flush()
        except Exception:  # the client went away
            pass
        finally:
            self.manager.events.unsubscribe(q)


class OpenAPIHandler(BaseHandler):
    def prepare(self) -> None:  # the API description is public
        pass

    def get(self) -> None:
        from .openapi import load

        self.reply(load())


class NotFoundHandler(BaseHandler):
    def prepare(self) -> None:
        raise web.HTTPError(404, f"No such endpoint: {self.request.path}")


def default_handlers(prefix: str = "/api/v1") -> list[tuple[str, type[web.RequestHandler]]]:
    from .admin import admin_handlers

    return [
        (prefix + r"/info", InfoHandler),
        (prefix + r"/gpus", GpusHandler),
        (prefix + r"/leases", LeasesHandler),
        (prefix + r"/leases/([A-Za-z0-9_-]{1,64})", LeaseHandler),
        (prefix + r"/leases/([A-Za-z0-9_-]{1,64})/(release|renew|heartbeat|processes|revoke)", LeaseActionHandler),
        (prefix + r"/leases/([A-Za-z0-9_-]{1,64})/history", HistoryHandler),
        (prefix + r"/queue", QueueHandler),
        (prefix + r"/events", EventsHandler),
        (prefix + r"/events/stream", EventStreamHandler),
        (prefix + r"/openapi.json", OpenAPIHandler),
        *admin_handlers(prefix),
    ]
