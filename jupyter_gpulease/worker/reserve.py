"""Memory mapped and faulted in ahead of a transfer: large values are copied into pages that already exist.

A process's new memory is not there until it is first written: each page (each 2 MiB huge page) costs a page
fault that finds, zeroes and maps it, and in a virtual machine the host may have to fault it in too. For a
gigabyte that costs as much as the copy itself or (measured on a busy 2-core VM) many times more. A value
copied into a fresh worker pays it once, and its result copied back into the kernel pays it again.

So the work moves off the cell's critical path, to where a process waits anyway:
- a warm worker, waiting for a lease, holds a reserve sized from the kernel's recent inputs (``Sizes``) and its
  next inputs are copied into it;
- the kernel, while the worker computes, faults a reserve sized from recent results, and the result is copied
  into that.

Pages are faulted in with ``MADV_POPULATE_WRITE`` (Linux 5.14) from a few threads. It maps pages without
writing to them, so a copy may already write into a reserve that is still being populated (what is not faulted
yet, the copy faults itself). Where it is missing, pages are zeroed by hand, and the reserve is handed out only
when that is done.

A reserve is made only when the system keeps at least ``HEADROOM`` of its memory available afterwards, and a
waiting worker gives its reserve back as soon as available memory falls below that (``short_of_memory``).

Both ends import this module; it must stay free of IPython imports.
"""

from __future__ import annotations

import threading

from . import vmcopy

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

MADV_POPULATE_WRITE = 23  # linux/mman.h (Linux 5.14); Python's mmap module names it from 3.12 on
MADV_DONTNEED = 4
ALIGN = 4096  # each buffer taken from a reserve starts on a page boundary
HEADROOM = 1 << 30  # ... and at least 1/8 of the host's memory stays available (whichever is more)
THREADS = 2
STEP = 32 << 20  # faulted in per call (see ``populate``)

_populate_works: bool | None = None

#: in this process: reserves made, and bytes handed out of them (what ``%%gpu`` values were copied into)
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


class Reserve:
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
                                          name="gpulease-reserve") for lo in range(0, nbytes, step)]
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
        """Page-aligned buffers of these sizes, cut from the reserve (which is then used up); None when they do not
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
        """``then()`` now if the reserve is populated, else in the background once it is."""
        if self.ready():
            then()
            return

        def wait_then() -> None:
            for t in self._workers:
                t.join()
            then()

        threading.Thread(target=wait_then, name="gpulease-reserve-free", daemon=True).start()


def destinations(sizes: list[int], reserve: Reserve | None = None) -> list[Any]:
    """Where buffers of these sizes are copied to: cut from ``reserve`` when they fit, else fresh memory."""
    taken = reserve.take(sizes) if reserve is not None else None
    return taken if taken is not None else [vmcopy.allocate(n) for n in sizes]


def make(nbytes: int) -> Reserve | None:
    """A reserve of ``nbytes``, or None when there is nothing to reserve or no room for it."""
    if nbytes <= 0 or not vmcopy.usable() or not room_for(nbytes):
        return None
    try:
        return Reserve(nbytes)
    except (OSError, ValueError):
        return None


class Sizes:
    """The kernel's recent transfers one way (bytes of large buffers per cell), to size the next reserve, and
    (``prepare``) a spare reserve of that size faulted in ahead of the next cell."""

    CHECK_SECONDS = 1.0

    def __init__(self, keep: int = 3) -> None:
        self.keep = keep
        self._recent: list[int] = []
        #: the most a reserve may hold (GpuMagics.warm_memory); 0: no reserves
        self.limit = 0
        self._spare: Reserve | None = None
        self._lock = threading.Lock()
        self._watching = False

    def note(self, nbytes: int) -> None:
        self._recent = (self._recent + [nbytes])[-self.keep:]

    def expected(self) -> int:
        """The most bytes one of the last few cells moved this way, or 0 (none, or more than ``limit``)."""
        n = max(self._recent, default=0)
        return n if n <= self.limit else 0

    def prepare(self, delay: float = 0.0) -> None:
        """In the background after ``delay`` seconds: a spare reserve of the expected size for the next cell
        (``spare``), given back as soon as the host runs short of memory."""
        from .later import later  # kernel side only

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
        spare = make(n)
        with self._lock:
            self._spare, spare = spare, self._spare
            watch = self._spare is not None and not self._watching
            self._watching = self._watching or watch
        if spare is not None:  # another prepare won the race: keep one
            spare.close()
        if watch:  # on a thread of its own: it waits as long as the spare is kept
            threading.Thread(target=self._watch, name="gpulease-reserve-watch", daemon=True).start()

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

    def spare(self) -> Reserve | None:
        """The spare reserve (taken: the next ``prepare`` makes another), or None; a spare larger than ``limit``
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


#: the kernel's recent inputs (a warm worker's reserve) and results (the kernel's spare reserve, and the heap block a
#: warm worker makes for what the cell allocates: see ``heap``)
INPUTS, RESULTS = Sizes(), Sizes()


def hold_message() -> dict[str, Any] | None:
    """What the kernel tells a waiting worker to hold for its next job (see ``held``), or None: nothing large."""
    nbytes, heap = INPUTS.expected(), RESULTS.expected()
    return {"type": "reserve", "nbytes": nbytes, "heap": heap} if nbytes or heap else None
