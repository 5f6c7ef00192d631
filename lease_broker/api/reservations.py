"""Advance reservations: list, book, look up, cancel."""

from __future__ import annotations

from .base import RESERVATION_ID, BaseHandler, Routes


class ReservationsHandler(BaseHandler):
    async def get(self) -> None:
        await self.reply({"reservations": self.manager.reservation_views(
            self.query_float("ended", 0.0), include_cancelled=self.get_query_argument("all", "0") == "1")})

    async def post(self) -> None:
        await self.reply(self.manager.reserve(self.who, self.body()), 201)


class ReservationHandler(BaseHandler):
    async def get(self, rid: str) -> None:
        await self.reply(self.manager.reservation_view(rid))

    async def delete(self, rid: str) -> None:
        await self.reply(self.manager.cancel_reservation(self.who, rid))


def routes(prefix: str) -> Routes:
    return [
        (prefix + r"/reservations", ReservationsHandler),
        (prefix + r"/reservations/" + RESERVATION_ID, ReservationHandler),
    ]
