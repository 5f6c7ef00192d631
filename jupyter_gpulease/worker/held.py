"""What a waiting worker holds for its next job, faulted in while it waits: memory for the job's large inputs
and a free block in its heap for the large values the cell makes (both ``wire.fastpath``). Both go back as soon
as the host runs short of memory.

Imported by every worker start: ``fastpath`` is imported only once there is something to hold.
"""

from __future__ import annotations

from _queue import Empty

TYPE_CHECKING = False
if TYPE_CHECKING:
    from _queue import SimpleQueue
    from collections.abc import Callable
    from typing import Any


class Held:
    CHECK_SECONDS = 1.0

    def __init__(self) -> None:
        self.inputs: Any = None  # fastpath.Prefaulted: the next inputs are copied into it
        self.heap: Any = None  # fastpath.HeapBlock: the cell's own allocations land in it

    def make(self, nbytes: int, heap_bytes: int = 0, busy: Callable[[], bool] | None = None) -> None:
        """Hold ``nbytes`` for the next inputs and a heap block of ``heap_bytes`` for the next results (0: none, and
        what the heap holds free goes back). ``busy()``: a job came meanwhile (the heap block is then not made)."""
        from ..wire import fastpath

        if self.inputs is None or self.inputs.nbytes != nbytes or self.inputs.spent():
            self.drop_inputs()
            self.inputs = fastpath.prefault(nbytes)
        old = self.heap
        if heap_bytes <= 0:
            self.drop_heap()
        elif old is None or old.nbytes < heap_bytes or old.used:
            self.heap = fastpath.make_heap_block(heap_bytes, busy)  # reuses what is free of the old block (faulted in already)
            if old is not None:
                old.release_guard()

    def wait(self, jobs: SimpleQueue[Any]) -> Any:
        """The next message from the kernel; meanwhile, what is held goes back if the host runs short of memory."""
        while self.inputs is not None or self.heap is not None:
            try:
                return jobs.get(timeout=self.CHECK_SECONDS)
            except Empty:
                from ..wire import fastpath

                if fastpath.short_of_memory():
                    self.drop_inputs()
                    self.drop_heap()
        return jobs.get()

    def after_job(self) -> None:
        if self.inputs is not None and self.inputs.spent():
            self.inputs = None
        if self.heap is not None:
            self.heap.used = True  # the cell had it: what is left of it is malloc's, like any free memory

    def drop_inputs(self) -> None:
        if self.inputs is not None:
            self.inputs.close()
            self.inputs = None

    def drop_heap(self) -> None:
        if self.heap is not None:
            self.heap.give_back()
            self.heap.release_guard()
            self.heap = None
