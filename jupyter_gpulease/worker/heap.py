"""Where a cell's own new values land: a free block in the worker's malloc heap, faulted in while it waited.

``reserve`` gives a warm worker memory for the values it receives. What the cell makes itself (``y = x + 1``) is
allocated by the cell's code through malloc, and glibc serves a large request with a fresh mapping that the cell
then faults in page by page, on its critical path: measured on a busy 2-core VM, 90 ms a GiB at best and up to
2 s when the host has to reclaim or compact memory to find the pages.

But malloc serves a request from its free blocks before it maps new memory. So a warm worker that expects large
results (``reserve.RESULTS``, sized by the kernel) makes one free block of that size in malloc's main heap, where
its main thread (the one that runs the cell) allocates:
- it mallocs the block in pieces below malloc's mmap threshold, so that they come from the heap and lie side by
  side, and frees all of them but the last: they merge into one free block, and the last piece, kept, stops it
  from merging with the top of the heap, which free() would give back. malloc's settings stay as they are.
- background threads fault the block in (``MADV_POPULATE_WRITE``), in huge pages where the system gives them
  (``MADV_HUGEPAGE``: fewer faults, and a direct copy out of huge pages is several times faster). It is free at
  once: a cell that comes meanwhile allocates in it while it is being populated (which never changes a page's
  contents).

``give_back`` returns it (``malloc_trim``: free heap pages go back to the system): a waiting worker does so when
the host runs short of memory (``reserve.short_of_memory``), and a single-use worker exits after its cell anyway.
Only with glibc and ``MADV_POPULATE_WRITE``; elsewhere no block is made.
"""

from __future__ import annotations

import threading

from . import reserve, vmcopy

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

PIECE = 120 << 10  # below glibc's smallest mmap threshold (128 KiB): every piece comes from the heap
CHECK_EVERY = 512  # pieces between two looks at whether a job came meanwhile (it goes first)
HUGE = 2 << 20
MADV_HUGEPAGE = 14
MAX_EXTRA = 1 / 8  # pieces that fill holes lower in the heap first: at most this much more than asked


def slack(nbytes: int) -> int:
    """What a block holds beyond ``nbytes``: what the cell allocates before its large values is cut from it too."""
    return max(16 << 20, nbytes // 32)

#: in this process: blocks made, the bytes faulted in for them, and where the last one lies (``lo``, ``hi``)
stats = {"made": 0, "bytes": 0, "lo": 0, "hi": 0}

_glibc: Any = None


def _lib() -> Any:
    """libc with malloc, free and malloc_trim typed, or None when this is not glibc."""
    global _glibc
    if _glibc is None:
        ctypes, libc, _, _, _ = vmcopy._libc()
        if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "malloc_trim"):
            _glibc = False
        else:
            libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
            libc.free.restype, libc.free.argtypes = None, [ctypes.c_void_p]
            libc.malloc_trim.restype, libc.malloc_trim.argtypes = ctypes.c_int, [ctypes.c_size_t]
            _glibc = libc
    return _glibc or None


class Block:
    """A free block of at least ``nbytes`` in malloc's heap, being faulted in by background threads."""

    def __init__(self, libc: Any, lo: int, hi: int, guard: int, threads: int = reserve.THREADS) -> None:
        self.libc, self.lo, self.hi, self.guard = libc, lo, hi, guard  # [lo, hi): the block (its first piece to the guard)
        self.nbytes = hi - lo
        self.used = False  # a cell has run since it was made (``held``)
        stats["made"] += 1
        stats["bytes"] += self.nbytes
        stats["lo"], stats["hi"] = lo, hi
        huge_lo, huge_hi = -(-lo // HUGE) * HUGE, hi // HUGE * HUGE
        lo, hi = lo // reserve.ALIGN * reserve.ALIGN, -(-hi // reserve.ALIGN) * reserve.ALIGN  # whole pages
        if huge_hi > huge_lo:
            reserve._madvise(huge_lo, huge_hi - huge_lo, MADV_HUGEPAGE)
        step = -(-self.nbytes // threads // reserve.ALIGN) * reserve.ALIGN
        self._workers = [threading.Thread(target=reserve.populate, args=(a, min(step, hi - a)), daemon=True,
                                          name="gpulease-heap")
                         for a in range(lo, hi, step)]
        for t in self._workers:
            t.start()

    def ready(self) -> bool:
        return not any(t.is_alive() for t in self._workers)

    def give_back(self) -> None:
        """Return the heap's free pages to the system (once they are no longer being faulted in)."""
        for t in self._workers:
            t.join()
        self.libc.malloc_trim(0)

    def release_guard(self) -> None:
        """Free the piece that kept the block off the top of the heap (a later block has its own)."""
        if self.guard:
            self.libc.free(self.guard)
            self.guard = 0


def make(nbytes: int, busy: Callable[[], bool] | None = None) -> Block | None:
    """A free block of ``nbytes`` in this thread's malloc heap, being faulted in; None when there is nothing to
    make, no room for it, or no way to (not glibc, no ``MADV_POPULATE_WRITE``, the heap not contiguous), or when
    ``busy()`` turns true meanwhile (a job came: making the block would only hold it up)."""
    if nbytes <= 0 or not reserve.room_for(nbytes):
        return None
    libc = _lib()
    if libc is None or not reserve._can_populate():
        return None
    nbytes += slack(nbytes)
    most = int(nbytes * (1 + MAX_EXTRA)) // PIECE + 2
    pieces = [0] * most  # allocated first: a list growing meanwhile would put its own storage between the pieces
    n = run_lo = prev = guard = 0
    try:
        while n < most:
            p = pieces[n] = libc.malloc(PIECE) or 0
            if not p:
                break
            n += 1
            if busy is not None and n % CHECK_EVERY == 0 and busy():
                break
            if not prev or not 0 < p - prev <= PIECE + 64:  # not right after the last piece: a new run starts
                run_lo = p
            prev = p
            if p - run_lo >= nbytes + PIECE:  # the run's pieces before this one hold nbytes; this one is the guard
                n -= 1
                guard = p
                break
    finally:
        for q in pieces[:n]:
            libc.free(q)
    if not guard:
        return None
    # malloc wrote a header into every piece, faulting in a small page in every 120 KiB: huge pages could not be
    # used there. malloc_trim gives the block's pages back (under malloc's lock), so that it is faulted in afresh.
    libc.malloc_trim(0)
    # what the run's pieces held is one free block now: faulted in (which never changes what a page holds, so the
    # free block's own header and the guard's, on the edges, are safe)
    return Block(libc, run_lo, guard, guard)
