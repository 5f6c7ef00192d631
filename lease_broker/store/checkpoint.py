"""The store's background WAL checkpoints (see ``Checkpointer``)."""

from __future__ import annotations

import logging
import sqlite3
import threading

log = logging.getLogger("lease_broker")


class Checkpointer(threading.Thread):
    """Copies the write-ahead log into the database in the background (SQLite's automatic checkpoint would do it
    inside whichever transaction crosses 1,000 pages, with an fsync: a request would wait ~10 ms for it).
    PASSIVE never blocks the broker's connection; without it the WAL would grow for ever."""

    INTERVAL = 1.0

    def __init__(self, path: str) -> None:
        super().__init__(name="store-checkpoint", daemon=True)
        self.path = path
        self._stop_event = threading.Event()
        self.start()

    def run(self) -> None:
        try:
            db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=2.0)
        except sqlite3.Error as e:
            log.warning("Store checkpoints disabled: cannot open %s: %s", self.path, e)
            return
        try:
            while not self._stop_event.wait(self.INTERVAL):
                try:
                    db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                except sqlite3.Error as e:  # the next round tries again; the WAL keeps every change meanwhile
                    log.warning("Store checkpoint failed: %s", e)
            db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        except sqlite3.Error:
            pass
        finally:
            db.close()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=10)
