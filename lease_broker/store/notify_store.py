"""SQL of notifications: each user's choice of events, and the outbox of messages to deliver.

Outbox writes share the event loop iteration's group commit (``Store.batched``): the notifier writes from its
own task, and a transaction of its own would commit a request's group before the request's scheduling pass.

The outbox is what makes delivery survive a restart without sending anything twice: a message is stored (its
key is unique per channel) before the first attempt, marked sent after the receiver accepted it, and a
restarted broker resumes the messages still pending.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .lease_store import Store

_SCHEMA = """
CREATE TABLE IF NOT EXISTS notify_prefs (user TEXT PRIMARY KEY, events TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS notify_outbox (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    key TEXT NOT NULL,
    channel TEXT NOT NULL,
    target TEXT NOT NULL,
    user TEXT NOT NULL,
    body TEXT NOT NULL,
    state TEXT NOT NULL DEFAULT 'pending',
    attempts INTEGER NOT NULL DEFAULT 0,
    next_at REAL NOT NULL,
    created_at REAL NOT NULL,
    UNIQUE (key, channel, target)
);
CREATE INDEX IF NOT EXISTS notify_pending ON notify_outbox(next_at) WHERE state = 'pending';
"""


@dataclass
class Outgoing:
    id: int
    key: str
    channel: str  # "webhook" or "email"
    target: str  # the URL or the address
    user: str
    body: dict[str, Any]
    attempts: int


class NotifyStore:
    def __init__(self, store: Store) -> None:
        self.store = store
        store.add_tables(_SCHEMA)

    def prefs(self, user: str) -> list[str] | None:
        r = self.store.db.execute("SELECT events FROM notify_prefs WHERE user=?", (user,)).fetchone()
        return list(json.loads(r[0])) if r else None

    def set_prefs(self, user: str, events: list[str]) -> None:
        with self.store.batched() as db:
            db.execute("REPLACE INTO notify_prefs VALUES (?,?)", (user, json.dumps(events)))

    def enqueue(self, rows: list[tuple[str, str, str, str, dict[str, Any]]], at: float) -> int:
        """Store (key, channel, target, user, body) messages to send; one already stored is left alone (the
        same event seen again after a restart). Returns how many are new."""
        with self.store.batched() as db:
            before = db.total_changes
            db.executemany(
                "INSERT OR IGNORE INTO notify_outbox (key, channel, target, user, body, next_at, created_at) "
                "VALUES (?,?,?,?,?,?,?)",
                [(k, c, t, u, json.dumps(b), at, at) for k, c, t, u, b in rows])
            return db.total_changes - before

    def due(self, now: float, limit: int) -> list[Outgoing]:
        rows = self.store.db.execute(
            "SELECT id, key, channel, target, user, body, attempts FROM notify_outbox "
            "WHERE state='pending' AND next_at <= ? ORDER BY next_at, id LIMIT ?", (now, limit))
        return [Outgoing(r[0], r[1], r[2], r[3], r[4], json.loads(r[5]), r[6]) for r in rows]

    def next_due(self) -> float | None:
        r = self.store.db.execute("SELECT MIN(next_at) FROM notify_outbox WHERE state='pending'").fetchone()
        return None if r[0] is None else float(r[0])

    def sent(self, msg_id: int) -> None:
        with self.store.batched() as db:
            db.execute("UPDATE notify_outbox SET state='sent', attempts=attempts+1 WHERE id=?", (msg_id,))

    def retry(self, msg_id: int, at: float) -> None:
        with self.store.batched() as db:
            db.execute("UPDATE notify_outbox SET attempts=attempts+1, next_at=? WHERE id=?", (at, msg_id))

    def failed(self, msg_id: int) -> None:
        with self.store.batched() as db:
            db.execute("UPDATE notify_outbox SET state='failed', attempts=attempts+1 WHERE id=?", (msg_id,))

    def counts(self) -> dict[str, int]:
        return dict(self.store.db.execute("SELECT state, COUNT(*) FROM notify_outbox GROUP BY state").fetchall())
