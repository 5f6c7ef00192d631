"""Fair share: decayed past GPU-seconds per user (as Slurm's fair-share), computed from the store's history.

Usage decays with a half-life: a GPU-second used ``h`` seconds ago counts half. The ended part is kept as a
running total decayed to the last pass and fed by leases as they end (the GPU table lists them); running leases
are added at each pass.
Everything is derived from the lease store (granted_at/ended_at of every lease), so it survives restarts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

LN2 = math.log(2.0)


def decayed(gpus: float, start: float, end: float, now: float, half_life: float) -> float:
    """GPU-seconds of ``gpus`` GPUs held from ``start`` to ``end``, each second decayed to ``now``."""
    end = min(end, now)
    if end <= start:
        return 0.0
    if half_life <= 0:
        return gpus * (end - start)
    return gpus * half_life / LN2 * (2.0 ** (-(now - end) / half_life) - 2.0 ** (-(now - start) / half_life))


class FairShare:
    """The decayed usage of ended leases per user, kept current incrementally."""

    def __init__(self, half_life: float) -> None:
        self.half_life = half_life
        self.ended: dict[str, float] = {}
        self.at: float | None = None  # when ``ended`` was last decayed; None = not loaded yet

    @property
    def loaded(self) -> bool:
        return self.at is not None

    def load(self, intervals: Iterable[tuple[str, float, float, float]], now: float) -> None:
        """(user, gpus, granted_at, ended_at) of every ended lease."""
        self.ended = {}
        for user, gpus, start, end in intervals:
            self.add(user, gpus, start, end, now)
        self.at = now

    def decay_to(self, now: float) -> None:
        if self.at is not None and self.half_life > 0 and now > self.at:
            f = 2.0 ** (-(now - self.at) / self.half_life)
            self.ended = {u: v * f for u, v in self.ended.items() if v * f > 1e-6}
        self.at = now if self.at is None else max(self.at, now)

    def add(self, user: str, gpus: float, start: float, end: float, now: float) -> None:
        self.ended[user] = self.ended.get(user, 0.0) + decayed(gpus, start, end, now, self.half_life)

    def usage(self, running: Iterable[tuple[str, float, float]], now: float) -> dict[str, float]:
        """Decayed usage per user at ``now``: the ended total plus (user, gpus, granted_at) of running leases."""
        self.decay_to(now)
        out = dict(self.ended)
        for user, gpus, start in running:
            out[user] = out.get(user, 0.0) + decayed(gpus, start, now, now, self.half_life)
        return out
