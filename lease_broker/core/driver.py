"""What runs the broker's deferred work (``Driver``): the end of an event-loop iteration's group commit and
scheduling pass, throttled events, holder watches. Explicit, never read from ambient state: the service attaches its
event loop at start; without one (the replay, unit tests, the restore before the loop starts) everything runs at
once, through the same paths."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


class Driver:
    """What runs the broker's deferred work: the event loop the service attaches (``attach``), or, before that and
    without one (the replay, unit tests, the restore at start), nothing: each write commits and each scheduling pass
    runs at once, and deferred actions run at once."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.loop = loop

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    @property
    def deferred(self) -> bool:
        """Whether work waits for the end of the event-loop iteration (a loop is attached)."""
        return self.loop is not None

    def call_soon(self, action: Callable[[], object]) -> None:
        if self.loop is None:
            action()
        else:
            self.loop.call_soon(action)

    def call_later(self, delay: float, action: Callable[[], object]) -> Any:
        if self.loop is None:
            action()
            return None
        return self.loop.call_later(delay, action)
