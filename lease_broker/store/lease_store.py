"""Leases, their transitions, drains and tokens in SQLite (the store package is the only place that touches SQL).

SQLite in WAL mode; every lease transition is one transaction that updates the
lease and appends to its history. ``:memory:`` for unit tests.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sqlite3
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from operator import itemgetter
from typing import Any, Protocol

from ..core.errors import Unavailable
from ..core.lease import TERMINAL, Lease, LeaseRequest, LeaseState
from .checkpoint import Checkpointer
from .lease_rows import COLUMNS, HISTORY, INSERT, REPLACE, from_row, to_row
from .upgrade import upgrade

log = logging.getLogger("lease_broker")

# 2: leases.usage (what each lease used); 3: leases.holder (the process a lease ends with); 4: leases.preempting
# (the preemption warning, a fact of the lease; the preemptions table folded in); 5: leases.suspension,
# suspended_seconds, suspensions (a suspended lease; the partial index leases_state lists 'suspended'); added to an
# older store when it opens (store/upgrade.py)
SCHEMA_VERSION = 5

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS leases (
    id TEXT PRIMARY KEY,
    seq INTEGER NOT NULL,
    user TEXT NOT NULL,
    uid INTEGER NOT NULL,
    state TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '',
    request TEXT NOT NULL,
    devices TEXT NOT NULL DEFAULT '[]',
    node TEXT NOT NULL DEFAULT '',
    created_at REAL NOT NULL,
    granted_at REAL,
    expires_at REAL,
    ended_at REAL,
    duration_seconds REAL NOT NULL,
    idle_timeout_seconds REAL NOT NULL,
    last_heartbeat REAL NOT NULL,
    last_activity REAL NOT NULL,
    pids TEXT NOT NULL DEFAULT '[]',
    secret_hash TEXT NOT NULL DEFAULT '',
    usage TEXT NOT NULL DEFAULT '',
    holder TEXT NOT NULL DEFAULT '',
    preempting TEXT NOT NULL DEFAULT '',
    suspension TEXT NOT NULL DEFAULT '',
    suspended_seconds REAL NOT NULL DEFAULT 0,
    suspensions INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS leases_state ON leases(state) WHERE state IN ('queued','granted','active','idle','suspended');
CREATE INDEX IF NOT EXISTS leases_user ON leases(user, created_at);
CREATE TABLE IF NOT EXISTS transitions (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    lease_id TEXT NOT NULL,
    from_state TEXT,
    to_state TEXT NOT NULL,
    reason TEXT NOT NULL,
    at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS transitions_lease ON transitions(lease_id);
CREATE TABLE IF NOT EXISTS drains (
    gpu_id TEXT PRIMARY KEY,
    lease_id TEXT NOT NULL,
    since REAL NOT NULL,
    pids TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS tokens (
    hash TEXT PRIMARY KEY,
    user TEXT NOT NULL,
    admin INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    note TEXT NOT NULL DEFAULT ''
);
"""

_LIVE_STATES = "(" + ",".join(f"'{s.value}'" for s in LeaseState if s not in TERMINAL) + ")"
# Literal states, the same as the partial index's: with bound parameters SQLite cannot tell that the index
# covers the query and scans every lease ever stored.
_LIVE = f"SELECT {COLUMNS} FROM leases WHERE state IN {_LIVE_STATES}"
assert f"WHERE state IN {_LIVE_STATES}" in _SCHEMA, "the live states and the partial index leases_state differ"


class Journal(Protocol):
    """The owner of a store's writes (``GroupCommit``): what it holds is written before a read or a transaction of
    another writer, and other writers' statements join its open group."""

    def before_read(self) -> None: ...

    def before_transaction(self) -> None: ...

    def joined(self) -> AbstractContextManager[sqlite3.Connection]: ...


class StoreError(Unavailable):
    reason = "store_unavailable"


