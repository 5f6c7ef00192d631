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
        db.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(target),))
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise
