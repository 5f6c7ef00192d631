"""Structured events: every lease transition and GPU change, fanned out to subscribers."""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Callable
from typing import Any

SCHEMA = "gpulease.event/1"


class EventBus:
    """Publish events to subscribers' queues; keeps a short backlog for reconnecting clients."""

    def __init__(self, backlog: int = 1000, clock: Callable[[], float] | None = None, views: bool = True) -> None:
        """``views``: whether lease events carry the lease's view (``LeaseManager.commit`` builds it; the service's
        subscribers, the event stream and the notifier, read it). The replay's bus says False: its one subscriber
        reads only which lease changed (``replay/sim.py: collect``), so its events carry ``{"id": ...}``: building a
        view for each of its 14,114 lease events was 0.56 s of 8.0 s of CPU on the 3,000-job version of the
        overloaded month replay (benchmarks/replay_month.py)."""
        self.views = views
        self._seq = itertools.count(1)
        self._subscribers: set[asyncio.Queue[dict[str, Any]]] = set()
        self.backlog: deque[dict[str, Any]] = deque(maxlen=backlog)
        self._clock = clock

    def publish(self, type_: str, **fields: Any) -> dict[str, Any]:
        event = {"schema": SCHEMA, "seq": next(self._seq), "type": type_, **fields}
        if self._clock is not None and "time" not in event:
            event["time"] = self._clock()
        self.backlog.append(event)
        for q in list(self._subscribers):
            if q.qsize() < 10_000:
                q.put_nowait(event)
        return event

    def subscribe(self) -> asyncio.Queue[dict[str, Any]]:
        q: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._subscribers.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue[dict[str, Any]]) -> None:
        self._subscribers.discard(q)

    @property
    def subscriber_count(self) -> int:
        return len(self._subscribers)
