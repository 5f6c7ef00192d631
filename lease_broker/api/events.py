"""The event stream: lease changes (the caller's; all for admins), GPU changes, warnings, as a websocket or as
Server-Sent Events."""

from __future__ import annotations

import asyncio
from typing import Any

from tornado import websocket

from ..core.identity import Identity
from .base import BaseHandler, Routes, json_text


class EventsHandler(websocket.WebSocketHandler, BaseHandler):
    """A websocket of events: lease changes (yours; all for admins), GPU changes, warnings."""

    queue: asyncio.Queue[dict[str, Any]] | None = None
    task: asyncio.Task[None] | None = None

    def set_default_headers(self) -> None:
        pass

    def check_origin(self, origin: str) -> bool:
        return True  # no cookies are used: identity is the socket peer or a bearer token

    def open(self) -> None:
        self.queue = self.manager.events.subscribe()
        self.write_message(json_text({"schema": "gpulease.event/1", "type": "hello", "summary": self.manager.summary()}))
        self.task = asyncio.ensure_future(self._pump())

    async def _pump(self) -> None:
        assert self.queue is not None
        while True:
            event = await self.queue.get()
            if visible_to(event, self.who):
                try:
                    await self.write_message(json_text(event))
                except websocket.WebSocketClosedError:
                    return

    def on_message(self, message: str | bytes) -> None:
        pass

    def on_close(self) -> None:
        if self.queue is not None:
            self.manager.events.unsubscribe(self.queue)
        if self.task is not None:
            self.task.cancel()


class EventStreamHandler(BaseHandler):
    """The same events as Server-Sent Events (for clients without websockets)."""

    async def get(self) -> None:
        self.set_header("Content-Type", "text/event-stream")
        q = self.manager.events.subscribe()
        try:
            self.write("retry: 2000\n\n")
            await self.flush()
            while True:
                try:
                    event = await asyncio.wait_for(q.get(), 15.0)
                except asyncio.TimeoutError:
                    self.write(": keepalive\n\n")
                    await self.flush()
                    continue
                if visible_to(event, self.who):
                    self.write(f"id: {event['seq']}\ndata: {json_text(event)}\n\n")
                    await self.flush()
        except Exception:  # the client went away
            pass
        finally:
            self.manager.events.unsubscribe(q)


def visible_to(event: dict[str, Any], who: Identity) -> bool:
    owner = event.get("user")
    return owner is None or who.admin or owner == who.user


def routes(prefix: str) -> Routes:
    return [
        (prefix + r"/events", EventsHandler),
        (prefix + r"/events/stream", EventStreamHandler),
    ]
