"""One source of time for the whole broker, so tests advance it instead of sleeping."""

from __future__ import annotations

import time


class Clock:
    """Wall-clock time in seconds since the epoch (what is stored) and a monotonic reading."""

    def now(self) -> float:
        return time.time()


class VirtualClock(Clock):
    """A clock that only moves when told to: for scheduler tests and trace replay."""

    def __init__(self, start: float = 1_000_000.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError(f"cannot move a clock backwards ({seconds!r} s)")
        self._now += seconds
        return self._now

    def set(self, when: float) -> None:
        self._now = max(self._now, when)
