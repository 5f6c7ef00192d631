"""Admin endpoints: policy (read, hot update, audit), reservations, usage report. Thin: the manager decides."""

from __future__ import annotations

from typing import Any

from tornado import web

from ..core.errors import BadRequest, NotFound
from ..core.lease import parse_duration
from ..manager import reservations
from ..manager.policy_admin import policy_values
from .handlers import BaseHandler

RESERVATION_ID = r"(r-[A-Za-z0-9_-]{1,62})"


def _jsonable(values: dict[str, Any]) -> dict[str, Any]:
    return {k: (dict(v) if isinstance(v, dict) else list(v) if isinstance(v, (list, tuple, set)) else v)
            for k, v in values.items()}


class PolicyHandler(BaseHandler):
    def get(self) -> None:
        self.reply({"policy": _jsonable(policy_values(self.manager.policy))})

    def put(self) -> None:
        self.manager.require_admin(self.who, "change the policy")
        body = self.body()
        changes = body.get("policy", body) if set(body) <= {"policy"} else body
        if not isinstance(changes, dict) or not changes:
            raise BadRequest("Give the policy fields to change as a JSON object, e.g. {\"max_gpus_per_user\": 4}")
        diff = self.manager.update_policy(self.who.user, changes, source="api")
        self.reply({"changed": _jsonable(diff), "policy": _jsonable(policy_values(self.manager.policy))})


class PolicyAuditHandler(BaseHandler):
    def get(self) -> None:
        self.manager.require_admin(self.who, "read the policy audit")
        raw = self.get_query_argument("limit", "100")
        if not raw.isdigit() or int(raw) < 1:
            raise BadRequest(f"Invalid limit={raw!r}: give a whole number >= 1")
        self.reply({"audit": self.manager.admin_store.audit_log(min(int(raw), 10_000))})


class ReservationsHandler(BaseHandler):
    def get(self) -> None:
        m = self.manager
        now = m.clock.now()
        rs = m.admin_store.reservations(since=now - self.query_float("ended", 0.0),
                                        include_cancelled=self.get_query_argument("all", "0") == "1")
        self.reply({"reservations": [reservations.view(m, r, now) for r in rs]})

    def post(self) -> None:
        m = self.manager
        r = reservations.create(m, self.who, self.body())
        m.schedule()
        m.publish_reservation(r, "created")
        self.reply(reservations.view(m, r, m.clock.now()), 201)


class ReservationHandler(BaseHandler):
    def get(self, rid: str) -> None:
        m = self.manager
        r = m.admin_store.reservation(rid)
        if r is None:
            raise NotFound(f"No reservation {rid!r}")
        self.reply(reservations.view(m, r, m.clock.now()))

    def delete(self, rid: str) -> None:
        m = self.manager
        r = reservations.cancel(m, self.who, rid)
        m.schedule()
        m.publish_reservation(r, "cancelled")
        self.reply(reservations.view(m, r, m.clock.now()))


class UsageHandler(BaseHandler):
    def get(self) -> None:
        since = parse_duration(self.get_query_argument("since", "7d"), "since")
        now = self.manager.clock.now()
        self.reply({"since": now - since, "users": self.manager.usage_report(self.who, now - since)})


def admin_handlers(prefix: str = "/api/v1") -> list[tuple[str, type[web.RequestHandler]]]:
    return [
        (prefix + r"/policy", PolicyHandler),
        (prefix + r"/policy/audit", PolicyAuditHandler),
        (prefix + r"/reservations", ReservationsHandler),
        (prefix + r"/reservations/" + RESERVATION_ID, ReservationHandler),
        (prefix + r"/usage", UsageHandler),
    ]
