"""Warm re-grants: a notebook's next cell finds the GPU its last lease gave back.

With ``%%gpu`` each cell's lease ends with the cell, and a notebook's next cell asks again seconds later. When
its GPUs are still free then, the scheduler gives them to it again (``Pending.prefer``) rather than whichever
fit best, so a notebook keeps its GPU from cell to cell while nobody else needs it. Nothing is held: the GPUs
are free for anyone in between, and a request queued earlier that can use them gets them first (the scheduler
places it first, and reservations for waiting requests apply as to any request).

A notebook is its owner and the request's ``notebook`` label (``%%gpu`` sets it from ``JPY_SESSION_NAME``); a
request without one gets no preference.
"""

from __future__ import annotations

from ..core.lease import Lease
from ..policy.lease_policy import LeasePolicy

KEEP = 10_000  # at most this many notebooks remembered (the oldest forgotten first)


class WarmRegrants:
    def __init__(self, policy: LeasePolicy) -> None:
        self.policy = policy  # its warm_regrant_seconds: the window (0 = off), read at each use
        self._last: dict[tuple[str, str], tuple[tuple[str, ...], float]] = {}  # (user, notebook) -> GPUs, end

    def ended(self, lease: Lease) -> None:
        """A lease that held GPUs ended: its notebook's next request may get them again."""
        notebook = lease.request.labels.get("notebook")
        if not self.policy.warm_regrant_seconds or not notebook or not lease.devices or lease.ended_at is None:
            return
        key = (lease.user, notebook)
        self._last.pop(key, None)  # re-inserted last: the dict stays in order of ends
        self._last[key] = (tuple(lease.devices), lease.ended_at)
        if len(self._last) > KEEP:
            del self._last[next(iter(self._last))]

    def prefer(self, lease: Lease) -> tuple[str, ...]:
        """The GPUs a new request's notebook gave back within the window before it asked; () if none."""
        notebook = lease.request.labels.get("notebook")
        window = self.policy.warm_regrant_seconds
        if not window or not notebook:
            return ()
        last = self._last.get((lease.user, notebook))
        if last is None:
            return ()
        devices, ended_at = last
        return devices if 0.0 <= lease.created_at - ended_at <= window else ()
