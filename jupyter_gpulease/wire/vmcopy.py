"""Copying large buffers straight from one process's memory into another's (Linux ``process_vm_readv``
and ``process_vm_writev``), for values shipped between the kernel and a worker on the same host.

Why not shared memory: /dev/shm pages are 4 KiB, so writing a gigabyte there and mapping it on the
other side costs three to four times a plain copy into fresh (transparent huge page) memory. Here
the receiving side allocates anonymous memory advised for huge pages, and the kernel copies into
it or out of it, in a few threads at once.

The kernel does every copy, in both directions: it is the worker's parent, and Linux (Yama's
``ptrace_scope=1``, the default on Ubuntu) lets a process read and write the memory of its own
descendants only. Where even that is refused (``ptrace_scope`` 2 or 3, a seccomp profile, another
OS), the caller falls back to buffer files (see ``transfer``) and stops trying.

Both ends import this module; it must stay free of IPython imports.
"""

from __future__ import annotations

import errno
import mmap
import os
import sys
import threading

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

CHUNK = 64 << 20  # one copy call per 64 MiB: big enough to be cheap, small enough to share out
MAX_THREADS = 8  # bounded by the cores: a burst of a few tens of milliseconds per gigabyte

_broken: str | None = None if sys.platform.startswith("linux") else f"not available on {sys.platform}"
_lib: Any = None


REFUSED = frozenset({errno.EPERM, errno.EACCES, errno.ENOSYS})  # not allowed here (other errors: a process gone)


def usable() -> bool:
    """Whether to try direct copies (false once one was refused: buffer files from then on)."""
    return _broken is None


def why_not() -> str | None:
    return _broken


def give_up(reason: str) -> None:
    global _broken
    _broken = reason


def _libc() -> Any:
    global _lib
    if _lib is None:
        import ctypes

        class IoVec(ctypes.Structure):
            _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

        class PyBuffer(ctypes.Structure):  # Py_buffer, from the C API
            _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.c_void_p), ("len", ctypes.c_ssize_t),
                        ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
                        ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                        ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p)]

        libc = ctypes.CDLL(None, use_errno=True)  # CDLL: the GIL is released while a copy runs
        for name in ("process_vm_readv", "process_vm_writev"):
            fn = getattr(libc, name)
            fn.restype = ctypes.c_ssize_t
            fn.argtypes = [ctypes.c_int, ctypes.POINTER(IoVec), ctypes.c_ulong, ctypes.POINTER(IoVec),
                           ctypes.c_ulong, ctypes.c_ulong]
        api = ctypes.pythonapi
        api.PyObject_GetBuffer.argtypes = [ctypes.py_object, ctypes.POINTER(PyBuffer), ctypes.c_int]
        api.PyBuffer_Release.argtypes = [ctypes.POINTER(PyBuffer)]
        _lib = (ctypes, libc, api, IoVec, PyBuffer)
    return _lib


def address(buf: Any) -> int:
    """Where ``buf``'s (contiguous) bytes are in this process; valid while the caller keeps ``buf``."""
    ctypes, _, api, _, PyBuffer = _libc()
    view = PyBuffer()
    api.PyObject_GetBuffer(buf, ctypes.byref(view), 0)  # PyBUF_SIMPLE: read-only buffers too
    try:
        return int(view.buf or 0)
    finally:
        api.PyBuffer_Release(ctypes.byref(view))


def spans(buffers: list[Any]) -> list[tuple[int, int]]:
    """``(address, nbytes)`` of each (contiguous, byte-format) buffer, as ``copy`` takes them."""
    return [(address(b), len(b)) for b in buffers]


def allocate(nbytes: int) -> Any:
    """Private anonymous memory for ``nbytes``, advised for transparent huge pages (a quarter of the
    page faults' cost of 4 KiB pages), zero-filled on first touch."""
    if nbytes == 0:
        return bytearray()
    mem = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            mem.madvise(advice)
        except OSError:
            pass
    return mem


def copy_unless_refused(pid: int, local: list[tuple[int, int]], remote: list[tuple[int, int]], write: bool) -> bool:
    """``copy``; False if this system refuses direct copies (and none is tried from then on). Other errors
    (the process is gone, a wrong address) raise: they are not a reason to stop copying."""
    try:
        copy(pid, local, remote, write)
    except OSError as e:
        if e.errno not in REFUSED:
            raise
        give_up(str(e))
        return False
    return True


def copy(pid: int, local: list[tuple[int, int]], remote: list[tuple[int, int]], write: bool) -> None:
    """Copy each ``(address, nbytes)`` span of this process to (``write``) or from the matching span of
    process ``pid``. Raises OSError (errno from the kernel) when the copy is refused or fails."""
    if len(local) != len(remote) or any(a[1] != b[1] for a, b in zip(local, remote, strict=True)):
        raise ValueError("local and remote spans differ in size")
    pieces = [(la + off, ra + off, min(CHUNK, n - off))
              for (la, n), (ra, _) in zip(local, remote, strict=True) for off in range(0, n, CHUNK)]
    if not pieces:
        return
    ctypes, libc, _, IoVec, _ = _libc()
    call = libc.process_vm_writev if write else libc.process_vm_readv
    errors: list[OSError] = []

    def run(share: list[tuple[int, int, int]]) -> None:
        try:
            for la, ra, n in share:
                done = 0
                while done < n:  # a partial copy is possible: go on from where it stopped
                    lv, rv = IoVec(la + done, n - done), IoVec(ra + done, n - done)
                    got = call(pid, ctypes.byref(lv), 1, ctypes.byref(rv), 1, 0)
                    if got <= 0:
                        err = ctypes.get_errno() if got < 0 else 0
                        raise OSError(err, f"process_vm_{'writev' if write else 'readv'} to process {pid}: "
                                           f"{os.strerror(err) if err else 'nothing copied'}")
                    done += got
        except OSError as e:
            errors.append(e)

    nthreads = max(1, min(MAX_THREADS, os.cpu_count() or 1, len(pieces)))
    shares = [pieces[i::nthreads] for i in range(nthreads)]
    threads = [threading.Thread(target=run, args=(s,), name="gpulease-copy", daemon=True) for s in shares[1:]]
    for t in threads:
        t.start()
    run(shares[0])
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
