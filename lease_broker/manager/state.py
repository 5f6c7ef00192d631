"""What the lease owner holds, for the parts of the broker to read.

The :class:`~lease_broker.manager.manager.LeaseManager` is the only writer: it changes these through its one
mutation path (``commit``). Parts (enforcement, preemption, reservations, quotas, views) read them and ask the
owner for changes through :class:`~lease_broker.manager.ports.LeaseOps`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from ..core.gpu import GPU, GpuSample
from ..core.gputable import GpuTable
from ..core.lease import Lease
from ..core.queue import Queue


class LiveState:
    def __init__(self, gpus: list[GPU], ranks: Callable[[], Mapping[str, int]]) -> None:
        self.leases: dict[str, Lease] = {}  # every non-terminal lease
        self.gpus: list[GPU] = gpus
        self.gpu_by_id: dict[str, GPU] = {g.id: g for g in gpus}
        self.table = GpuTable(gpus)  # kept current by every change of a lease (the owner's commit)
        self.samples: dict[str, GpuSample] = {}  # the inventory's latest sample, by GPU id
        self.queue = Queue(ranks)  # queued requests in scheduling order
        self.planned: dict[str, float] = {}  # queued lease id -> planned start (the latest pass's estimate)
        self.waiting: dict[str, str] = {}  # queued lease id -> why it waits (the latest pass that looked at it)

    def set_gpus(self, gpus: list[GPU]) -> None:
        self.gpus, self.gpu_by_id = gpus, {g.id: g for g in gpus}
        self.table.set_gpus(gpus, self.leases.values())

    @property
    def order(self) -> list[str]:
        """Queued lease ids in scheduling order (a copy: O(queue))."""
        return [p.lease_id for p in self.queue]

    def holding(self) -> Iterator[Lease]:
        """Live leases that hold GPUs (granted, active or idle), from the GPU table: O(holding), not O(queue)."""
        return (lease for by_user in self.table.holding_by_user.values() for lease in by_user.values())

    def held_by_user(self) -> dict[str, float]:
        return dict(self.table.held_by_user)
