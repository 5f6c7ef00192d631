"""The usage report: GPU-hours held and busy per user (all users for admins)."""

from __future__ import annotations

from ..core.lease import parse_duration
from .base import BaseHandler, Routes


class UsageHandler(BaseHandler):
    async def get(self) -> None:
        since = parse_duration(self.get_query_argument("since", "7d"), "since")
        now = self.manager.clock.now()
        await self.reply({"since": now - since, "users": self.manager.usage.report(self.who, now - since, now)})


def routes(prefix: str) -> Routes:
    return [(prefix + r"/usage", UsageHandler)]
