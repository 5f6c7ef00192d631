"""What runs the broker's deferred work (``Driver``): the end of an event-loop iteration's group commit and
scheduling pass, throttled events, holder watches. Explicit, never read from ambient state: the service attaches its
event loop at start; the replay passes a ``SyncDriver`` and ends each iteration itself; without either (unit tests,
the restore before the loop starts) everything runs at once, through the same paths."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


class Driver:
    """What runs the broker's deferred work: the event loop the service attaches (``attach``), or, before that and
    without one (unit tests, the restore at start), nothing: each write commits and each scheduling pass runs at
    once, and deferred actions run at once."""

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


class SyncDriver(Driver):
    """Event-loop iterations without an event loop, ended by the caller: the replay (``lease_broker/replay/sim.py``)
    runs the manager on a virtual clock with no loop, yet through the production iteration: the changes a call
    makes are held, and :meth:`run` ends the iteration as the service's loop does (the one scheduling pass for all of
    them, then one group commit, then what runs after it), again until nothing is left. No wall time passes between
    two calls of a replay, so ``call_later`` work runs at that end too.

    One pass and one group commit per iteration instead of one per change (each write of the replay committed
    alone before, and each end ran its own pass in the middle of the enforcer's tick): on the overloaded month
    replay (``benchmarks/replay_month.py``) shortened to 3,000 jobs over 3 days, 11.3 s of CPU before and 8.6 s
    after (the same sitting, a shared machine)."""

    def __init__(self) -> None:
        super().__init__()
        self._ready: list[Callable[[], object]] = []

    @property
    def deferred(self) -> bool:
        return True

    def call_soon(self, action: Callable[[], object]) -> None:
        self._ready.append(action)

    def call_later(self, delay: float, action: Callable[[], object]) -> Any:
        self._ready.append(action)
        return None

    def run(self) -> None:
        """End the iteration: run what waits, and what that queues, until nothing does."""
        while self._ready:
            ready, self._ready = self._ready, []
            for action in ready:
                action()
