"""Bringing an older lease store up to this broker's schema: additive changes only, in one transaction."""

from __future__ import annotations

import logging
import sqlite3

log = logging.getLogger("lease_broker")


def upgrade(db: sqlite3.Connection, version: int, target: int) -> None:
    """Bring a store of schema ``version`` up to ``target``, additively, in one transaction (an older broker's
    leases stay as they were; their new columns have their defaults)."""
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
        db.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(target),))
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise
