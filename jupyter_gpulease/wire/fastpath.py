"""The optimisations of a ``%%gpu`` cell's path that are not plain code, in one place, each with the figure it buys
(BENCHMARKS.md, "%%gpu cells"; on 2026-11-27 a fresh cell added 6.10 ms median against ``%%px``'s 6.64 ms, and 1 GiB
in and out took 454 ms against Ray's 3,508 ms in the same run). What bought less than 5 % of what a user waits for
went: holding a lease's release back 30 ms after the cell's answer (an interleaved A/B gave +8.9 ms per trivial cell
without it, +9.2 ms with it) and with it the hurry of that held release by the kernel's next request; a GIL switch
interval of 0.5 ms while the kernel waits on the broker and the worker (6.36 ms against 6.27 ms without, 100
interleaved rounds, 2026-11-27).

**Memory faulted in ahead** (``Prefaulted``, ``Sizes``; buys the "1024 MiB in and out" figures: a first touch of a
gigabyte cost 170 ms to 2.3 s on a busy 2-core VM, as much as the copy itself or many times more). A process's new
memory is not there until it is first written: each page (each 2 MiB huge page) costs a page fault that finds,
zeroes and maps it, and in a virtual machine the host may have to fault it in too. So the work moves off the cell's
critical path, to where a process waits anyway:
- a warm worker, waiting for a lease, holds memory sized from the kernel's recent inputs (``INPUTS``) and its next
  inputs are copied into it, and a free block in its malloc heap for the values the cell makes (``HeapBlock``;
  buys the cell's own first touch of its result: user code 80-100 ms instead of 170-2,300 ms for 1 GiB);
- the kernel, while the worker computes, faults in a spare sized from recent results (``RESULTS``), and the result
  is copied into that.

Pages are faulted in with ``MADV_POPULATE_WRITE`` (Linux 5.14) from a few threads. It maps pages without writing to
them, so a copy may already write into memory that is still being populated (what is not faulted yet, the copy
faults itself). Where it is missing, pages are zeroed by hand, and the memory is handed out only when that is done.
Memory is faulted in only when the system keeps at least ``HEADROOM`` of its memory available afterwards, and a
waiting worker gives it back as soon as available memory falls below that (``short_of_memory``).

**Timings that keep background work off the cell's answer** (``ATTACH_AFTER``, ``AFTER_ANSWER``, ``later``,
``after_answer``): buy the "trivial cell: added time, fresh %%gpu" figure (about 3 ms of its 4 ms, measured
interleaved, and up to 5 ms per ``Thread.start`` on a busy host). Writing ``meta.json`` after the answer instead of
as the worker exits took 0.9 ms more off it (7.20 → 6.27 ms median, 100 interleaved rounds, 2026-11-27): the
reaper's ``json.dump`` held the GIL while the kernel's answer waited for it.

Both ends import this module; it must stay free of IPython imports (and of imports a cold worker start pays for).
"""

from __future__ import annotations

import threading
import time

from . import vmcopy

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from concurrent.futures import ThreadPoolExecutor
    from typing import Any

MADV_POPULATE_WRITE = 23  # linux/mman.h (Linux 5.14); Python's mmap module names it from 3.12 on
MADV_DONTNEED = 4
ALIGN = 4096  # each buffer taken from prefaulted memory starts on a page boundary
HEADROOM = 1 << 30  # ... and at least 1/8 of the host's memory stays available (whichever is more)
THREADS = 2
STEP = 32 << 20  # faulted in per call (see ``populate``)


#: seconds a job runs before its worker is attached to the lease (``cellrun.LeaseRun._attach``): a single-use worker
#: done sooner is gone before the broker could act on it, and its attach would only compete with the cell's answer
#: for the kernel and the broker (with ``end`` not waiting on the reaper: about 3 ms of a trivial cell, interleaved)
ATTACH_AFTER = 0.02
#: seconds after a cell's result before the kernel's own work for the cell: its warm worker replaced, the spare for
#: its results faulted in, its ``meta.json`` written (``after_answer``). The kernel answers the cell meanwhile, and
#: work done during the answer delays it: a process started, or Python that holds the GIL while the answer waits
#: for it (``json.dump`` with an indent is pure Python; a thread holding the GIL keeps the one that wants it back
#: waiting up to the switch interval, 5 ms)
AFTER_ANSWER = 0.05
#: the kernel's background threads (``later``): enough for a cell's reaper, the warm pool's refill and the spare at once
LATER_THREADS = 4
_pools: dict[str, ThreadPoolExecutor] = {}  # the kernel's background threads, by name, started when first needed
_pools_lock = threading.Lock()


def _pool(name: str, threads: int) -> ThreadPoolExecutor:
    with _pools_lock:
        pool = _pools.get(name)
        if pool is None:
            from concurrent.futures import ThreadPoolExecutor

            pool = _pools[name] = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)
        return pool


