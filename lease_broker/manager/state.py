"""What the lease owner holds, for the parts of the broker to read (``LiveState``), and the narrow interface every
part is given instead of the owner (``LeaseOps``): what it may ask.

The :class:`~lease_broker.manager.manager.LeaseManager` is the only writer: it changes these through its one
mutation path (``commit``). Parts (enforcement, preemption, reservations, quotas, views) read them and ask the
owner for changes, and to publish events, through ``LeaseOps``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

from ..core.gpu import GPU, GpuSample
from ..core.gputable import GpuTable
from ..core.lease import Change, Lease, LeaseState
from ..core.lease_use import LeaseUse
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
        self.suspended: dict[str, Lease] = {}  # SUSPENDED leases (they hold no GPU), kept by the owner's commit

    def set_gpus(self, gpus: list[GPU]) -> None:
        self.gpus, self.gpu_by_id = gpus, {g.id: g for g in gpus}
        self.table.set_gpus(gpus, self.leases.values())

    def holding(self) -> Iterator[Lease]:
        """Live leases that hold GPUs (granted, active or idle), from the GPU table: O(holding), not O(queue)."""
        return (lease for by_user in self.table.holding_by_user.values() for lease in by_user.values())

    def held_by_user(self) -> dict[str, float]:
        return dict(self.table.held_by_user)


class LeaseOps(Protocol):
    def end(self, lease: Lease, target: LeaseState, reason: str) -> None:
        """End a lease (persisted and published), stop its processes and hand its GPUs on."""

    def mark_idle(self, lease: Lease) -> None:
        """A holding lease showed no activity for ``idle_mark_seconds``."""

    def activity(self, lease: Lease, now: float) -> None:
        """A holding lease did work at ``now``."""

    def used(self, lease: Lease, use: LeaseUse) -> None:
        """A holding lease's usage figures grew (kept in memory; stored with its next transition)."""

    def schedule_soon(self) -> None:
        """GPUs or policy changed: run a scheduling pass soon (once for all changes of this loop iteration)."""

    def placed(self, lease: Lease, devices: tuple[str, ...] | None) -> None:
        """An engine placed a granted lease (on ``devices`` when it chose others than the broker)."""

    def set_gpus(self, gpus: list[GPU]) -> None:
        """The inventory's GPUs changed (a node joined or left)."""

    def replan(self) -> None:
        """The policy or the reservations changed: the next pass (soon) is a full one over the whole queue."""

    def gpus_changed(self) -> None:
        """The GPUs' states changed: publish the GPU summary (throttled)."""

    def publish(self, kind: str, /, **fields: Any) -> None:
        """Publish an event once what memory holds now is stored (the group commit's ``after``): no part publishes
        a change that a failed commit then undoes."""

    def commit(self, lease: Lease, change: Change) -> None:
        """Change a fact of a lease (its state, times, warnings, preemption): the one mutation path."""

    def ask_suspend(self, lease: Lease, why: str, *, by: Lease | None = None, resume: bool = False,
                    deadline: float | None = None) -> bool:
        """Ask a holding, suspendable lease's holder to suspend its processes (``Suspension``: ``why`` idle,
        pressure, expired, preempted (``by``: the request that takes its GPUs), user or admin; ``resume``: it wants
        its GPUs back as soon as they are free). The holder reports (``suspended``) within
        ``suspend_report_seconds`` (or by ``deadline``, when sooner: a time limit), else the broker does what it would have done (``Enforcer.fall_back``). Returns
        whether the lease is asked now (False: it is not suspendable, not holding, or asked already)."""
