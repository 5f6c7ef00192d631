"""What leases used and what users used.

``Metering``: what each lease used (its peak GPU memory, its mean and peak utilisation) from the inventory's
samples: at every new sample each holding lease's figures grow by what its processes (the ones attached to it
and their descendants) use on its devices, NVML's per-process figures where the sample has them, the whole
device's for a lease that holds it alone (a MIG slice: memory only). The figures reach the lease through the
owner's one mutation path (``LeaseOps.used``), without a store write; the store keeps them with the lease's next
transition. Ended leases' figures go into the histograms of the metrics.

``Accounting``: what users used: decayed past GPU-seconds for fair share (ended leases from the store, plus
running ones) and the usage report (GPU-hours held and busy, leases, revocations)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

from ..core.errors import BadRequest
from ..core.fairshare import FairShare
from ..core.gpu import GpuSample
from ..core.identity import Identity
from ..core.lease import HOLDING, Lease, LeaseState
from ..core.lease_use import LeaseUse
from ..host.procs import is_descendant
from ..policy.lease_policy import LeasePolicy
from ..store.admin_store import AdminStore
from .preemption import REASON as PREEMPTED
from .state import LiveState

#: The states in which a lease holds GPUs (charged), and the one in which it holds none (not charged).
HELD = frozenset(s.value for s in HOLDING)
SUSPENDED = LeaseState.SUSPENDED.value
#: What the usage report groups by.
REPORT_BY = ("user", "group", "label", "notebook")


class Accounting:
    def __init__(self, *, state: LiveState, policy: LeasePolicy, store: AdminStore) -> None:
        self.state, self.policy, self.store = state, policy, store
        self._fairshare = FairShare(policy.fairshare_half_life_seconds)
        self._risen: set[str] | None = None  # users whose usage may have left 0 since ``risen`` (None: anyone's)

    def risen(self, now: float) -> set[str] | None:
        """The users whose usage may have left 0 since the last call (held GPUs since: usage comes only from
        holding, and decay never makes 0 non-zero); None: anyone's may have (usage not loaded yet, or reloaded)."""
        self.fairshare(now, set())  # takes in the leases that stopped holding
        risen, self._risen = self._risen, set()
        if risen is not None:
            risen.update(self.state.table.holding_by_user)
        return risen

    def fairshare(self, now: float, users: set[str] | None = None) -> dict[str, float]:
        """Decayed past GPU-seconds per user (absent: 0); only of ``users`` when given (a pass needs those of the
        waiting requests only)."""
        fs = self._fairshare
        if fs.half_life != self.policy.fairshare_half_life_seconds:
            fs = self._fairshare = FairShare(self.policy.fairshare_half_life_seconds)
        table = self.state.table
        left = table.take_left()  # leases that stopped holding since the last call
        if self._risen is not None:
            self._risen.update(user for user, *_ in left)
        if not fs.loaded:
            self._risen = None
            holding = {lid for by_user in table.holding_by_user.values() for lid in by_user}
            ended = [(u, g, a, e) for lid, u, g, a, e, _ in self.store.held_intervals(0.0)
                     if e is not None and lid not in holding]
            fs.load(ended, now)
        else:
            fs.decay_to(now)
            for user, gpus, granted_at, ended_at in left:  # ended since the last call: to the ended total
                if granted_at is not None and ended_at is not None:
                    fs.add(user, gpus, granted_at, ended_at, now=now)
        fs.decay_to(now)
        usage = fs.of(users)
        by_user = table.holding_by_user  # (the smaller side: a pass may ask of a deep queue's users)
        for user, running in table.running_usage(
                by_user if users is None else users if len(users) < len(by_user) else by_user.keys() & users,
                now, fs.half_life).items():
            usage[user] = usage.get(user, 0.0) + running
        return usage

    def report(self, who: Identity, since: float, now: float, by: str = "user", label: str = "") -> list[dict[str, Any]]:
        """Per user (or group, label value, notebook: ``by``) since ``since``: GPU-hours held and busy (active),
        leases, revocations, preemptions, and what the leases used (the highest peak memory, the mean utilisation
        weighted by GPU-hours). A lease counts in each of its user's groups; one without the label under ''."""
        if by not in REPORT_BY:
            raise BadRequest(f"Invalid by {by!r}: use one of {', '.join(REPORT_BY)}")
        if by == "label" and not label:
            raise BadRequest("by=label needs label=KEY, the label to group by (e.g. project)")
        key_of: dict[str, Callable[[dict[str, Any]], Iterable[str]]] = {
            "user": lambda row: (row["user"],),
            "group": lambda row: self.policy.groups_of(row["user"]) or ("",),
            "label": lambda row: (row["labels"].get(label, ""),),
            "notebook": lambda row: (row["labels"].get("notebook", ""),),
        }
        out: dict[str, dict[str, Any]] = {}
        weights: dict[str, tuple[float, float]] = {}  # key -> (GPU-hours with a utilisation figure, their util sum)
        for row in self.store.usage_rows(since):
            if not who.admin and row["user"] != who.user:
                continue
            live = self.state.leases.get(row["id"])
            use = live.use if live is not None else row["use"]  # a live lease's figures are newer than its row
            end = row["ended_at"] if row["ended_at"] is not None else now
            held = row["gpus"] * max(0.0, end - max(row["granted_at"], since)) / 3600
            busy = 0.0
            trans = row["transitions"] + [("", end)]
            suspended = any(state == SUSPENDED for state, _ in trans)
            if suspended:  # held: the time in holding states only (granted_at is its last resume)
                held = 0.0
            for (state, at), (_, nxt) in zip(trans, trans[1:], strict=False):
                if state == "active":
                    busy += row["gpus"] * max(0.0, min(nxt, end) - max(at, since)) / 3600
                if suspended and state in HELD:
                    held += row["gpus"] * max(0.0, min(nxt, end) - max(at, since)) / 3600
            for key in key_of[by](row):
                u = out.setdefault(key, {"key": key, "gpu_hours_held": 0.0, "gpu_hours_busy": 0.0, "leases": 0,
                                         "revocations": 0, "preempted": 0, "peak_memory": None,
                                         "mean_utilization": None})
                if by == "user":
                    u["user"] = key
                u["gpu_hours_held"] += held
                u["gpu_hours_busy"] += busy
                u["leases"] += 1
                u["revocations"] += row["state"] == "revoked"
                u["preempted"] += row["reason"].partition(";")[0] == PREEMPTED
                if use.samples:
                    u["peak_memory"] = max(u["peak_memory"] or 0, use.peak_memory)
                if use.util_mean is not None:
                    w, total = weights.get(key, (0.0, 0.0))
                    weights[key] = (w + held, total + held * use.util_mean)
                    u["mean_utilization"] = round(weights[key][1] / weights[key][0], 2) if weights[key][0] else \
                        round(use.util_mean, 2)
        return sorted(out.values(), key=lambda u: (-u["gpu_hours_held"], u["key"]))


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
    def __init__(self, *, state: LiveState, ops: UseOps) -> None:
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
