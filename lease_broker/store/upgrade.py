"""Bringing an older lease store up to this broker's schema: additive changes only, in one transaction."""

from __future__ import annotations

import logging
import sqlite3

log = logging.getLogger("lease_broker")


def upgrade(db: sqlite3.Connection, version: int, target: int, live_states: str) -> None:
    """Bring a store of schema ``version`` up to ``target``, additively, in one transaction (an older broker's
    leases stay as they were; their new columns have their defaults). ``live_states``: the live states as the partial
    index ``leases_state`` lists them ("('queued',...)"), made again when the store's lists others."""
    log.info("Lease store schema %d: upgrading to %d", version, target)
    db.execute("BEGIN IMMEDIATE")
    try:
        columns = {r[1] for r in db.execute("PRAGMA table_info(leases)")}
        if "usage" not in columns:  # 1 -> 2: what each lease used
            db.execute("ALTER TABLE leases ADD COLUMN usage TEXT NOT NULL DEFAULT ''")
        if "holder" not in columns:  # 2 -> 3: the process a lease ends with ('pid start_ticks'; '' for none)
            db.execute("ALTER TABLE leases ADD COLUMN holder TEXT NOT NULL DEFAULT ''")
        if "preempting" not in columns:  # 3 -> 4: the preemption warning on the lease (its table folded in)
            db.execute("ALTER TABLE leases ADD COLUMN preempting TEXT NOT NULL DEFAULT ''")
            if db.execute("SELECT 1 FROM sqlite_master WHERE name='preemptions'").fetchone():
                db.execute("UPDATE leases SET preempting = (SELECT json_array(by_lease, by_user, by_class, warned_at, "
                           "deadline) FROM preemptions p WHERE p.lease_id = leases.id) "
                           "WHERE id IN (SELECT lease_id FROM preemptions)")
                db.execute("DROP TABLE preemptions")
            if db.execute("SELECT 1 FROM sqlite_master WHERE name='processes'").fetchone():  # the pids column
                # carries each process's start ticks now: [[pid, start ticks], ...]
                db.execute("UPDATE leases SET pids = (SELECT json_group_array(json_array(pid, start_ticks)) "
                           "FROM processes p WHERE p.lease_id = leases.id) "
                           "WHERE id IN (SELECT lease_id FROM processes)")
                db.execute("DROP TABLE processes")
        if "suspension" not in columns:  # 4 -> 5: a suspended lease (its suspension, time suspended, count)
            db.execute("ALTER TABLE leases ADD COLUMN suspension TEXT NOT NULL DEFAULT ''")
            db.execute("ALTER TABLE leases ADD COLUMN suspended_seconds REAL NOT NULL DEFAULT 0")
            db.execute("ALTER TABLE leases ADD COLUMN suspensions INTEGER NOT NULL DEFAULT 0")
        # the partial index of live leases lists every live state (a new one: 'suspended' in 5): CREATE INDEX IF NOT
        # EXISTS keeps an older store's, so it is made again as this schema says (the store's live query names the
        # same literal states, and SQLite uses the index only when they match)
        index = db.execute("SELECT sql FROM sqlite_master WHERE type='index' AND name='leases_state'").fetchone()
        if index is None or f"WHERE state IN {live_states}" not in index[0]:
            db.execute("DROP INDEX IF EXISTS leases_state")
            db.execute(f"CREATE INDEX leases_state ON leases(state) WHERE state IN {live_states}")
        db.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(target),))
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise
