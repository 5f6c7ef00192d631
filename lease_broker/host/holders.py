"""Watching the processes that hold leases, so that a lease ends as soon as its holder does.

A kernel that asks for a lease over the Unix socket is known by its pid (SO_PEERCRED) and its start time (a
recycled pid is another process). ``HolderWatch`` opens a pidfd for each such process (Linux 5.3+): the descriptor
becomes readable when the process exits, so the event loop learns of a kernel's end at once, without polling and
without waiting for missed heartbeats. One descriptor per process, however many leases it holds.

Where a pid cannot be watched (another pid namespace reports pid 0; a kernel without pidfd), ``watch`` returns
False and the lease keeps the heartbeat timeout, as a holder on another host does.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable

from .procs import proc_info

log = logging.getLogger(__name__)

#: (pid, start ticks): one process, never a recycled pid
Holder = tuple[int, int]


class HolderWatch:
    """Calls ``on_exit(holder)`` from the event loop when a watched process exits (once per process)."""

    def __init__(self, on_exit: Callable[[Holder], None],
                 loop: Callable[[], asyncio.AbstractEventLoop | None]) -> None:
        """``loop``: the event loop the watches run on (None: none yet, nothing can be watched)."""
        self.on_exit = on_exit
        self._loop = loop
        self._fds: dict[Holder, int] = {}

    def holder_of(self, pid: int) -> Holder | None:
        """The live process ``pid`` with its start time, or None (gone, a zombie, or not visible here)."""
        if pid <= 0:
            return None
        info = proc_info(pid)
        return (pid, info.start_ticks) if info is not None else None

    def watch(self, holder: Holder) -> bool:
        """Watch ``holder``; False if it cannot be watched (no pidfd, no running loop). A holder already gone is
        reported at once (from the loop)."""
        if holder in self._fds:
            return True
        loop = self._loop()
        if loop is None or not hasattr(os, "pidfd_open"):
            return False
        pid, start = holder
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            loop.call_soon(self.on_exit, holder)
            return True
        except OSError as e:  # ENOSYS (an old kernel), EMFILE: the heartbeat stays the bound
            log.warning("Cannot watch holder process %s (%s): its leases end by the heartbeat timeout", pid, e)
            return False
        info = proc_info(pid)  # the pid now names the process the fd holds: check it is still the holder
        if info is None or info.start_ticks != start:
            os.close(fd)
            loop.call_soon(self.on_exit, holder)
            return True
        self._fds[holder] = fd
        loop.add_reader(fd, self._exited, holder)
        return True

    def unwatch(self, holder: Holder) -> None:
        """Stop watching ``holder`` (its last lease ended)."""
        fd = self._fds.pop(holder, None)
        if fd is not None:
            loop = self._loop()
            if loop is not None:
                loop.remove_reader(fd)
            os.close(fd)

    def watching(self, holder: Holder) -> bool:
        """Whether ``holder`` is watched now (its exit will be reported)."""
        return holder in self._fds

    def watched(self) -> list[Holder]:
        return list(self._fds)

    def close(self) -> None:
        for holder in list(self._fds):
            self.unwatch(holder)

    def _exited(self, holder: Holder) -> None:
        self.unwatch(holder)
        self.on_exit(holder)


def alive(holder: Holder) -> bool:
    """Whether ``holder`` still runs (the same process: same pid, same start time)."""
    info = proc_info(holder[0])
    return info is not None and info.start_ticks == holder[1]
