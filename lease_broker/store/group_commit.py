"""Group commit: the lease writes of one event-loop iteration share one SQLite transaction.

Under load many requests arrive in one iteration of the broker's event loop; one transaction each cost more than
the rest of a grant (BEGIN, COMMIT and the WAL frames of the same pages, again and again). A ``GroupCommit``
collects the writes of an iteration in one open transaction, each in a savepoint of its own, and commits at the
end of the iteration (the owner calls :meth:`flush`). Durability is unchanged because nothing that depends on a
write leaves the broker before its transaction commits:

- answers wait for :meth:`durable` (the API's ``reply``);
- what a write causes outside the store (events, stopping processes, the inventory's hooks) is handed to
  :meth:`after` and runs once the write's transaction has committed.

If the commit fails (the disk is full, another process holds the lock), nothing of the iteration was stored:
every write's ``undo`` runs (newest first; the owner puts its memory back as it was), the ``after`` actions are
dropped and every waiting answer gets the ``StoreError``, as a single transaction's failure did before.

Without a running event loop (the replay, unit tests) there is no iteration to share: each write is its own
transaction, committed at once, and ``after`` actions run at once.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from .lease_store import Store, StoreError

log = logging.getLogger("lease_broker")


class GroupCommit:
    def __init__(self, store: Store, on_open: Callable[[], None], on_failed: Callable[[], None]) -> None:
        """``on_open``: called when a group opens; its owner makes sure :meth:`flush` runs at the end of the
        iteration (after its own end-of-iteration work, e.g. the scheduling pass that may add grants).
        ``on_failed``: called after a failed group's undos, to rebuild what derives from the owner's memory."""
        self.store = store
        self._on_open, self._on_failed = on_open, on_failed
        self.open = False
        self._undo: list[Callable[[], None]] = []
        self._after: list[Callable[[], object]] = []
        self._waiting: list[asyncio.Future[None]] = []
        self.groups = 0  # committed groups, and the writes in them (GET /metrics)
        self.writes = 0
        store.before_transaction = self._before_transaction
        store.join_group = lambda: self.write(_nothing)

    @contextmanager
    def write(self, undo: Callable[[], None]) -> Iterator[sqlite3.Connection]:
        """Statements of one lease write: in the open group when an event loop runs (``undo`` puts the owner's
        memory back should the group fail later), else in a transaction of their own. A failed write changes
        nothing and raises ``StoreError``."""
        if not _loop_running():
            with self.store.transaction() as db:
                yield db
            return
        db = self.store.db
        if not self.open:
            with self.store.unwritable_as_store_error():
                db.execute("BEGIN IMMEDIATE")
            self.open = True
            self._on_open()
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

    def flush(self) -> None:
        """Commit the open group: resolve the answers waiting for it and run its ``after`` actions; on failure,
        undo its writes and fail the answers."""
        if not self.open:
            return
        try:
            with self.store.unwritable_as_store_error():
                self.store.db.execute("COMMIT")
        except StoreError as e:
            self._failed(e)
            return
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

    def _failed(self, error: StoreError) -> None:
        log.error("%s", error.message)
        if self.store.db.in_transaction:
            self.store.db.execute("ROLLBACK")
        self.open = False
        undo, waiting = self._undo, self._waiting
        self._undo, self._after, self._waiting = [], [], []
        for action in reversed(undo):
            action()
        self._on_failed()
        for fut in waiting:
            if not fut.done():
                fut.set_exception(error)

    def _before_transaction(self) -> None:
        """Another write (drains, tokens, reservations, the policy audit) starts a transaction of its own: the
        group commits first, so that write keeps its own all-or-nothing answer."""
        self.flush()


def _nothing() -> None:
    """The undo of a write that changed nothing in memory."""


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
