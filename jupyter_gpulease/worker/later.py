"""Work the kernel does after a cell (reap its worker and release the lease, start the next warm worker, fault in
memory for the next results), on threads that are already running.

``Thread.start`` waits until the new thread has run: on a busy host that took milliseconds each, for three
threads a cell, on the cell's critical path (its answer waited). These threads are started once, stay idle
between cells, and a task handed to an idle one costs a queue put.

Kernel side only (a worker never imports it).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

#: enough for a cell's reaper, the warm pool's refill and the spare reserve at once (each waits a little first)
THREADS = 4

_pool = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="gpulease-later")


def later(fn: Callable[..., Any], *args: Any) -> Future[Any]:
    """Run ``fn(*args)`` on one of the kernel's background threads."""
    return _pool.submit(fn, *args)
