"""What is left of the caller's limits and budgets (``GET /api/v1/quota``): GPUs at once and GPU-hours in the rolling
24 h, their own and their groups', with when each refills; admins may ask for another user (``?user=``)."""

from __future__ import annotations

from .base import BaseHandler, Routes


class QuotaHandler(BaseHandler):
    async def get(self) -> None:
        user = self.get_query_argument("user", "") or self.who.user
        if user != self.who.user:
            self.require_admin("see another user's quota")
        await self.reply(self.manager.quota(user))


def routes(prefix: str) -> Routes:
    return [(prefix + r"/quota", QuotaHandler)]
