"""What each lease used: its peak GPU memory and its mean and peak utilisation, from the inventory's samples.

At every new sample each holding lease's figures grow by what its processes (the ones attached to it and their
descendants) use on its devices: NVML's per-process memory and utilisation where the sample has them; for a
lease that holds its GPUs alone, the whole device's where it has not (a MIG slice has no utilisation counter:
memory only). The figures reach the lease through the owner's one mutation path (``LeaseOps.used``), without a
store write; the store keeps them with the lease's next transition, its end at the latest. Ended leases'
figures go into the histograms of the metrics.
"""

from __future__ import annotations

from typing import Protocol

from ..core.gpu import GpuSample
from ..core.lease import HOLDING, Lease
from ..core.lease_use import LeaseUse
from ..host.procs import is_descendant
from .state import LiveState

#: Bucket bounds of the ended leases' histograms: peak memory (bytes), mean utilisation (percent).
MEMORY_BUCKETS = tuple(float(g << 30) for g in (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 128))
UTIL_BUCKETS = (5.0, 10.0, 25.0, 50.0, 75.0, 90.0, 100.0)


class UseOps(Protocol):
    """What the metering may ask of the lease owner (a part of ``LeaseOps``)."""

    def used(self, lease: Lease, use: LeaseUse) -> None:
        """A holding lease's usage figures grew (a soft change: stored with its next transition)."""


class Histogram:
    """Cumulative counts per bucket bound, a sum and a count: what Prometheus's histogram type exposes."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds, self.counts, self.sum, self.count = bounds, [0] * len(bounds), 0.0, 0

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1

    def buckets(self) -> list[tuple[float, int]]:
        """(upper bound, observations at or below it), the last bound infinite."""
        return [*zip(self.bounds, self.counts, strict=True), (float("inf"), self.count)]


def measure(lease: Lease, samples: dict[str, GpuSample]) -> tuple[int | None, float | None, str]:
    """One sample of a lease: bytes over its devices, mean percent over them (None: not measured), the source."""
    memory: int | None = None
    utils: list[float] = []
    source = "process"
    roots = list(lease.pids)
    alone = not lease.request.shared
    for gpu_id in lease.devices:
        s = samples.get(gpu_id)
        if s is None or not s.healthy:
            continue
        mine = [p for p in s.pids if any(is_descendant(p, r) for r in roots)] if roots else []
        if s.pids or s.proc_util is not None:  # the inventory accounts per process (none may run now)
            memory = (memory or 0) + sum(s.pids[p] for p in mine)
        elif alone:  # NVML lists no processes here: the whole device's memory is the lease's
            memory, source = (memory or 0) + s.memory_used, "device"
        if not s.utilization_known:
            continue
        if s.proc_util is not None:
            utils.append(min(100.0, sum(s.proc_util.get(p, 0.0) for p in mine)))
        elif alone and len(mine) == len(s.pids):  # no per-process counters: the device's, if nobody else is on it
            utils.append(s.utilization)
            source = "device"
    return memory, (sum(utils) / len(utils) if utils else None), source


class Metering:
    def __init__(self, state: LiveState, ops: UseOps) -> None:
        self.state, self.ops = state, ops
        self._last: object = None
        self._metered: dict[str, Lease] = {}  # holding leases measured, until their end is observed
        self.peak_memory = Histogram(MEMORY_BUCKETS)
        self.mean_utilization = Histogram(UTIL_BUCKETS)

    def sampled(self, samples: dict[str, GpuSample]) -> None:
        """A new sample from the inventory: every holding lease's figures, then the ended ones' into the
        histograms."""
        if samples is self._last:
            return
        self._last = samples
        for lease in self.state.holding():
            if not lease.devices:
                continue
            memory, util, source = measure(lease, samples)
            use = lease.use.add(memory, util, source)
            if use != lease.use:
                self.ops.used(lease, use)
            self._metered[lease.id] = lease
        for lease_id, lease in list(self._metered.items()):
            if lease.state not in HOLDING:
                del self._metered[lease_id]
                if lease.use.samples:
                    self.peak_memory.observe(float(lease.use.peak_memory))
                mean = lease.use.util_mean
                if mean is not None:
                    self.mean_utilization.observe(mean)
