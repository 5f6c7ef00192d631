"""What every handler shares: the caller's identity, JSON bodies and answers, errors as ``LeaseError`` JSON,
and the lease view for the caller. Handlers are thin: parse, authenticate, call the LeaseManager, answer."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable
from typing import Any

from tornado import web

from ..core.errors import BadRequest, Forbidden, LeaseError
from ..core.identity import Identity
from ..core.lease import Lease, parse_duration
from ..manager.manager import LeaseManager
from ..notify.notifier import Notifier
from .auth import Authenticator

#: The shapes of ids in routes.
LEASE_ID = r"([A-Za-z0-9_-]{1,64})"
RESERVATION_ID = r"(r-[A-Za-z0-9_-]{1,62})"
Routes = list[tuple[str, type[web.RequestHandler]]]

log = logging.getLogger("lease_broker")

MAX_WAIT = 300.0  # longest a request waits for a queued lease (seconds)


class BaseHandler(web.RequestHandler):
    manager: LeaseManager
    who: Identity

    def initialize(self, manager: LeaseManager, auth: Authenticator, info: dict[str, Any],
                   notifier: Notifier | None = None) -> None:
        self.manager = manager
        self.auth = auth
        self.info = info
        self.notifier = notifier

    def prepare(self) -> Awaitable[None] | None:
        stream = getattr(self.request.connection, "stream", None)
        sock = getattr(stream, "socket", None)
        who = self.auth.identify(sock, self.request.headers.get("Authorization"))
        if isinstance(who, Identity):
            self.who = who
            return None
        return self._identified(who)  # tornado awaits it: the Hub is asked off the request's fast path

    async def _identified(self, asking: Awaitable[Identity]) -> None:
        self.who = await asking

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

    async def reply(self, data: Any, status: int = 200) -> None:
        """Answer once everything this answer could show is stored (the iteration's group commit)."""
        await self.manager.settled()
        self.set_status(status)
        self.finish(json.dumps(data, separators=(",", ":")))

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(exc, LeaseError):
            body = exc.to_json()
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

    def view(self, lease: Lease) -> dict[str, Any]:
        """The lease as this caller may see it (the one view every answer uses)."""
        return self.manager.view(lease, self.who)

    def require_admin(self, what: str) -> None:
        if not self.who.admin:
            raise Forbidden(f"Only admins can {what}")


class NotFoundHandler(BaseHandler):
    def prepare(self) -> None:
        raise web.HTTPError(404, f"No such endpoint: {self.request.path}")
