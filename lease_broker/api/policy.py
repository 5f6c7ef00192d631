"""The policy: read it, change it without dropping leases (admins), and its audit trail."""

from __future__ import annotations

from typing import Any

from gpulease_protocol.requests import quoted

from ..core.errors import BadRequest
from ..manager.policy_admin import policy_values
from .base import BaseHandler, Routes


def _jsonable(values: dict[str, Any]) -> dict[str, Any]:
    return {k: (dict(v) if isinstance(v, dict) else list(v) if isinstance(v, (list, tuple, set)) else v)
            for k, v in values.items()}


class PolicyHandler(BaseHandler):
    async def get(self) -> None:
        await self.reply({"policy": _jsonable(policy_values(self.manager.policy))})

    async def put(self) -> None:
        self.require_admin("change the policy")
        body = self.body()
        changes = body.get("policy", body) if set(body) <= {"policy"} else body
        if not isinstance(changes, dict) or not changes:
            raise BadRequest("Give the policy fields to change as a JSON object, e.g. {\"max_gpus_per_user\": 4}")
        diff = self.manager.update_policy(self.who, changes)
        await self.reply({"changed": _jsonable(diff), "policy": _jsonable(policy_values(self.manager.policy))})


class PolicyAuditHandler(BaseHandler):
    async def get(self) -> None:
        self.require_admin("read the policy audit")
        raw = self.get_query_argument("limit", "100")
        digits = raw.lstrip("0") if raw.isascii() and raw.isdigit() else ""  # "²" is a digit that int() refuses
        if not digits:
            raise BadRequest(f"Invalid limit={quoted(raw)}: give a whole number >= 1")
        limit = int(digits) if len(digits) <= 5 else 10_000  # int() refuses 4,300 digits and more
        await self.reply({"audit": self.manager.policy_audit(min(limit, 10_000))})


def routes(prefix: str) -> Routes:
    return [
        (prefix + r"/policy", PolicyHandler),
        (prefix + r"/policy/audit", PolicyAuditHandler),
    ]
