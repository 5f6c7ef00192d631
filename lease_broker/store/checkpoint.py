"""The store's background WAL checkpoints (see ``Checkpointer``)."""

from __future__ import annotations

import logging
import os
import sqlite3
import threading

log = logging.getLogger("lease_broker")


class Checkpointer(threading.Thread):
    """Copies the write-ahead log into the database in the background (SQLite's automatic checkpoint would do it
    inside whichever transaction crosses 1,000 pages, with an fsync: a request would wait ~10 ms for it).
    PASSIVE never blocks the broker's connection; without it the WAL would grow for ever.

    SQLite reuses its WAL file from the start once everything in it is copied, but never makes it smaller: after a
    burst (one user queued 20,000 requests in 10 s: 154 MB) the file would keep its largest size for good. So when
    the file is over ``WAL_LIMIT`` and two rounds in a row found everything copied and nothing written in between
    (the burst is over, the store quiet), a TRUNCATE round empties it. Truncating a large file takes tens of
    milliseconds (30 ms for 33 MB here) during which a write would wait: hence only when nobody writes, never in the
    broker's own transactions (``journal_size_limit`` would truncate inside one) and never at every round."""

    INTERVAL = 1.0
    WAL_LIMIT = 4 << 20  # bytes: SQLite's own checkpoint threshold (1,000 pages of 4 KiB) is about this

    def __init__(self, path: str) -> None:
        super().__init__(name="store-checkpoint", daemon=True)
        self.path = path
        self._stop_event = threading.Event()
        self._settled: int | None = None  # frames in the WAL at the last round that found all of them copied
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
                    self.checkpoint(db)
                except sqlite3.Error as e:  # the next round tries again; the WAL keeps every change meanwhile
                    log.warning("Store checkpoint failed: %s", e)
            db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        except sqlite3.Error:
            pass
        finally:
            db.close()

    def checkpoint(self, db: sqlite3.Connection) -> None:
        """One round: copy what the WAL holds; empty the file if it is over ``WAL_LIMIT`` and the store is quiet."""
        busy, frames, copied = db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        settled = frames if not busy and frames == copied else None
        quiet = settled is not None and settled == self._settled  # (no commit since the last round: same frames)
        self._settled = settled
        if not quiet:
            return  # (still written: the file is reused from its start, not grown, once a round catches up)
        try:
            size = os.path.getsize(self.path + "-wal")
        except OSError:
            return
        if size > self.WAL_LIMIT and not db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]:
            log.info("Store %s: write-ahead log emptied after a burst (it had grown to %.1f MB)", self.path, size / 1e6)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=10)