#: The tables of the first schema: every store that is not new has all of them.
_FIRST_TABLES = frozenset({"meta", "leases", "transitions", "drains", "tokens"})
_TABLE_RE = re.compile(r"CREATE TABLE IF NOT EXISTS (\w+)")


def _damaged(path: str, what: str) -> StoreError:
    return StoreError(f"The lease store {path!r} is damaged: {what}. Restore it from a backup (see 'Store: upgrading "
                      "and backing up' in the admin guide), or move it aside to start with an empty store; the broker "
                      "never silently forgets leases", reason="store_damaged")


def _private_file(path: str) -> None:
    """Create the store 0600 (SQLite gives its -wal/-shm files the same mode); tighten an older one."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:
        raise StoreError(f"Cannot open the lease store {path!r}: {e.strerror}. Point LeaseBroker.db_path (--db) "
                         "at a file the broker can write") from e
    try:
        if os.fstat(fd).st_mode & 0o077:
            logging.getLogger("lease_broker").warning("Lease store %s was readable by others: mode set to 0600", path)
            os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


class Store:
    """SQLite persistence. Every method is one transaction."""

    def __init__(self, path: str = ":memory:") -> None:
        self.path = path
        if path != ":memory:":
            _private_file(path)
        try:
            self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=2.0)
            if path != ":memory:":
                mode = self.db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
                if mode.lower() != "wal":
                    raise sqlite3.OperationalError(f"cannot enable WAL (journal_mode={mode})")
            self.db.execute("PRAGMA synchronous=NORMAL")
            if path != ":memory:":  # checkpoints (they fsync) run in a thread of their own, not in a transition
                self.db.execute("PRAGMA wal_autocheckpoint=0")
            self.db.execute("PRAGMA foreign_keys=ON")
            self.add_tables(_SCHEMA)
            check = self.db.execute("PRAGMA quick_check").fetchone()[0]
            if check != "ok":
                raise sqlite3.DatabaseError(f"integrity check failed: {check}")
            row = self.db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            if row is None:
                self.db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            elif int(row[0]) > SCHEMA_VERSION:
                raise sqlite3.DatabaseError(
                    f"store schema {row[0]} is newer than this broker understands ({SCHEMA_VERSION}): upgrade the broker"
                )
            elif int(row[0]) < SCHEMA_VERSION:
                upgrade(self.db, int(row[0]), SCHEMA_VERSION, _LIVE_STATES)
        except sqlite3.Error as e:
            raise StoreError(
                f"Cannot open the lease store {path!r}: {e}. Fix or move the file, or point "
                "LeaseBroker.db_path (--db) elsewhere; the broker will not start without its leases."
            ) from e
        #: the group commit that owns this store's writes (``use_journal``), or None (a store only read)
        self.journal: Journal | None = None
        self._checkpointer: Checkpointer | None = Checkpointer(path) if path != ":memory:" else None

    def use_journal(self, journal: Journal) -> None:
        """Hand this store's writes to ``journal`` (the group commit); a store has one owner of its writes."""
        if self.journal is not None and self.journal is not journal:
            raise RuntimeError("This lease store's writes already have an owner (a group commit)")
        self.journal = journal

    def add_tables(self, script: str) -> None:
        """Run ``script`` (``CREATE TABLE IF NOT EXISTS``): a table this store never had is created (a new store, a
        newer broker's additive table), one it had and lost is refused, naming it: an empty table in its place would
        silently forget what it held (the leases' history, reservations, the outbox). The tables a store has had are
        kept in ``meta`` ('tables'); a store that has any table of the first schema has had them all."""
        names = _TABLE_RE.findall(script)
        present = {r[0] for r in self.db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        had = set(_FIRST_TABLES) if present & _FIRST_TABLES else set()
        if "meta" in present:
            row = self.db.execute("SELECT value FROM meta WHERE key='tables'").fetchone()
            try:
                had.update(json.loads(row[0]) if row else ())
            except (ValueError, TypeError) as e:
                raise _damaged(self.path, f"its list of tables cannot be read ({e})") from e
        lost = sorted(had.intersection(names) - present)
        if lost:
            raise _damaged(self.path, f"its table{'s' if len(lost) > 1 else ''} {', '.join(map(repr, lost))} "
                                      "went missing (dropped or cut off)")
        self.db.executescript(script)
        if not had.issuperset(names):
            self.db.execute("REPLACE INTO meta VALUES ('tables', ?)", (json.dumps(sorted(had.union(names))),))

    def transaction(self) -> "_Tx":
        return _Tx(self)

    def batched(self) -> AbstractContextManager[sqlite3.Connection]:
        """Statements that may share the open group commit (nothing to undo in memory if it fails): in it when
        there is one (``use_journal``), else in a transaction of their own."""
        return self.journal.joined() if self.journal is not None else self.transaction()

    def reading(self) -> sqlite3.Connection:
        """The connection, for a read of leases, transitions or processes that must see every change so far."""
        if self.journal is not None:
            self.journal.before_read()
        return self.db

    def unwritable(self, e: BaseException) -> StoreError:
        return StoreError(f"The lease store {self.path!r} cannot be written ({e}); nothing was changed. "
                          "Free disk space or stop the other process that locks it.")

    @contextmanager
    def unwritable_as_store_error(self) -> Iterator[None]:
        try:
            yield
        except sqlite3.Error as e:
            raise self.unwritable(e) from e

    def next_seq(self) -> int:
        row = self.reading().execute("SELECT COALESCE(MAX(seq), 0) FROM leases").fetchone()
        return int(row[0]) + 1

    # --- leases ------------------------------------------------------------------------------
    def insert(self, lease: Lease, at: float) -> None:
        with self.transaction() as db:
            self.write_lease(db, lease, at, new=True)

    def transition(self, lease: Lease, from_state: LeaseState | None, at: float) -> None:
        """Persist a lease's new state (and every other field) with a history row."""
        with self.transaction() as db:
            self.write_lease(db, lease, at, from_state=from_state)

    @staticmethod
    def write_lease(db: sqlite3.Connection, lease: Lease, at: float, *, new: bool = False,
                    from_state: LeaseState | None = None, row: bool = True) -> None:
        """The statements of one lease change, inside the caller's transaction (``transaction()``, or the
        group commit's): the lease's row (``row``), a history row when it is ``new`` or leaves ``from_state``."""
        if new:
            db.execute(INSERT, to_row(lease))
            db.execute(HISTORY, (lease.id, None, lease.state.value, lease.reason, at))
        elif row:
            db.execute(REPLACE, to_row(lease))
            if from_state is not None:
                db.execute(HISTORY, (lease.id, from_state.value, lease.state.value, lease.reason, at))

    @staticmethod
    def write_leases(db: sqlite3.Connection, new: Iterable[Lease], changed: Iterable[Lease],
                     history: list[tuple[str, str | None, str, str, float]]) -> None:
        """Many lease changes at once (the group commit's), inside the caller's transaction: the rows of ``new``
        leases (an id already stored fails the statement: never an overwrite) and of ``changed`` ones, as they
        are now; the history rows in order."""
        for sql, rows in ((INSERT, [to_row(lease) for lease in new]), (REPLACE, [to_row(lease) for lease in changed]),
                          (HISTORY, history)):
            if rows:
                db.executemany(sql, rows)

    def live(self) -> list[Lease]:
        """Every lease that is not terminal, in arrival order."""
        rows = self.reading().execute(_LIVE).fetchall()
        rows.sort(key=itemgetter(1))  # by seq, here: ORDER BY would copy every row into a temporary B-tree first
        try:  # one JSON document for every row: a restart with 10,000 leases parses it in one call
            decoded = json.loads("[" + ",".join(f"[{r[7]},{r[17]}]" for r in rows) + "]")
            if len(decoded) != len(rows) or any(len(d) != 2 for d in decoded):
                raise ValueError("row boundaries lost")
        except (ValueError, TypeError):  # a damaged row: parse row by row, so the error is about that row
            decoded = [None] * len(rows)
        requests: dict[str, LeaseRequest] = {}
        leases = []
        for r, d in zip(rows, decoded, strict=True):
            try:
                leases.append(from_row(r, d, requests))
            except (ValueError, TypeError, KeyError) as e:
                raise _damaged(self.path, f"the row of lease {r[0]!r} cannot be read ({e})") from e
        return leases

    def get(self, lease_id: str) -> Lease | None:
        r = self.reading().execute(f"SELECT {COLUMNS} FROM leases WHERE id=?", (lease_id,)).fetchone()
        return from_row(r) if r else None

    def recent(self, user: str | None, limit: int = 50) -> list[Lease]:
        db = self.reading()
        if user is None:
            rows = db.execute(f"SELECT {COLUMNS} FROM leases ORDER BY seq DESC LIMIT ?", (limit,))
        else:
            rows = db.execute(
                f"SELECT {COLUMNS} FROM leases WHERE user=? ORDER BY seq DESC LIMIT ?", (user, limit)
            )
        return [from_row(r) for r in rows]

    def history(self, lease_id: str) -> list[dict[str, Any]]:
        rows = self.reading().execute(
            "SELECT from_state, to_state, reason, at FROM transitions WHERE lease_id=? ORDER BY id", (lease_id,)
        )
        return [{"from": r[0], "to": r[1], "reason": r[2], "at": r[3]} for r in rows]

    def drain(self, gpu_ids: list[str], lease_id: str, pids: list[int], since: float) -> None:
        with self.batched() as db:
            db.executemany(
                "REPLACE INTO drains VALUES (?,?,?,?)", [(g, lease_id, since, json.dumps(pids)) for g in gpu_ids]
            )

    def drained(self, gpu_id: str) -> None:
        with self.batched() as db:
            db.execute("DELETE FROM drains WHERE gpu_id=?", (gpu_id,))

    def drains(self) -> dict[str, tuple[str, float, list[int]]]:
        return {
            g: (lease, since, json.loads(pids))
            for g, lease, since, pids in self.db.execute("SELECT gpu_id, lease_id, since, pids FROM drains")
        }

    # --- tokens ------------------------------------------------------------------------------
    def add_token(self, token_hash: str, user: str, admin: bool, at: float, note: str = "") -> None:
        with self.transaction() as db:
            db.execute("INSERT INTO tokens VALUES (?,?,?,?,?)", (token_hash, user, int(admin), at, note))

    def token_user(self, token_hash: str) -> tuple[str, bool] | None:
        r = self.db.execute("SELECT user, admin FROM tokens WHERE hash=?", (token_hash,)).fetchone()
        return (r[0], bool(r[1])) if r else None

    def revoke_tokens(self, user: str) -> int:
        with self.transaction() as db:
            return db.execute("DELETE FROM tokens WHERE user=?", (user,)).rowcount

    def close(self) -> None:
        if self.journal is not None:  # what a group commit holds is stored before closing
            self.journal.before_transaction()
        if self._checkpointer is not None:
            self._checkpointer.stop()
        self.db.close()


class _Tx:
    def __init__(self, store: Store) -> None:
        self.store = store
        self.db = store.db

    def __enter__(self) -> sqlite3.Connection:
        if self.store.journal is not None:
            self.store.journal.before_transaction()
        with self.store.unwritable_as_store_error():
            self.db.execute("BEGIN IMMEDIATE")
        return self.db

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            try:
                self.db.execute("COMMIT")
                return
            except sqlite3.Error as e:
                if self.db.in_transaction:  # SQLite already rolled back on SQLITE_FULL/IOERR
                    self.db.execute("ROLLBACK")
                raise self.store.unwritable(e) from e
        if self.db.in_transaction:
            self.db.execute("ROLLBACK")
        if isinstance(exc, sqlite3.Error):
            raise self.store.unwritable(exc) from exc