def later(fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn(*args)`` on one of the kernel's background threads (kernel side only), started once and idle between
    cells: ``Thread.start`` waits until the new thread has run, which took up to 5 ms on a busy host, three times a
    cell, on the cell's critical path; a task handed to an idle thread costs a queue put."""
    on_pool(_pool("gpulease-later", LATER_THREADS), fn, *args)


def after_answer(fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn(*args)`` ``AFTER_ANSWER`` seconds from now, once the kernel has answered the cell, on one background
    thread of the kernel (in the order asked: every task waits the same, so none waits for another's delay)."""
    due = time.monotonic() + AFTER_ANSWER

    def run() -> None:
        time.sleep(max(0.0, due - time.monotonic()))
        fn(*args)

    pool = _pool("gpulease-after", 1)
    try:
        pool.submit(run)
    except RuntimeError:  # the interpreter is exiting (see ``on_pool``): no answer to wait for
        fn(*args)


def on_pool(pool: ThreadPoolExecutor, fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn(*args)`` on ``pool``, or on a daemon thread of its own once the interpreter is exiting. From then on
    (``threading``'s exit hooks, before ``atexit``'s) every pool refuses new work with a ``RuntimeError``: a ``--bg``
    cell whose worker was still starting when its kernel was asked to shut down then failed in its thread and gave
    its lease back as "released" just before the kernel's own shutdown said "kernel_shutdown"
    (``test_a_bg_cell_that_starts_while_its_kernel_exits_ends_with_the_kernels_shutdown``)."""
    try:
        pool.submit(fn, *args)
    except RuntimeError:
        threading.Thread(target=fn, args=args, daemon=True).start()


_populate_works: bool | None = None

#: in this process: prefaulted blocks made, and bytes handed out of them (what ``%%gpu`` values were copied into)
stats = {"made": 0, "taken_bytes": 0}


def memory() -> tuple[int, int]:
    """``(available, total)`` bytes of this host's memory (``/proc/meminfo``); ``(0, 0)`` if unknown."""
    found: dict[str, int] = {}
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                key, _, rest = line.partition(b":")
                if key in (b"MemAvailable", b"MemTotal"):
                    found[key.decode()] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return 0, 0
    return found.get("MemAvailable", 0), found.get("MemTotal", 0)


def headroom(total: int) -> int:
    return max(HEADROOM, total // 8)


def room_for(nbytes: int) -> bool:
    """Whether ``nbytes`` more can be held and the host still keeps its headroom available."""
    available, total = memory()
    return total > 0 and available - nbytes >= headroom(total)


def short_of_memory() -> bool:
    available, total = memory()
    return total > 0 and available < headroom(total)


def _madvise(addr: int, length: int, advice: int) -> int:
    """madvise(2) through ctypes: the GIL is released while the kernel works (``mmap.madvise`` holds it)."""
    ctypes, libc, _, _, _ = vmcopy._libc()
    fn = libc.madvise
    if fn.argtypes is None:
        fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return 0 if fn(addr, length, advice) == 0 else ctypes.get_errno() or -1


def populate(addr: int, length: int) -> None:
    """Fault ``length`` bytes at ``addr`` in, for writing (a background thread's target), ``STEP`` bytes a call:
    while a call runs it holds the process's memory map lock, and an ``mmap`` or ``munmap`` of another thread of the
    process (a cell's allocation, the kernel's inline cell) waits for it, at most for one step this way."""
    for a in range(addr, addr + length, STEP):
        _madvise(a, min(STEP, addr + length - a), MADV_POPULATE_WRITE)


def _can_populate() -> bool:
    global _populate_works
    if _populate_works is None:
        probe = vmcopy.allocate(ALIGN)
        _populate_works = _madvise(vmcopy.address(probe), ALIGN, MADV_POPULATE_WRITE) == 0
        probe.close()
    return _populate_works


class Prefaulted:
    """``nbytes`` of anonymous memory (advised for huge pages), being faulted in by background threads."""

    def __init__(self, nbytes: int, threads: int = THREADS) -> None:
        self.nbytes = nbytes
        self._mem: Any = vmcopy.allocate(nbytes)
        stats["made"] += 1
        self._addr = vmcopy.address(self._mem)
        self._early = _can_populate()  # usable while being populated
        self._lock = threading.Lock()
        step = -(-nbytes // threads // ALIGN) * ALIGN
        self._workers = [threading.Thread(target=self._fault, args=(lo, min(step, nbytes - lo)), daemon=True,
                                          name="gpulease-prefault") for lo in range(0, nbytes, step)]
        for t in self._workers:
            t.start()

    def _fault(self, lo: int, n: int) -> None:
        if self._early:
            populate(self._addr + lo, n)
        else:
            ctypes = vmcopy._libc()[0]
            ctypes.memset(self._addr + lo, 0, n)  # zero pages stay zero: only the faults matter

    def spent(self) -> bool:
        """Taken (or given back): nothing left to hand out."""
        return self._mem is None

    def ready(self) -> bool:
        return not any(t.is_alive() for t in self._workers)

    def take(self, sizes: list[int]) -> list[Any] | None:
        """Page-aligned buffers of these sizes, cut from this memory (which is then used up); None when they do not
        fit (or it was given back): the caller allocates fresh memory instead."""
        need = sum(-(-n // ALIGN) * ALIGN for n in sizes)
        with self._lock:
            mem, self._mem = self._mem, None
        if mem is None:
            return None
        if need > self.nbytes:
            self._free(mem)
            return None
        if not self._early:
            for t in self._workers:
                t.join()
        view = memoryview(mem)
        stats["taken_bytes"] += sum(sizes)
        out, off = [], 0
        for n in sizes:
            out.append(view[off:off + n])
            off += -(-n // ALIGN) * ALIGN
        if self.nbytes - off >= 2 << 20:  # what is left over goes back (once it is no longer being populated)
            self._after_populate(lambda: _madvise(self._addr + off, self.nbytes - off, MADV_DONTNEED))
        return out

    def close(self) -> None:
        """Give the memory back (if it was not taken)."""
        with self._lock:
            mem, self._mem = self._mem, None
        if mem is not None:
            self._free(mem)

    def _free(self, mem: Any) -> None:
        self._after_populate(mem.close)  # unmapped under a running populate, it would only make it fail

    def _after_populate(self, then: Any) -> None:
        """``then()`` now if the memory is populated, else in the background once it is."""
        if self.ready():
            then()
            return

        def wait_then() -> None:
            for t in self._workers:
                t.join()
            then()

        threading.Thread(target=wait_then, name="gpulease-prefault-free", daemon=True).start()


def destinations(sizes: list[int], into: Prefaulted | None = None) -> list[Any]:
    """Where buffers of these sizes are copied to: cut from ``into`` when they fit, else fresh memory."""
    taken = into.take(sizes) if into is not None else None
    return taken if taken is not None else [vmcopy.allocate(n) for n in sizes]


def prefault(nbytes: int) -> Prefaulted | None:
    """``nbytes`` faulted in ahead, or None when there is nothing to fault in or no room for it."""
    if nbytes <= 0 or not vmcopy.usable() or not room_for(nbytes):
        return None
    try:
        return Prefaulted(nbytes)
    except (OSError, ValueError):
        return None


class Sizes:
    """The kernel's recent transfers one way (bytes of large buffers per cell), to size the next prefaulted memory, and
    (``prepare``) a spare of that size faulted in ahead of the next cell."""

    CHECK_SECONDS = 1.0

    def __init__(self, keep: int = 3) -> None:
        self.keep = keep
        self._recent: list[int] = []
        #: the most prefaulted memory may hold (GpuMagics.warm_memory); 0: none
        self.limit = 0
        self._spare: Prefaulted | None = None
        self._lock = threading.Lock()
        self._watching = False

    def note(self, nbytes: int) -> None:
        self._recent = (self._recent + [nbytes])[-self.keep:]

    def expected(self) -> int:
        """The most bytes one of the last few cells moved this way, or 0 (none, or more than ``limit``)."""
        n = max(self._recent, default=0)
        return n if n <= self.limit else 0

    def prepare(self, delay: float = 0.0) -> None:
        """In the background after ``delay`` seconds: a spare of the expected size for the next cell
        (``spare``), given back as soon as the host runs short of memory."""
        later(self._prepare, delay)  # a thread that is already running: starting one would hold up the cell's answer

    def _prepare(self, delay: float) -> None:
        if delay > 0:
            threading.Event().wait(delay)
        n = self.expected()
        with self._lock:
            old = self._spare
            if old is not None and old.nbytes == n and not old.spent():
                return
            self._spare = None
        if old is not None:
            old.close()
        spare = prefault(n)
        with self._lock:
            self._spare, spare = spare, self._spare
            watch = self._spare is not None and not self._watching
            self._watching = self._watching or watch
        if spare is not None:  # another prepare won the race: keep one
            spare.close()
        if watch:  # on a thread of its own: it waits as long as the spare is kept
            threading.Thread(target=self._watch, name="gpulease-prefault-watch", daemon=True).start()

    def _watch(self) -> None:
        while True:
            threading.Event().wait(self.CHECK_SECONDS)
            with self._lock:
                spare = self._spare
                if spare is None or spare.spent():
                    self._watching = False
                    return
                if not short_of_memory():
                    continue
                self._spare, self._watching = None, False
            spare.close()
            return

    def spare(self) -> Prefaulted | None:
        """The spare (taken: the next ``prepare`` makes another), or None; a spare larger than ``limit``
        now (a ``prepare`` that finished after the limit was lowered, e.g. ``warm_memory = 0``) is given back."""
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is not None and spare.nbytes > self.limit:
            spare.close()
            return None
        return spare

    def drop(self) -> None:
        spare = self.spare()
        if spare is not None:
            spare.close()


#: the kernel's recent inputs (a warm worker's prefaulted memory) and results (the kernel's spare, and the heap block a
#: warm worker makes for what the cell allocates: see ``heap``)
INPUTS, RESULTS = Sizes(), Sizes()


def hold_message() -> dict[str, Any] | None:
    """What the kernel tells a waiting worker to hold for its next job (see ``held``), or None: nothing large."""
    nbytes, heap = INPUTS.expected(), RESULTS.expected()
    return {"type": "hold", "nbytes": nbytes, "heap": heap} if nbytes or heap else None

# ---- the worker's heap block ----------------------------------------------------------------------------------
# Where a cell's own new values land: a free block in the worker's malloc heap, faulted in while it waited.
#
# ``Prefaulted`` gives a warm worker memory for the values it receives. What the cell makes itself (``y = x + 1``) is
# allocated by the cell's code through malloc, and glibc serves a large request with a fresh mapping that the cell
# then faults in page by page, on its critical path: measured on a busy 2-core VM, 90 ms a GiB at best and up to
# 2 s when the host has to reclaim or compact memory to find the pages.
#
# But malloc serves a request from its free blocks before it maps new memory. So a warm worker that expects large
# results (``RESULTS``, sized by the kernel) makes one free block of that size in malloc's main heap, where
# its main thread (the one that runs the cell) allocates:
# - it mallocs the block in pieces below malloc's mmap threshold, so that they come from the heap and lie side by
#   side, and frees all of them but the last: they merge into one free block, and the last piece, kept, stops it
#   from merging with the top of the heap, which free() would give back. malloc's settings stay as they are.
# - background threads fault the block in (``MADV_POPULATE_WRITE``), in huge pages where the system gives them
#   (``MADV_HUGEPAGE``: fewer faults, and a direct copy out of huge pages is several times faster). It is free at
#   once: a cell that comes meanwhile allocates in it while it is being populated (which never changes a page's
#   contents).
#
# ``HeapBlock.give_back`` returns it (``malloc_trim``: free heap pages go back to the system): a waiting worker does so when
# the host runs short of memory (``short_of_memory``), and a single-use worker exits after its cell anyway.
# Only with glibc and ``MADV_POPULATE_WRITE``; elsewhere no block is made.

PIECE = 120 << 10  # below glibc's smallest mmap threshold (128 KiB): every piece comes from the heap
CHECK_EVERY = 512  # pieces between two looks at whether a job came meanwhile (it goes first)
HUGE = 2 << 20
MADV_HUGEPAGE = 14
MAX_EXTRA = 1 / 8  # pieces that fill holes lower in the heap first: at most this much more than asked


def heap_slack(nbytes: int) -> int:
    """What a block holds beyond ``nbytes``: what the cell allocates before its large values is cut from it too."""
    return max(16 << 20, nbytes // 32)

#: in this process: blocks made, the bytes faulted in for them, and where the last one lies (``lo``, ``hi``)
heap_stats = {"made": 0, "bytes": 0, "lo": 0, "hi": 0}

_glibc: Any = None


def _heap_libc() -> Any:
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


class HeapBlock:
    """A free block of at least ``nbytes`` in malloc's heap, being faulted in by background threads."""

    def __init__(self, libc: Any, lo: int, hi: int, guard: int, threads: int = THREADS) -> None:
        self.libc, self.lo, self.hi, self.guard = libc, lo, hi, guard  # [lo, hi): the block (its first piece to the guard)
        self.nbytes = hi - lo
        self.used = False  # a cell has run since it was made (``held``)
        heap_stats["made"] += 1
        heap_stats["bytes"] += self.nbytes
        heap_stats["lo"], heap_stats["hi"] = lo, hi
        huge_lo, huge_hi = -(-lo // HUGE) * HUGE, hi // HUGE * HUGE
        lo, hi = lo // ALIGN * ALIGN, -(-hi // ALIGN) * ALIGN  # whole pages
        if huge_hi > huge_lo:
            _madvise(huge_lo, huge_hi - huge_lo, MADV_HUGEPAGE)
        step = -(-self.nbytes // threads // ALIGN) * ALIGN
        self._workers = [threading.Thread(target=populate, args=(a, min(step, hi - a)), daemon=True,
                                          name="gpulease-prefault-heap")
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


def make_heap_block(nbytes: int, busy: Callable[[], bool] | None = None) -> HeapBlock | None:
    """A free block of ``nbytes`` in this thread's malloc heap, being faulted in; None when there is nothing to
    make, no room for it, or no way to (not glibc, no ``MADV_POPULATE_WRITE``, the heap not contiguous), or when
    ``busy()`` turns true meanwhile (a job came: making the block would only hold it up)."""
    if nbytes <= 0 or not room_for(nbytes):
        return None
    libc = _heap_libc()
    if libc is None or not _can_populate():
        return None
    nbytes += heap_slack(nbytes)
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
    return HeapBlock(libc, run_lo, guard, guard)
