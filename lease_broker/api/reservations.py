"""Advance reservations: list, book, look up, cancel."""

from __future__ import annotations

from .base import RESERVATION_ID, BaseHandler, Routes


class ReservationsHandler(BaseHandler):
    async def get(self) -> None:
        m = self.manager
        now = m.clock.now()
        rs = m.admin_store.reservations(since=now - self.query_float("ended", 0.0),
                                        include_cancelled=self.get_query_argument("all", "0") == "1")
        await self.reply({"reservations": [m.reservations.view(r, now) for r in rs]})

    async def post(self) -> None:
        m = self.manager
        now = m.clock.now()
        r = m.reservations.create(self.who, self.body(), now)
        m.replan()
        m.reservations.publish(r, "created", now)
        await self.reply(m.reservations.view(r, now), 201)


class ReservationHandler(BaseHandler):
    async def get(self, rid: str) -> None:
        m = self.manager
        await self.reply(m.reservations.view(m.reservations.get(rid), m.clock.now()))

    async def delete(self, rid: str) -> None:
        m = self.manager
        now = m.clock.now()
        r = m.reservations.cancel(self.who, rid, now)
        m.replan()
        m.reservations.publish(r, "cancelled", now)
        await self.reply(m.reservations.view(r, now))


def routes(prefix: str) -> Routes:
    return [
        (prefix + r"/reservations", ReservationsHandler),
        (prefix + r"/reservations/" + RESERVATION_ID, ReservationHandler),
    ]
