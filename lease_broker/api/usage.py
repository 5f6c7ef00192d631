"""The usage report: GPU-hours held and busy, and what the leases used, per user, group, label value or notebook
(every user's for admins, their own for users)."""

from __future__ import annotations

from ..core.lease import parse_duration
from .base import BaseHandler, Routes


class UsageHandler(BaseHandler):
    async def get(self) -> None:
        since = parse_duration(self.get_query_argument("since", "7d"), "since")
        by, label = self.get_query_argument("by", "user"), self.get_query_argument("label", "")
        now = self.manager.clock.now()
        rows = self.manager.usage_report(self.who, since, by, label)
        users = rows if by == "user" else self.manager.usage_report(self.who, since)
        await self.reply({"since": now - since, "by": by, "label": label or None, "rows": rows,
                          "users": [{k: v for k, v in u.items() if k != "key"} for u in users]})


def routes(prefix: str) -> Routes:
    return [(prefix + r"/usage", UsageHandler)]
