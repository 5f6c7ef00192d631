"""The end of an event-loop iteration: one scheduling pass for every change of the iteration, then the group
commit of every write it made (``store.group_commit``).

Under load many requests and releases arrive in one iteration. Each used to pay a scheduling pass and a
transaction of its own; now the first change of an iteration queues one callback that runs the pass (which may
add grants) and then commits the iteration's writes together. Answers wait for it (:meth:`Iteration.settled`),
so a client that releases and then asks again sees the GPU handed on, and no answer reports a change that is
not stored yet. Without a running loop (the replay, unit tests) a pass runs at once and writes commit at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from ..store.group_commit import GroupCommit, loop_running
from ..store.lease_store import Store

log = logging.getLogger("lease_broker")


class Iteration:
    def __init__(self, store: Store, run_pass: Callable[[], object], on_failed: Callable[[], None]) -> None:
        self._run_pass = run_pass
        self.group = GroupCommit(store, on_open=self._queue, on_failed=on_failed)
        self._queued = False  # the end-of-iteration callback is queued
        self._pass_due = False
        self._waiting: list[asyncio.Future[None]] = []

    def pass_soon(self) -> None:
        """A scheduling pass at the end of this iteration (one for all its changes); at once without a loop."""
        if not loop_running():
            self._run_pass()
            return
        self._pass_due = True
        self._queue()

    async def settled(self) -> None:
        """Return once the pass queued so far has run and every write so far is stored (``StoreError`` if the
        writes could not be stored)."""
        if self._queued and not self.group.open:  # a pass is due: it may write
            fut = asyncio.get_running_loop().create_future()
            self._waiting.append(fut)
            await fut
        await self.group.durable()

    def _queue(self) -> None:
        if not self._queued:
            self._queued = True
            asyncio.get_running_loop().call_soon(self._end)

    def _end(self) -> None:
        if self._pass_due:
            self._pass_due = False
            try:
                self._run_pass()
            except Exception:  # e.g. the store cannot be written: the next request, release or tick tries again
                log.exception("Scheduling pass failed")
        self._queued = False  # from here, a change (e.g. by an action after the commit) queues the next one
        self.group.flush()
        waiting, self._waiting = self._waiting, []
        for fut in waiting:
            if not fut.done():
                fut.set_result(None)
