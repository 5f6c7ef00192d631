"""One source of time for the whole broker, so tests advance it instead of sleeping.

The broker's time is wall-clock seconds since the epoch (what is stored and what people read), but it runs on the
monotonic clock: ``now() = anchor + monotonic()``, the anchor taken from the wall clock when the clock is made. A
wall-clock step (``date -s``, a virtual machine's clock set after a pause, a bad NTP server) does not move it, so
no deadline jumps. The tick calls :meth:`Clock.resync`: it compares with the wall clock and re-anchors on it, and
when the two differ by more than ``step_tolerance`` it reports the step, which the lease manager applies to every
live lease (``LeaseManager.retime``) so that each keeps its remaining time and the times people read stay right.
NTP's slewing moves the monotonic clock with the wall clock, and the clock used counts the time the host was
suspended (``CLOCK_BOOTTIME`` on Linux), so the two drift apart only by a step. After a restart the stored wall times are the
truth: a new clock anchors on the wall clock again.
"""

from __future__ import annotations

import os
import time

#: Seconds by which the wall clock may differ from the broker's time at a tick before it counts as a step (a
#: smaller difference is followed quietly: deadlines move by less than a tick).
STEP_TOLERANCE = 1.0

#: CLOCK_BOOTTIME counts the time a suspended host slept (a lease's time limit is real time); elsewhere the
#: monotonic clock
_MONOTONIC = getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC)

#: Test hook: when this environment variable names a file, the broker reads its wall clock as ``time.time()`` plus
#: the number of seconds the file holds (re-read at each reading, the last good value kept while it cannot be
#: parsed), so that a test steps one broker's wall clock without ``date -s`` for the whole host. Unset in production.
TEST_CLOCK_FILE = "GPULEASE_TEST_CLOCK_FILE"


class Clock:
    """The broker's time: wall-clock seconds since the epoch, advanced by the monotonic clock (module docstring)."""

    def __init__(self, step_tolerance: float = STEP_TOLERANCE) -> None:
        self.step_tolerance = step_tolerance
        self._offset_file = os.environ.get(TEST_CLOCK_FILE) or None
        self._offset = 0.0
        self._base = self.wall() - self.monotonic()  # now() = _base + monotonic()

    def now(self) -> float:
        """The broker's time: every deadline is compared with this, and it is what is stored and shown."""
        return self._base + self.monotonic()

    def monotonic(self) -> float:
        """Seconds on a clock that no one can set and that counts a suspended host's sleep (for intervals only: its
        zero means nothing)."""
        return time.clock_gettime(_MONOTONIC)

    def wall(self) -> float:
        """The host's wall clock (steps with it): only :meth:`resync` and the anchor read it."""
        return time.time() + (self._read_offset() if self._offset_file else 0.0)

    def resync(self) -> float:
        """Re-anchor on the wall clock; the step in seconds (wall clock minus the broker's time before) when they
        differed by more than ``step_tolerance``, else 0.0 (followed quietly). Called once a tick."""
        mono = self.monotonic()
        wall = self.wall()
        step = wall - (self._base + mono)
        self._base = wall - mono
        return step if abs(step) > self.step_tolerance else 0.0

    def _read_offset(self) -> float:
        assert self._offset_file is not None
        try:
            with open(self._offset_file) as f:
                self._offset = float(f.read().strip() or 0.0)
        except (OSError, ValueError):
            pass  # missing or being written: the last value holds
        return self._offset


class VirtualClock(Clock):
    """A clock that only moves when told to: for scheduler tests and trace replay.

    Its monotonic reading starts at ``start`` and its wall clock agrees with it until :meth:`step_wall`, so that
    ``now()`` is exactly what ``advance`` and ``set`` make it (replays stay deterministic)."""

    def __init__(self, start: float = 1_000_000.0, step_tolerance: float = STEP_TOLERANCE) -> None:
        self._mono = start
        self._wall_ahead = 0.0  # how far the virtual wall clock is ahead of the monotonic reading
        super().__init__(step_tolerance)

    def monotonic(self) -> float:
        return self._mono

    def wall(self) -> float:
        return self._mono + self._wall_ahead

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError(f"cannot move a clock backwards ({seconds!r} s)")
        self._mono += seconds
        return self.now()

    def set(self, when: float) -> None:
        self._mono = max(self._mono, when - self._base)

    def step_wall(self, seconds: float) -> None:
        """Set the virtual wall clock ``seconds`` forward (or back, when negative), as ``date -s`` would; the
        broker's time follows at the next :meth:`resync`."""
        self._wall_ahead += seconds
