"""Who holds which GPU, kept current as leases change: the scheduler's input without a pass over every lease.

A scheduling pass runs on every request, release and tick. Rebuilding its view of the GPUs from every live
lease made a grant cost O(leases + GPUs); the table instead updates only the GPUs of a lease that changed
(``sync``, called by the lease owner's one mutation path, ``LeaseManager.commit``), and a pass works on a fork of
its ``SlotIndex``. ``verify`` recomputes everything from the inventory and the live leases and says what differs:
the tests of that path (the stateful scheduler test, after every step) check it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import NamedTuple

from .fairshare import RunningUsage
from .gpu import GPU
from .gpufit import Kind, device_kinds
from .lease import HOLDING, Lease, LeaseState
from .slots import Slot, SlotIndex


class _Held(NamedTuple):
    devices: tuple[str, ...]
    gpus: float
    user: str
    granted_at: float | None
    expires_at: float | None  # (its GPUs' ``free_at``: ``sync`` rebuilds their slots when it changes)


class GpuTable:
    def __init__(self, gpus: Iterable[GPU], leases: Iterable[Lease] = ()) -> None:
        self.set_gpus(gpus, leases)

    def set_gpus(self, gpus: Iterable[GPU], leases: Iterable[Lease]) -> None:
        """A new inventory (an engine's node joined or left): start over from these GPUs and live leases."""
        gpus = list(gpus)
        self._static = {g.id: Slot(id=g.id, node=g.node, index=g.index, link_group=g.link_group,
                                   memory_total=g.memory_total, name=g.name, mig=g.mig) for g in gpus}
        self.kinds: dict[Kind, dict[str, int]] = device_kinds(gpus)  # what requests of a type or size can get
        per_node: dict[str, int] = {}
        for g in self._static.values():
            per_node[g.node] = per_node.get(g.node, 0) + 1
        self.biggest_node = max(per_node.values(), default=0)
        self.largest_memory = max((s.memory_total for s in self._static.values()), default=0)
        self.rebuild(leases)

    def rebuild(self, leases: Iterable[Lease]) -> None:
        """Start over from these leases (the live ones)."""
        self.holders: dict[str, dict[str, Lease]] = {gid: {} for gid in self._static}  # GPU -> holding leases
        self.queued: dict[str, Lease] = {}
        self.holding_by_user: dict[str, dict[str, Lease]] = {}
        self.held_by_user: dict[str, float] = {}
        self.growable: dict[str, Lease] = {}  # holding incremental leases below their max_gpus that asked to grow
        self.busy: dict[str, str] = {}  # GPU -> "leased" or "shared" (held by at least one lease)
        self.n_busy = {"leased": 0, "shared": 0}
        self._held: dict[str, _Held] = {}
        # leases that stopped holding, until take_left(): (user, gpus, granted_at, ended_at)
        self._left: list[tuple[str, float, float | None, float | None]] = getattr(self, "_left", [])
        previous = getattr(self, "running", None)
        self.running = RunningUsage(previous.half_life if previous is not None else 0.0)
        for lease in leases:
            self._register(lease)
        self.base = SlotIndex([self._slot(gid) for gid in self._static])

    def sync(self, lease: Lease) -> None:
        """Make the table agree with this lease's state, devices, time limit and request.

        An exclusive lease that holds the same GPUs as before, granted and limited as before (granted -> active ->
        idle and back: most of its changes), leaves its GPUs' slots as they were: they are not rebuilt (it is
        their only holder, so the order of their holders, which ``_register`` changes, cannot show in them). On
        the overloaded month replay's 8,000-job version (benchmarks/replay_month.py) its 37,563 calls took 0.84 s
        of CPU, 0.59 s with this (15.7 us a call)."""
        held = self._held.get(lease.id)
        touched = self._unregister(lease.id)
        touched.update(self._register(lease))
        if held is not None and lease.id not in self._held:  # (a suspended lease held its GPUs until suspended)
            s = lease.suspension
            end = lease.ended_at if lease.ended_at is not None or s is None or not s.suspended else s.since
            self._left.append((held.user, held.gpus, held.granted_at, end))
        elif held is not None and self._held[lease.id] == held and not lease.request.shared:
            return
        for gid in touched:
            self._refresh(gid)

    # ------------------------------------------------------------------ queries
    def running_usage(self, users: Iterable[str], now: float, half_life: float) -> dict[str, float]:
        """Decayed GPU-seconds of the leases these users hold now (fair share's running part)."""
        r = self.running
        if r.half_life != half_life or r.needs_rebase(now):
            r.rebuild(half_life, ((h.user, h.gpus, h.granted_at) for h in self._held.values()), now)
        return {u: r.usage(u, now) for u in users if u in r.gpus}

    def take_left(self) -> list[tuple[str, float, float | None, float | None]]:
        """(user, gpus, granted_at, ended_at) of the leases that stopped holding GPUs since the last call (fair
        share moves their usage to history, without reading them back from the store)."""
        left, self._left = self._left, []
        return left

    def slot_index(self, draining: Iterable[str], unhealthy: Iterable[str], drain_free_at: float) -> SlotIndex:
        """A fork of the index for one pass: draining GPUs free at ``drain_free_at``, unhealthy ones never."""
        ix = self.base.fork()
        for gids, free_at in ((draining, drain_free_at), (unhealthy, float("inf"))):
            for gid in gids:
                if gid in ix.by_id:
                    s = ix.edit(gid)
                    if s.idle:
                        ix.note_idle(s.node, -1)
                    s.available = False
                    s.free_at = max(s.free_at, free_at)
        return ix

    def free_by_node(self) -> dict[str, int]:
        """Node -> how many of its GPUs no lease holds (nodes with none left out): the index's idle counts, which
        ``sync`` keeps (no GPU of the table's own index is unavailable: draining and unhealthy ones are the
        caller's). The enforcer's pressure (``pressure_now``, every tick and every request that queues) reads this
        instead of testing every GPU: 7.4 -> 5.4 us a call on 8x8 (the 3,000-job version of the overloaded month
        replay, benchmarks/replay_month.py, after 6,000 events; the best of 7 runs)."""
        return {node: n for node, n in self.base.idle.items() if n}

    def counts(self, draining: Mapping[str, object], unhealthy: Mapping[str, object]) -> dict[str, int]:
        """GPUs by state: unhealthy, shared, leased, draining, free (in that precedence)."""
        counts = dict(self.n_busy)
        for gid in {*draining, *unhealthy}:
            if gid not in self._static:
                continue
            now = "unhealthy" if gid in unhealthy else self.busy.get(gid, "draining")
            was = self.busy.get(gid)
            if now != was:
                counts[now] = counts.get(now, 0) + 1
                if was is not None:
                    counts[was] -= 1
        counts["free"] = len(self._static) - sum(counts.values())
        return {k: v for k, v in counts.items() if v}

    # ------------------------------------------------------------------ bookkeeping
    def _register(self, lease: Lease) -> list[str]:
        if lease.state == LeaseState.QUEUED:
            self.queued[lease.id] = lease
            return []
        if lease.state not in HOLDING:
            return []
        # this runs for every live lease at a restart: plain tuples and local names (a third faster)
        static, lid, user, devices = self._static, lease.id, lease.user, lease.devices
        mine = tuple(devices) if len(devices) == 1 and devices[0] in static else tuple(
            d for d in devices if d in static)
        gpus = lease.gpu_count
        self._held[lid] = tuple.__new__(_Held, (mine, gpus, user, lease.granted_at, lease.expires_at))
        holders = self.holders
        for d in mine:
            holders[d][lid] = lease
        self.holding_by_user.setdefault(user, {})[lid] = lease
        self.held_by_user[user] = self.held_by_user.get(user, 0.0) + gpus
        self.running.add(user, gpus, lease.granted_at)
        req = lease.request
        if req.grow and devices and len(devices) < req.max_gpus and not req.shared:
            self.growable[lid] = lease
        return list(mine)

    def _unregister(self, lease_id: str) -> set[str]:
        self.queued.pop(lease_id, None)
        held = self._held.pop(lease_id, None)
        if held is None:
            return set()
        for d in held.devices:
            self.holders[d].pop(lease_id, None)
        self.running.add(held.user, held.gpus, held.granted_at, sign=-1)
        mine = self.holding_by_user.get(held.user, {})
        mine.pop(lease_id, None)
        if mine:
            self.held_by_user[held.user] -= held.gpus
        else:  # exact zero, whatever the fractions added up to
            self.holding_by_user.pop(held.user, None)
            self.held_by_user.pop(held.user, None)
        self.growable.pop(lease_id, None)
        return set(held.devices)

    def _refresh(self, gid: str) -> None:
        self.base.put(self._slot(gid))

    def _slot(self, gid: str) -> Slot:
        """The GPU's slot from its holders (and its entry in ``busy``)."""
        holders = self.holders[gid]
        was = self.busy.pop(gid, None)
        if was is not None:
            self.n_busy[was] -= 1
        if not holders:
            return self._static[gid]  # never changed in place: forks copy what they change
        s = self._static[gid].clone()
        shared = False
        for lease in holders.values():
            req = lease.request
            s.held_by += ((lease.user, req.fraction if req.shared else 1.0),)
            if req.shared:
                shared = True
                s.shares += req.fraction
                s.n_shared += 1
                s.mem_used += req.mem_bytes or int(req.fraction * s.memory_total)
            else:
                s.exclusive = True
            s.free_at = max(s.free_at, lease.expires_at or 0.0)
        s.held_by = tuple(sorted(s.held_by))  # the same whatever order the leases came in
        now = self.busy[gid] = "shared" if shared else "leased"
        self.n_busy[now] += 1
        return s


def _rounded(s: Slot) -> tuple[object, ...]:
    return tuple(round(v, 6) if isinstance(v, float) else v for v in s.__dict__.values())
