"""One broker per store: an exclusive lock on a file beside the store, held for the broker's whole life.

Two brokers on one store would each believe they own every GPU and grant the same ones twice. Like PostgreSQL's
``postmaster.pid``, the broker takes ``<store>.lock`` (``flock``, exclusive, not waiting) before it opens the store
and writes its pid into it; a second broker finds the lock taken and refuses to start, naming the first one's pid.
The kernel drops the lock when the process ends, however it ends (a ``kill -9`` too), so a stale file never keeps a
broker out. The file is left in place when the broker stops (removing it would let a broker that opened the old file
and one that creates a new one both hold "the" lock); only its pid is cleared.
"""

from __future__ import annotations

import errno
import fcntl
import os

from gpulease_protocol.private import UnsafePathError, create_private, open_private

from ..core.errors import LeaseError


class StoreLocked(LeaseError):
    status_code = 503
    reason = "store_locked"


class StoreLock:
    """The lock of the store at ``db_path`` (``acquire`` it, ``release`` it at the end; ``:memory:`` has none)."""

    def __init__(self, db_path: str) -> None:
        self.db_path = db_path
        self.path = db_path + ".lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, or raise :class:`StoreLocked` naming the broker that holds it (or why the file is refused)."""
        if self.db_path == ":memory:" or self._fd is not None:
            return
        try:
            os.close(create_private(self.path))
        except FileExistsError:
            pass
        except OSError as e:
            raise StoreLocked(f"Cannot create the store's lock file {self.path!r}: {e.strerror}. Point "
                              "LeaseBroker.db_path (--db) at a store in a directory the broker can write") from e
        try:
            fd = open_private(self.path, os.O_RDWR)
        except UnsafePathError as e:
            raise StoreLocked(f"The store's lock file is refused: {e}") from e
        except OSError as e:
            raise StoreLocked(f"Cannot open the store's lock file {self.path!r}: {e.strerror}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _pid_in(fd)
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise StoreLocked(f"Cannot lock the store's lock file {self.path!r}: {e.strerror}") from e
            who = f"pid {holder}" if holder else "another process (its pid is not written yet)"
            raise StoreLocked(f"Another broker ({who}) is serving the lease store {self.db_path!r} (locked in "
                              f"{self.path}): stop it first, or point LeaseBroker.db_path (--db) at another store") from e
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Clear the pid and drop the lock (the file stays: see the module's docstring)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)
        finally:
            os.close(fd)  # (the lock goes with the last descriptor)


def _pid_in(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
