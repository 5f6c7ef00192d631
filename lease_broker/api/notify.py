"""Notifications: what the caller is told about, and where it goes (``gpulease notify``, ``%gpu notify``)."""

from __future__ import annotations

from ..core.errors import BadRequest, Unavailable
from ..notify.messages import KINDS
from ..notify.notifier import Notifier
from .base import BaseHandler, Routes


class NotifyHandler(BaseHandler):
    def _notifier(self) -> Notifier:
        if self.notifier is None:  # pragma: no cover - the broker always makes one
            raise Unavailable("Notifications are not set up on this broker")
        return self.notifier

    async def get(self) -> None:
        await self.reply(self._answer(self._notifier().events_of(self.who.user)))

    async def put(self) -> None:
        events = self.body().get("events")
        if not isinstance(events, list) or not all(isinstance(e, str) for e in events):
            raise BadRequest(f"Invalid events {events!r}: give a list of kinds, any of {', '.join(KINDS)}")
        try:
            chosen = self._notifier().choose(self.who.user, events)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        await self.reply(self._answer(chosen))

    def _answer(self, events: list[str]) -> dict[str, object]:
        n = self._notifier()
        channels = sorted({channel for channel, _ in n.channels_of(self.who.user)})  # never the URLs: secrets
        return {"events": events, "kinds": list(KINDS), "channels": channels}


def routes(prefix: str) -> Routes:
    return [(prefix + r"/notify", NotifyHandler)]
