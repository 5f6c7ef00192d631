"""What every handler shares: the caller's identity, JSON bodies and answers, errors as ``LeaseError`` JSON,
and the lease view for the caller. Handlers are thin: parse, authenticate, call the LeaseManager, answer."""

from __future__ import annotations

import json
import logging
import math
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
#: Integers a body may hold: what SQLite's INTEGER stores (64-bit), far beyond any count or epoch time.
INT_RANGE = range(-(2**63), 2**63)


def json_text(data: Any) -> str:
    """The one encoding of every answer and event: strict JSON (RFC 8259), which every parser reads. A number that
    is not finite (NaN, Infinity: Python's json writes them, strict parsers refuse them) is a bug where it was
    computed: logged, and sent as null rather than as a document no client can read."""
    try:
        return json.dumps(data, separators=(",", ":"), allow_nan=False)
    except ValueError:
        log.error("An answer or event held a number that is not finite; sent as null: %.200r", data)
        return json.dumps(_finite(data), separators=(",", ":"), allow_nan=False)


def _finite(data: Any) -> Any:
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {k: _finite(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_finite(v) for v in data]
    return data


def _printable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def check_body(data: Any) -> None:
    """Refuse, naming the field, what Python's json reads but nothing after it can hold: NaN and infinities
    (``NaN``, ``1e999``), integers beyond 64 bits (``float()`` and SQLite fail on them) and lone surrogates
    (``"\\ud800"``: not Unicode, so no UTF-8 text, SQLite's included, holds them), in values and keys alike."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                field = f"{where}.{key}" if where else str(key)
                if not key.isascii():
                    _check_text(key, field)
                stack.append((field, item))
        elif isinstance(value, list):
            stack.extend((f"{where}[{i}]", item) for i, item in enumerate(value))
        elif isinstance(value, str):
            if not value.isascii():
                _check_text(value, where)
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise BadRequest(f"Invalid {_printable(where)} {value!r}: not a JSON number; give a finite number",
                                 extra={"field": _printable(where)})
        elif isinstance(value, int) and value not in INT_RANGE:
            raise BadRequest(f"Invalid {_printable(where)}: a number of {len(str(abs(value)))} digits; give one "
                             "below 2^63", extra={"field": _printable(where)})


def _check_text(text: str, field: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(f"Invalid {_printable(field)} '{_printable(text)[:80]}': it holds a lone surrogate (not "
                         "Unicode text); send UTF-8 text", extra={"field": _printable(field)}) from None


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
        check_body(data)
        return data

    async def reply(self, data: Any, status: int = 200) -> None:
        """Answer once everything this answer could show is stored (the iteration's group commit)."""
        await self.manager.settled()
        self.set_status(status)
        self.finish(json_text(data))

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(exc, LeaseError):
            body = exc.to_json()
            if isinstance(exc.extra.get("retry_after"), int):  # 429: when to try again
                self.set_header("Retry-After", str(exc.extra["retry_after"]))
        elif isinstance(exc, web.HTTPError):
            body = {"status": status_code, "reason": "http_error", "message": exc.log_message or self._reason}
        else:
            body = {"status": 500, "reason": "internal", "message": "Unhandled error"}
        if status_code == 401:  # the challenge a client waits for before it sends its token over the Unix socket
            self.set_header("WWW-Authenticate", 'Bearer realm="gpulease"')
        self.set_header("Content-Type", "application/json")
        self.finish(json_text(body))

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
