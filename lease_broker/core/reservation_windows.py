"""Advance reservations inside a scheduling pass: which GPUs each reservation holds, and who may use them.

A reservation (``Window``) books ``gpus`` GPUs for its members from ``start`` to ``end``. On every pass the
scheduler gives each one its GPUs afresh (``WindowMap.place``): the GPUs its members hold first, then those
free soonest, grouped on the nodes with the most GPUs free in time. Reservations whose windows overlap get
different GPUs; one GPU may serve several reservations one after the other. Before a window, others may use
its GPUs only if they end before it starts; during it, only its members may.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

from .slots import Slot

INF = math.inf


@dataclasses.dataclass(frozen=True)
class Window:
    """An advance reservation: ``gpus`` GPUs for ``members`` (users) from ``start`` to ``end``.

    ``held`` lists GPUs that members hold now: they count toward the reservation first.
    """

    id: str
    gpus: int
    start: float
    end: float
    members: frozenset[str]
    held: tuple[str, ...] = ()


class WindowMap:
    """The reservations' GPUs during one pass (over the pass's working copy of the slots)."""

    def __init__(self, slots: list[Slot], now: float) -> None:
        self.slots, self.now = slots, now
        self.of: dict[str, list[Window]] = {}  # slot id -> the reservations it serves, by start

    def place(self, windows: Sequence[Window]) -> dict[str, Window]:
        """Give every reservation its GPUs, earliest first; returns GPU id -> its earliest reservation.

        (Creating a reservation checks that the overlapping ones fit the inventory.)
        """
        first: dict[str, Window] = {}
        # by start; ties broken by content before the (random) id, so that a pass never depends on ids
        for w in sorted(windows, key=lambda w: (w.start, w.end, -w.gpus, sorted(w.members), w.held, w.id)):
            if w.end <= self.now:
                continue
            for s in self.pick(w):
                self.of.setdefault(s.id, []).append(w)
                first.setdefault(s.id, w)
        return first

    def pick(self, w: Window) -> list[Slot]:
        """The GPUs a reservation holds: its members' GPUs first, then those free soonest (from its start, or
        now if it is open), grouped on the nodes with the most GPUs free in time."""
        cand = [s for s in self.slots if (s.available or s.free_at < INF)
                and not any(o.start < w.end and w.start < o.end for o in self.of.get(s.id, ()))]
        held = set(w.held)
        t0 = max(w.start, self.now)

        def late(s: Slot) -> tuple[int, float]:
            return (0 if s.id in held else 1, max(0.0, (self.now if s.idle else s.free_at) - t0))

        on_time: dict[str, int] = {}
        for s in cand:
            on_time[s.node] = on_time.get(s.node, 0) + (late(s)[1] == 0)
        cand.sort(key=lambda s: (late(s), -on_time[s.node], s.node, s.index))
        return cand[: w.gpus]

    def ok(self, s: Slot, end: float, user: str) -> bool:
        """A reserved GPU goes to its reservations' members, or to others only if they end before it starts."""
        return all(user in w.members or end <= w.start for w in self.of.get(s.id, ()))


def window_slots(slots: Iterable[Slot], windows: Sequence[Window], now: float) -> dict[str, list[Window]]:
    """Which GPUs the given reservations hold (GPU id -> its reservations by start), as a pass places them."""
    wm = WindowMap([s.clone() for s in slots], now)
    wm.place(windows)
    return wm.of


def window_shortfall(slots: Iterable[Slot], windows: Sequence[Window], now: float) -> dict[str, int]:
    """Per reservation (id), how many of its GPUs will not be ready at its start: missing, or held past it by
    someone who is not a member. A change (a renewal) may not make this worse for any reservation."""
    wm = WindowMap([s.clone() for s in slots], now)
    wm.place(windows)
    short = {w.id: w.gpus for w in windows if w.end > now}
    by_id = {s.id: s for s in wm.slots}
    for sid, ws in wm.of.items():
        s = by_id[sid]
        ready = now if s.idle else s.free_at
        for w in ws:
            if sid in w.held or ready <= max(w.start, now) + 1e-9:
                short[w.id] -= 1
    return short
