"""Group commit: the lease writes of one event-loop iteration share one SQLite transaction.

Under load many requests arrive in one iteration of the broker's event loop; one transaction each cost more than
the rest of a grant (BEGIN, COMMIT and the WAL frames of the same pages, again and again). A ``GroupCommit``
collects the lease changes of an iteration in memory and writes them at the end of the iteration (the owner calls
:meth:`flush`) in one transaction, coalesced: each changed lease's row once, as it is then (a request granted in
the iteration that made it is one row, not an insert and a replace), its history rows in order, with one
statement per kind (``executemany``). A read of the store in the middle of an iteration first writes what is held
into the open transaction (``Store.reading``), so it sees every change so far. Durability is unchanged because
nothing that depends on a change leaves the broker before its transaction commits:

- answers wait for :meth:`durable` (the API's ``reply``);
- what a write causes outside the store (events, stopping processes, the inventory's hooks) is handed to
  :meth:`after` and runs once the write's transaction has committed.

If the commit fails (the disk is full, another process holds the lock), nothing of the iteration was stored:
every change's ``undo`` runs (newest first; the owner puts its memory back as it was), the ``after`` actions are
dropped and every waiting answer gets the ``StoreError``, as a single transaction's failure did before. Other
writers that share the group (``Store.batched``: the notification outbox, learned groups) run their statements in
the open transaction at once, each in a savepoint of its own.

What ends an iteration is explicit: a :class:`Driver`. The service attaches its event loop at start
(``Driver.attach``); the replay passes a ``SyncDriver`` and ends each iteration itself. Until then, and in unit
tests that never attach one, there is no iteration to share: each write goes through the same path (held, written
with ``write_leases``, committed) at once, a failure raises ``StoreError`` to the writer after its undo, and
``after`` actions run at once.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

from ..core.driver import Driver
from ..core.lease import Lease, LeaseState
from .lease_store import Store, StoreError

log = logging.getLogger("lease_broker")


class GroupCommit:
    def __init__(self, store: Store, driver: Driver, on_open: Callable[[], None],
                 on_failed: Callable[[], None]) -> None:
        """``on_open``: called when a group opens under a deferring driver; its owner makes sure :meth:`flush` runs
        at the end of the iteration (after its own end-of-iteration work, e.g. the scheduling pass that may add
        grants). ``on_failed``: called after a failed group's undos, to rebuild what derives from the owner's
        memory."""
        self.store, self.driver = store, driver
        self._on_open, self._on_failed = on_open, on_failed
        self.open = False
        self._undo: list[Callable[[], None]] = []
        self._after: list[Callable[[], object]] = []
        self._waiting: list[asyncio.Future[None]] = []
        # the lease changes held for the end of the iteration
        self._new: dict[str, Lease] = {}
        self._changed: dict[str, Lease] = {}
        self._history: list[tuple[str, str | None, str, str, float]] = []
        self.groups = 0  # committed groups, and the writes in them (GET /metrics)
        self.writes = 0
        store.use_journal(self)

    def lease_write(self, lease: Lease, undo: Callable[[], None], at: float, *, new: bool = False,
                    from_state: LeaseState | None = None, row: bool = True) -> None:
        """One change of a lease: held for the end of the iteration (``undo`` puts the owner's memory back should the
        group fail); without a deferring driver committed at once (a failure undoes it and raises ``StoreError``)."""
        self._opened()
        if new:
            self._new[lease.id] = lease
        elif row and lease.id not in self._new:
            self._changed[lease.id] = lease
        if new or (row and from_state is not None):
            self._history.append((lease.id, None if new or from_state is None else from_state.value,
                                  lease.state.value, lease.reason, at))
        self._undo.append(undo)
        self.writes += 1
        self._commit_now()

    def _commit_now(self) -> None:
        """Without a deferring driver, each write is its own group: commit it, raising what failed."""
        if not self.driver.deferred and self.open:
            error = self.flush()
            if error is not None:
                raise error

    @contextmanager
    def write(self, undo: Callable[[], None]) -> Iterator[sqlite3.Connection]:
        """Statements of another writer (``Store.batched``) in the open group (``undo`` puts the owner's memory back
        should the group fail later; without a deferring driver the group commits at once). A failed write changes
        nothing and raises ``StoreError``."""
        db = self.store.db
        try:
            self._write_held()
        except StoreError as e:
            if self.open:  # the changes held so far cannot be stored: the group fails
                self._failed(e)
            raise
        self._opened()
        db.execute("SAVEPOINT w")
        try:
            yield db
        except BaseException as e:
            if db.in_transaction:  # only this write is undone
                db.execute("ROLLBACK TO w")
                db.execute("RELEASE w")
            else:  # SQLite rolled back the whole transaction (SQLITE_FULL, IOERR): the group is lost
                self._failed(self.store.unwritable(e))
            if isinstance(e, sqlite3.Error):
                raise self.store.unwritable(e) from e
            raise
        db.execute("RELEASE w")
        self._undo.append(undo)
        self.writes += 1
        self._commit_now()

    def after(self, action: Callable[[], object]) -> None:
        """Run ``action`` once the writes so far are stored (at once when nothing waits to be committed)."""
        if self.open:
            self._after.append(action)
        else:
            action()

    async def durable(self) -> None:
        """Return once every write made so far is stored; raises ``StoreError`` if their group failed."""
        if not self.open:
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiting.append(fut)
        await fut

    def flush(self) -> StoreError | None:
        """Commit the open group: resolve the answers waiting for it and run its ``after`` actions; on failure,
        undo its writes, fail the answers and return the error."""
        if not self.open:
            return None
        try:
            self._write_held()
            with self.store.unwritable_as_store_error():
                self.store.db.execute("COMMIT")
        except StoreError as e:
            self._failed(e)
            return e
        self.open = False
        self.groups += 1
        waiting, after = self._waiting, self._after
        self._undo, self._after, self._waiting = [], [], []
        for fut in waiting:
            if not fut.done():
                fut.set_result(None)
        for action in after:
            try:
                action()
            except Exception:
                log.exception("An action after a store commit failed")
        return None

    def _opened(self) -> None:
        if not self.open:
            self.open = True
            if self.driver.deferred:
                self._on_open()

    def _write_held(self) -> None:
        """Write the held lease changes into the open transaction (begun here if need be); ``StoreError`` if that
        fails (the caller fails the group: what was held cannot be stored)."""
        db = self.store.db
        with self.store.unwritable_as_store_error():
            if not db.in_transaction:
                db.execute("BEGIN IMMEDIATE")
            if self._new or self._changed or self._history:
                self.store.write_leases(db, self._new.values(), self._changed.values(), self._history)
                self._drop_held()

    def _drop_held(self) -> None:
        self._new, self._changed, self._history = {}, {}, []

    def before_read(self) -> None:
        """A read in the middle of an iteration sees the changes held so far (written, not committed)."""
        if self.open and (self._new or self._changed or self._history):
            try:
                self._write_held()
            except StoreError as e:
                self._failed(e)
                raise

    def _failed(self, error: StoreError) -> None:
        log.error("%s", error.message)
        if self.store.db.in_transaction:
            self.store.db.execute("ROLLBACK")
        self._drop_held()
        self.open = False
        undo, waiting = self._undo, self._waiting
        self._undo, self._after, self._waiting = [], [], []
        for action in reversed(undo):
            action()
        self._on_failed()
        for fut in waiting:
            if not fut.done():
                fut.set_exception(error)

    def joined(self) -> AbstractContextManager[sqlite3.Connection]:
        """Another writer's statements in the open group (``Store.batched``)."""
        return self.write(_nothing)

    def before_transaction(self) -> None:
        """Another write (drains, tokens, reservations, the policy audit) starts a transaction of its own: the
        group commits first, so that write keeps its own all-or-nothing answer."""
        self.flush()


def _nothing() -> None:
    """The undo of a write that changed nothing in memory."""

