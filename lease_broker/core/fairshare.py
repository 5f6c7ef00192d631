"""Fair share: decayed past GPU-seconds per user (as Slurm's fair-share), computed from the store's history.

Usage decays with a half-life: a GPU-second used ``h`` seconds ago counts half. The ended part is kept as a
running total per user, decayed lazily (O(1) per pass) and fed by leases as they end (the GPU table lists them); running leases
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
    """The decayed usage of ended leases per user, kept current incrementally.

    Each total is kept decayed to a reference time ``ref`` and scaled on the way out, so moving the clock costs
    O(1), not a pass over every user who ever held a GPU; the reference moves forward (O(users), rarely) before
    the factor grows large, as in :class:`RunningUsage`."""

    REBASE_AFTER = 32.0  # half-lives

    def __init__(self, half_life: float) -> None:
        self.half_life = half_life
        self._at_ref: dict[str, float] = {}  # user -> decayed usage as of ``ref``
        self.ref = 0.0
        self.at: float | None = None  # the latest time seen; None = not loaded yet

    @property
    def loaded(self) -> bool:
        return self.at is not None

    def load(self, intervals: Iterable[tuple[str, float, float, float]], now: float) -> None:
        """(user, gpus, granted_at, ended_at) of every ended lease."""
        self._at_ref, self.ref, self.at = {}, now, now
        for user, gpus, start, end in intervals:
            self.add(user, gpus, start, end, now)

    def decay_to(self, now: float) -> None:
        self.at = now if self.at is None else max(self.at, now)
        if self.half_life > 0 and (self.at - self.ref) / self.half_life > self.REBASE_AFTER:
            f = self._factor(self.at)
            self._at_ref = {u: v * f for u, v in self._at_ref.items() if v * f > 1e-6}
            self.ref = self.at

    def _factor(self, now: float) -> float:
        """What a GPU-second counted at ``ref`` counts at ``now``."""
        return 2.0 ** (-(now - self.ref) / self.half_life) if self.half_life > 0 else 1.0

    def add(self, user: str, gpus: float, start: float, end: float, now: float) -> None:
        self.decay_to(now)
        value = decayed(gpus, start, end, now, self.half_life) / self._factor(now)
        self._at_ref[user] = self._at_ref.get(user, 0.0) + value

    def of(self, users: Iterable[str] | None = None) -> dict[str, float]:
        """The ended usage of ``users`` (everyone's when None) decayed to the latest time seen."""
        f = self._factor(self.at if self.at is not None else self.ref)
        if users is None:
            return {u: v * f for u, v in self._at_ref.items()}
        return {u: self._at_ref[u] * f for u in users if u in self._at_ref}


class RunningUsage:
    """The decayed usage of the leases running now, per user, kept as two sums so that a query costs O(1).

    For a lease of ``g`` GPUs granted at ``s``, its usage at ``now`` is g·H/ln2·(1 − 2^−(now−s)/H). Over a user's
    leases that is H/ln2·(G − 2^−(now−r)/H · W), with G = Σg and W = Σg·2^(s−r)/H for a reference time r: both
    sums change only when a lease starts or ends. (Without decay, H ≤ 0: G·now − Σg·s.) ``rebuild`` moves r
    forward before the weights grow large (``needs_rebase``); the GPU table feeds it every running lease.
    """

    REBASE_AFTER = 32.0  # half-lives: 2^32 is far from float's range, and rounding stays below 1e-6 GPU-seconds

    def __init__(self, half_life: float) -> None:
        self.half_life = half_life
        self.ref: float | None = None
        self.gpus: dict[str, float] = {}
        self.weighted: dict[str, float] = {}
        self.count: dict[str, int] = {}

    def add(self, user: str, gpus: float, start: float | None, sign: int = 1) -> None:
        if start is None:
            return
        if self.ref is None:
            self.ref = start
        h = self.half_life
        w = gpus * (2.0 ** ((start - self.ref) / h) if h > 0 else start)
        n = self.count.get(user, 0) + sign
        if n <= 0:  # exactly zero, whatever rounding left
            self.count.pop(user, None)
            self.gpus.pop(user, None)
            self.weighted.pop(user, None)
            return
        self.count[user] = n
        self.gpus[user] = self.gpus.get(user, 0.0) + sign * gpus
        self.weighted[user] = self.weighted.get(user, 0.0) + sign * w

    def usage(self, user: str, now: float) -> float:
        g = self.gpus.get(user)
        if g is None or self.ref is None:
            return 0.0
        h = self.half_life
        if h > 0:
            value = h / LN2 * (g - 2.0 ** (-(now - self.ref) / h) * self.weighted[user])
        else:
            value = g * now - self.weighted[user]
        return max(0.0, value)

    def needs_rebase(self, now: float) -> bool:
        return self.ref is not None and self.half_life > 0 and (now - self.ref) / self.half_life > self.REBASE_AFTER

    def rebuild(self, half_life: float, running: Iterable[tuple[str, float, float | None]], ref: float) -> None:
        """Start over with this half-life from (user, gpus, granted_at) of every running lease."""
        self.half_life, self.ref = half_life, ref
        self.gpus, self.weighted, self.count = {}, {}, {}
        for user, gpus, start in running:
            self.add(user, gpus, start)
