"""Holders: a lease ends with the process that asked for it (``ends_with_caller``), as soon as that process exits.

A kernel asks for its leases over the broker's Unix socket, so the broker knows its pid (SO_PEERCRED) and, from
``/proc``, its start time: the lease's ``holder``, a fact of the lease set with its request and stored with it.
This part watches each holder process once (a pidfd on the event loop, ``host.holders.HolderWatch``), however many
leases it holds, and when it exits ends every one of them through ``LeaseOps.end``: a lease holding GPUs is
revoked, a queued one cancelled, both with reason ``holder_exited``; the ending stops the lease's processes and
hands its GPUs on as any ending does. A holder's watch is closed when its last lease ends.

After a restart the stored holders are checked at once (``restored``): a lease whose holder is gone, or whose pid
now names another process (other start ticks), ends then; the others are watched again once the event loop runs.
Without a running loop (the replay, unit tests) nothing is watched and the heartbeat timeout stays the bound, as it
does for a holder the broker cannot see (over TCP, another pid namespace: pid 0).
"""

from __future__ import annotations

import logging

from ..core.driver import Driver
from ..core.lease import HOLDING, Lease, LeaseState
from ..host.holders import Holder, HolderWatch, alive
from ..host.procs import proc_info
from .state import LeaseOps, LiveState

log = logging.getLogger("lease_broker")

#: The reason a lease ends with when its holder process exits (the heartbeat timeout's is ``holder_gone``).
HOLDER_EXITED = "holder_exited"
#: Causes of the ends counted in ``gpulease_leases_holder_ended_total``, by the lease's reason.
CAUSES = {HOLDER_EXITED: "exited", "holder_gone": "heartbeat"}


class Holders:
    def __init__(self, *, state: LiveState, ops: LeaseOps, driver: Driver) -> None:
        self.state, self.ops, self.driver = state, ops, driver
        self.watch = HolderWatch(self.exited, lambda: driver.loop)
        self.leases_of: dict[Holder, set[str]] = {}  # holder -> its live leases (an index of Lease.holder)
        self.pending: set[Holder] = set()  # to watch once the event loop runs (restored before it started)
        self.ended_total = dict.fromkeys(CAUSES.values(), 0)  # leases ended because their holder went, by cause

    def holder_of(self, pid: int) -> Holder | None:
        """The calling process ``pid`` (0: not visible) with its start time, or None."""
        return self.watch.holder_of(pid)

    def track(self, lease: Lease) -> None:
        """A lease with a holder was stored: watch its holder (once per process)."""
        holder = lease.holder
        if holder is None or lease.state.terminal:
            return
        self.leases_of.setdefault(holder, set()).add(lease.id)
        if self.watch.watching(holder):
            return
        if not self.driver.deferred:
            self.pending.add(holder)
            return
        self.pending.discard(holder)
        if not self.watch.watch(holder):  # no pidfd here: the heartbeat timeout stays the bound
            log.info("Holder process %s of lease %s cannot be watched: the lease ends by the heartbeat timeout",
                     holder[0], lease.id)

    def restored(self, leases: list[Lease]) -> list[Lease]:
        """At start, before scheduling: track the restored leases' holders, and end the leases whose holder is gone
        (it exited while the broker was down, or its pid now names another process); those are returned."""
        gone = []
        for lease in leases:
            if lease.holder is not None and alive(lease.holder):
                self.track(lease)
            elif lease.holder is not None:
                gone.append(lease)
        # the queued ones first: an end hands GPUs on at once here (no loop yet), never to a request that ends too
        gone.sort(key=lambda lease: lease.state in HOLDING)
        for lease in gone:
            holder = lease.holder
            assert holder is not None
            recycled = proc_info(holder[0]) is not None
            self.end(lease, f"its holder process {holder[0]} " + (
                "is gone: the pid now names another process" if recycled else "exited while the broker was down"))
        return gone

    def tick(self) -> None:
        """Watch the holders restored before the event loop ran (the manager's tick runs in the loop)."""
        if self.pending and self.driver.deferred:
            pending, self.pending = self.pending, set()
            for holder in pending:
                if holder in self.leases_of:
                    self.watch.watch(holder)

    def exited(self, holder: Holder) -> None:
        """``holder`` exited (``HolderWatch``, from the loop): end each of its live leases."""
        self.pending.discard(holder)
        for lease_id in sorted(self.leases_of.pop(holder, ())):
            lease = self.state.leases.get(lease_id)
            if lease is not None and not lease.state.terminal:
                self.end(lease, f"its holder process {holder[0]} exited")

    def end(self, lease: Lease, why: str) -> None:
        held = lease.state in HOLDING
        log.info("Lease %s of %s ends (%s): %s", lease.id, lease.user, HOLDER_EXITED, why)
        self.ops.end(lease, LeaseState.REVOKED if held else LeaseState.CANCELLED, HOLDER_EXITED)

    def ended(self, lease: Lease) -> None:
        """A lease's end is stored: count it when its holder went, and close the holder's watch with its last
        lease."""
        cause = CAUSES.get(lease.reason)
        if cause is not None:
            self.ended_total[cause] += 1
        holder = lease.holder
        if holder is None or holder not in self.leases_of:
            return
        leases = self.leases_of[holder]
        leases.discard(lease.id)
        if not leases:
            del self.leases_of[holder]
            self.pending.discard(holder)
            self.watch.unwatch(holder)

    def watched(self, lease: Lease) -> bool:
        """Whether the lease's holder process is watched now (its end ends the lease at once)."""
        return lease.holder is not None and self.watch.watching(lease.holder)

    def view(self, lease: Lease) -> tuple[bool, bool]:
        """(watched, alive) of the lease's holder process (a watched one is alive: its exit ends the lease)."""
        if lease.holder is None:
            return False, False
        if self.watched(lease):
            return True, True
        return False, alive(lease.holder)

