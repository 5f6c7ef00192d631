"""The scheduler: a pure function from (queue, GPUs, policy, now) to grants.

No I/O and no clock: everything it needs is passed in, so it is tested table by
table and replayed over traces with a virtual clock.

Order: priority class, then fair share (lower decayed usage per weight first),
then arrival; with ``small_first_gpus``, small requests before bigger ones of their
class until those have waited ``small_first_timeout`` (``small_first.py``). A gang is placed only where all its GPUs fit with its locality, and
never partially. Every lease has a time limit, so the scheduler can plan: the
first ``backfill_depth`` requests that cannot start now reserve the GPUs that free
up soonest, and later requests may use those GPUs only if they end before the
reservation starts (EASY backfill), so big requests are not starved by small ones.
Advance reservations (``windows``) hold their GPUs the same way; daily GPU-second
budgets and user/group caps bound what a user gets; holding incremental leases grow
last, into GPUs nobody waiting needs.

Every request a pass looks at and does not grant gets the reason it waits (``Decision.waiting``, a slug of
``pass_types.WAIT_REASONS``), from what the pass already knows of it: its caps, the idle counts, the advance
reservations and the requests blocked ahead of it (their highest class and latest arrival), so saying why costs
a pass O(1) per request it looks at.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from .gpufit import TypeRoom, constrained, fit_rule
from .pass_types import WAIT_REASONS, Decision, Grant, Growing, Pending, Reservation, SchedulerPolicy
from .reservation_windows import Window, WindowMap
from .slots import Slot, SlotIndex, pick_connected
from .small_first import small_first

__all__ = ["Slot", "SlotIndex", "Pending", "Grant", "SchedulerPolicy", "Growing", "Decision", "Reservation",
           "WAIT_REASONS", "schedule", "queue_order", "pick_connected"]

INF = math.inf


def queue_order(
    pending: Iterable[Pending], policy: SchedulerPolicy, usage: Mapping[str, float] | None = None
) -> list[Pending]:
    """Priority class (high first), then fair-share usage (low first), then arrival."""
    usage = usage or {}
    ranks = policy.priority_ranks
    return sorted(pending, key=lambda p: (-ranks.get(p.request.priority, 0), usage.get(p.user, 0.0), p.seq))


def schedule(
    pending: Iterable[Pending],
    slots: Iterable[Slot] | SlotIndex,
    held_by_user: Mapping[str, float],
    policy: SchedulerPolicy,
    now: float,
    usage: Mapping[str, float] | None = None,
    *,
    budget: Mapping[str, float] | None = None,
    reservations: Sequence[Window] = (),
    growing: Sequence[Growing] = (),
    ordered: bool = False,
    plan: Mapping[str, Reservation] | None = None,
    all_exclusive: bool = False,
    shortest: float = 0.0,
) -> Decision:
    """``usage``: fair-share usage per user (already divided by weight); ``budget``: GPU-seconds each user or
    ``"@group"`` may still be granted today (absent = unlimited); ``reservations``: advance reservations;
    ``growing``: holding incremental leases, which grow last (never into GPUs that waiting requests plan on);
    ``ordered``: ``pending`` is already in queue order (the broker's queue keeps it so); ``plan``: an earlier
    pass's reservations (``Decision.plan``), kept for the blocked requests whose GPUs still hold for them instead
    of planning them again (the event passes do; the full pass plans afresh); ``all_exclusive``: no request in
    ``pending`` is shared, so once no GPU is idle and the plan is made nothing further can start: the pass stops
    there instead of walking the rest of a deep queue; ``shortest``: no request in ``pending`` is shorter, so once
    the idle GPUs are planned for others before it could end, the pass stops there too."""
    # a fork copies only the slots the pass changes: the caller's slots and index are left untouched
    ix = slots.fork() if isinstance(slots, SlotIndex) else SlotIndex(slots).fork()
    state = _State(ix, dict(held_by_user), policy, now)
    decision = Decision()
    state.budget = dict(budget or {})
    if reservations:
        state.windows = WindowMap(ix.all(), now)
    for gpu_id, w in state.windows.place(reservations).items():
        decision.reserved[gpu_id] = w.id
    blocked = 0
    # (GPU count, locality) -> the earliest end that found no GPUs: a later request of the same shape that would
    # end no sooner cannot fit either (GPUs only get taken and reserved within a pass). Not with advance
    # reservations, whose GPUs depend on who asks.
    no_fit: dict[tuple[int, str, str, int], float] = {}
    depth, ix = policy.backfill_depth, state.ix
    # the requests this pass left waiting so far, for why later ones wait behind them: their highest priority rank
    # and, per rank, their latest arrival (a later arrival ahead of a request of its class: fair share moved it up)
    ranks, top = policy.priority_ranks, -INF
    latest: dict[int, int] = {}
    waiting, limited = decision.waiting, state.limited
    anyone_limited = bool(state.budget) or policy.capped  # else no lookup per request
    for p in small_first(pending if ordered else queue_order(pending, policy, usage), policy, now):
        if blocked >= depth and all_exclusive and now + shortest > state.idle_horizon():
            break  # nothing shared, the plan made, and nothing idle for as long as the shortest request (or nothing
            # idle at all): nobody further back can start
        req = p.request
        shared = req.shared
        if blocked >= depth and not shared and ix.idle_total < req.min_gpus:
            # the reason, inline (a deep queue passes here per request): ~0.4-0.8 us each on top of the skip
            rank, seq = ranks.get(req.priority, 0), p.seq
            waiting[p.lease_id] = (
                (anyone_limited and limited.get(p.user, True) and state.cap_reason(p, req.min_gpus))
                or ("no_gpu_type" if req.gpu_type or req.gpu_mem else _behind(rank, seq, top, latest)))
            top = rank if rank > top else top
            if latest.get(rank, -1) < seq:
                latest[rank] = seq
            continue  # no GPU for it and no plan to make: skipping keeps a pass cheap with a long queue
        end = now + p.duration
        if shared:
            grant = state.place_shared(p, end)
        elif end >= no_fit.get((req.min_gpus, req.locality, req.gpu_type, req.gpu_mem), INF) \
                or (blocked >= depth and end > state.idle_horizon()):  # (no idle GPU is free until it would end)
            grant = None
        else:
            grant = state.place_exclusive(p, end)
            if grant is None and not state.windows.of and state.within_cap(p, req.min_gpus):
                shape = (req.min_gpus, req.locality, req.gpu_type, req.gpu_mem)
                no_fit[shape] = min(no_fit.get(shape, INF), end)
        if grant is not None:
            decision.grants.append(grant)
            decision.planned_start[p.lease_id] = now
            continue
        rank, seq = ranks.get(req.priority, 0), p.seq
        waiting[p.lease_id] = state.why(p, rank, top, latest)
        top = rank if rank > top else top
        if latest.get(rank, -1) < seq:
            latest[rank] = seq
        if blocked < depth and state.within_cap(p, req.fraction if shared else req.min_gpus):
            kept = plan.get(p.lease_id) if plan else None
            r = kept if kept is not None and state.still_holds(kept) else state.reserve(p)
            if r is not None:
                state.book(r)
                decision.planned_start[p.lease_id] = r.start
                decision.plan[p.lease_id] = r
            blocked += 1
    by_id = {g.pending.lease_id: g for g in growing}
    for p in queue_order([g.pending for g in growing], policy, usage):
        g = by_id[p.lease_id]
        grant = state.grow(g)
        if grant is not None:
            decision.grown.append(grant)
    return decision


def _behind(rank: int, seq: int, top: float, latest: Mapping[int, int]) -> str:
    """Whom a request (of priority ``rank``, arrival ``seq``) waits behind, from the requests the pass left waiting
    before it (``top``: their highest rank; ``latest``: their latest arrival per rank): a higher class, users who used
    less (a later arrival of its class is ahead of it: fair share), earlier requests; none: the GPUs are busy."""
    if not latest:
        return "gpus_busy"
    if top > rank:
        return "priority"
    return "fair_share" if latest.get(rank, -1) > seq else "queue"


class _State:
    """Mutable working copy of the GPUs during one scheduling pass."""

    def __init__(self, ix: SlotIndex, held: dict[str, float], policy: SchedulerPolicy, now: float) -> None:
        self.ix = ix
        self.by_id = ix.by_id
        self.nodes = ix.nodes  # node -> its slots by index (the fork's lists: edits show in them)
        self.held = held
        self.policy = policy
        self.now = now
        self.reserved_from: dict[str, float] = {}  # slot id -> earliest reservation start
        self.busy_until: dict[str, float] = {}  # slot id -> when its reservation ends
        self.budget: dict[str, float] = {}
        self.windows = WindowMap([], now)  # advance reservations: which GPUs each one holds (set when there are)
        self._groups: dict[str, Sequence[str]] = {}
        self._cap_memo: dict[str, tuple[float, tuple[tuple[str, float], ...]]] = {}
        self._most_idle = (-1, 0)  # (idle_total, the most idle GPUs on one node) when it was counted
        self._changes = 0  # GPUs taken or booked so far in the pass
        self._node_ready: dict[str, list[tuple[float, int]]] = {}  # node -> its GPUs' ready times (``_ready_on``)
        self._booked: set[str] = set()  # nodes with GPUs this pass booked (``book``)
        self._horizon = (-1, 0.0)  # (_changes, idle_horizon()) when it was computed
        self.limited: dict[str, bool] = {}  # user -> whether any cap or budget bounds them (``cap_reason``)
        self.types = TypeRoom(policy.type_caps, policy.gpu_types)
        self._gheld: dict[str, float] | None = None  # group -> GPUs its members hold (``gheld``)

    @property
    def gheld(self) -> dict[str, float]:
        """Group -> the GPUs its members hold, counted when a cap first asks (``_charge`` keeps it): a pass with no
        cap asks nobody's groups. On the 8,000-job overloaded replay (benchmarks/replay_month.py) counting them for
        every holder at every pass made the pass's start 1.9 s of 75.7 s profiled; 0.2 s without."""
        if self._gheld is None:
            self._gheld = {}
            for user, n in self.held.items():
                for g in self.groups(user):
                    self._gheld[g] = self._gheld.get(g, 0.0) + n
        return self._gheld

    @property
    def slots(self) -> list[Slot]:
        return self.ix.all()

    @property
    def idle_count(self) -> int:
        """An upper bound of the GPUs an exclusive request can get: skips hopeless scans."""
        return self.ix.idle_total

    def take(self, s: Slot, end: float, exclusive: bool = True) -> Slot:
        """This pass's own copy of ``s``, no longer idle; exclusive ones are held until ``end``."""
        self._changes += 1
        self._node_ready.pop(s.node, None)
        c = self.ix.edit(s.id)
        if c.idle:
            self.ix.note_idle(c.node, -1)
        if exclusive:
            c.exclusive = True
            c.free_at = end
        return c

    # --- caps ------------------------------------------------------------------------------
    def groups(self, user: str) -> Sequence[str]:
        if user not in self._groups:
            self._groups[user] = self.policy.groups_of(user)
        return self._groups[user]

    def within_cap(self, p: Pending, count: float) -> bool:
        return self._cap_room(p) + 1e-9 >= count

    def _caps(self, user: str) -> tuple[float, tuple[tuple[str, float], ...]]:
        """The user's cap and their groups' caps (asked of the policy once per pass)."""
        caps = self._cap_memo.get(user)
        if caps is None:
            group_cap = self.policy.group_cap
            caps = self._cap_memo[user] = (self.policy.user_cap(user),
                                           tuple((g, group_cap(g)) for g in self.groups(user)))
        return caps

    def _cap_room(self, p: Pending) -> float:
        """How many GPUs ``p`` may still get: user and group caps, and GPU-seconds left today."""
        if not self.budget and not self.policy.capped:
            return INF
        cap, groups = self._caps(p.user)
        room = INF if cap <= 0 else cap - self.held.get(p.user, 0.0)
        left = self.budget.get(p.user)
        if left is not None:
            room = min(room, left / max(p.duration, 1e-9))
        for g, gcap in groups:
            if gcap > 0:
                room = min(room, gcap - self.gheld.get(g, 0.0))
            left = self.budget.get("@" + g)
            if left is not None:
                room = min(room, left / max(p.duration, 1e-9))
        return room

    def most_idle(self) -> int:
        """The most GPUs idle on one node. Idle counts only fall within a pass, each fall lowering ``idle_total``:
        kept until that changes, so a deep queue of gangs asks the nodes once, not once per request."""
        total = self.ix.idle_total
        if self._most_idle[0] != total:
            self._most_idle = (total, max(self.ix.idle.values(), default=0))
        return self._most_idle[1]

    def idle_horizon(self) -> float:
        """The latest end an exclusive request may have and still get an idle GPU: the latest start of a reservation
        on the idle GPUs (INF when one is planned for nobody; -INF when none is idle). Kept until a GPU is taken or
        booked: a deep queue behind a planned head asks once, not a placement per request."""
        if self._horizon[0] != self._changes:
            reserved_from, nodes = self.reserved_from, self.nodes
            self._horizon = (self._changes, max((reserved_from.get(s.id, INF) for node, k in self.ix.idle.items()
                                                  if k for s in nodes[node] if s.idle), default=-INF))
        return self._horizon[1]

    def cap_reason(self, p: Pending, count: float) -> str | None:
        """Which limit keeps ``p`` from ``count`` GPUs now: "quota" (the user's or a group's GPUs at once), "budget"
        (GPU-hours left today), or None."""
        user = p.user
        limited = self.limited.get(user)
        if limited is None:  # once per user and pass: most users have no limit, and a deep queue asks per request
            if not self.budget and not self.policy.capped:
                limited = self.limited[user] = False
            else:
                cap, groups = self._caps(user)
                limited = self.limited[user] = (cap > 0 or any(gcap > 0 for _, gcap in groups) or user in self.budget
                                                 or any("@" + g in self.budget for g, _ in groups))
        if not limited:
            return None
        cap, groups = self._caps(user)
        if (cap > 0 and cap - self.held.get(user, 0.0) + 1e-9 < count) or any(
                gcap > 0 and gcap - self.gheld.get(g, 0.0) + 1e-9 < count for g, gcap in groups):
            return "quota"
        need = count * p.duration
        for key in (user, *("@" + g for g, _ in groups)):
            left = self.budget.get(key)
            if left is not None and left + 1e-6 < need:
                return "budget"
        return None

    def why(self, p: Pending, rank: int, top: float, latest: Mapping[int, int]) -> str:
        """Why this pass leaves ``p`` (of priority ``rank``) waiting, one of ``WAIT_REASONS``, from what the pass
        already holds: O(1) per request. Most specific first: a cap or budget, a gang no node has room for, no free GPU of
        its type or size, a reservation holding the idle GPUs; then whom it waits behind (a higher class, users who
        used less: a later arrival of its class ahead of it, earlier requests); else every GPU it could use is held.
        """
        req = p.request
        shared = req.shared
        if (self.budget or self.policy.capped) and self.limited.get(p.user, True):
            found = self.cap_reason(p, req.fraction if shared else req.min_gpus)
            if found is not None:
                return found
        if self.ix.idle_total >= (1 if shared else req.min_gpus):
            if req.locality == "node" and req.min_gpus > 1 and not shared and self.most_idle() < req.min_gpus:
                return "whole_node"
            if req.gpu_type or req.gpu_mem:
                return "no_gpu_type"
            if self.windows.of:
                return "reservation"
        elif req.gpu_type or req.gpu_mem:
            return "no_gpu_type"
        return _behind(rank, p.seq, top, latest)

    def _charge(self, p: Pending, count: float, taken: Sequence[Slot] = ()) -> None:
        groups = self.groups(p.user)
        gheld = self.gheld if groups else {}  # (counted before this charge, when it has groups to charge)
        self.held[p.user] = self.held.get(p.user, 0.0) + count
        self.types.charge(p.user, taken, count / max(len(taken), 1))
        if p.user in self.budget:
            self.budget[p.user] -= count * p.duration
        for g in groups:
            gheld[g] = gheld.get(g, 0.0) + count
            if "@" + g in self.budget:
                self.budget["@" + g] -= count * p.duration

    def fit_for(self, p: Pending) -> Callable[[Slot], bool] | None:
        """Which devices ``p`` may get (gpufit: its type, size, MIG, the user's per-type caps); None: any. A policy
        with no cap at all (``SchedulerPolicy.capped`` False: no ``max_gpus``, per type or not) has no per-type cap to
        ask of: each blocked request at the head asks here at each pass (``reserve``); on the 3,000-job version of the
        month replay (benchmarks/replay_month.py) this was 0.64 s of 28 s profiled, 0.11 s without asking."""
        req = p.request
        blocked = self.types.blocked(p.user, req.fraction if req.shared else req.min_gpus, self.ix.by_id.values) \
            if self.policy.capped else ()
        if not blocked and not constrained(req) and not (self.ix.has_mig and req.max_gpus > 1 and not req.shared):
            return None
        return fit_rule(req, self.policy.gpu_types, blocked)

    # --- exclusive -------------------------------------------------------------------------
    def _usable(self, s: Slot, end: float, user: str = "") -> bool:
        return s.idle and self.reserved_from.get(s.id, INF) >= end and self.windows.ok(s, end, user)

    def place_exclusive(self, p: Pending, end: float) -> Grant | None:
        req = p.request
        room = self._cap_room(p)
        if room < req.min_gpus or self.idle_count < req.min_gpus:
            return None
        want_max = int(min(req.max_gpus, room + 1e-9))
        fit = self.fit_for(p)
        chosen = self._preferred(p, end, want_max, fit) if p.prefer else None
        if chosen is None:
            chosen = self._choose(p, end, want_max, fit)
        chosen = self.types.trim(p.user, chosen or [], req.min_gpus)  # per-type caps
        if not chosen:
            return None
        chosen = [self.take(s, end) for s in chosen]
        self._charge(p, len(chosen), chosen)
        nodes = sorted({s.node for s in chosen})
        return Grant(p.lease_id, tuple(s.id for s in chosen), nodes[0] if len(nodes) == 1 else ",".join(nodes))

    def _preferred(self, p: Pending, end: float, want_max: int, fit: Callable[[Slot], bool] | None
                   ) -> list[Slot] | None:
        """A warm re-grant: the GPUs ``p.prefer`` names (its notebook's lease just gave them back) when every one
        is still usable for it (idle, planned for no earlier request, of its type), as many as it asks for and on
        one node if it must be; else None (placed as any request)."""
        req = p.request
        slots = [self.by_id.get(g) for g in p.prefer]
        mine = [s for s in slots if s is not None and self._usable(s, end, p.user) and (fit is None or fit(s))]
        if len(mine) < len(slots) or len(mine) < req.min_gpus:
            return None
        if req.locality == "node" and len({s.node for s in mine}) > 1:
            return None
        return mine[:want_max]

    def _choose(self, p: Pending, end: float, want_max: int, fit: Callable[[Slot], bool] | None
                ) -> list[Slot] | None:
        """The GPUs for an exclusive request: best fit on one node, or across nodes with locality 'any'."""
        req = p.request
        need = max(1, req.min_gpus) if req.locality == "node" else 1
        free_of: Callable[[str], list[Slot]]
        if fit is not None:  # a type, a memory size, no MIG devices or a per-type cap: only the devices that fit
            free_by_node = {n: [s for s in self.nodes[n] if fit(s) and self._usable(s, end, p.user)]
                            for n, k in self.ix.idle.items() if k >= need}
            counts = {n: len(free) for n, free in free_by_node.items()}
            free_of = free_by_node.__getitem__
        elif not self.reserved_from and not self.windows.of:  # nothing planned or reserved: usable = idle
            counts = {n: k for n, k in self.ix.idle.items() if k >= need}  # exact: only nodes with room
            free_of = self._idle_of
        else:
            free_by_node = {n: [s for s in self.nodes[n] if self._usable(s, end, p.user)]
                            for n, k in self.ix.idle.items() if k >= need}
            counts = {n: len(free) for n, free in free_by_node.items()}
            free_of = free_by_node.__getitem__
        chosen: list[Slot] | None = None
        fitting = [(k, n) for n, k in counts.items() if k >= req.min_gpus]
        if fitting:
            # best fit: the node that will have the fewest GPUs left (keeps big holes for big gangs)
            if req.min_gpus == req.max_gpus:
                _, node = min(fitting)
            else:
                _, node = max(fitting)  # incremental: the node where it gets the most
            free = free_of(node)
            chosen = pick_connected(free, min(want_max, len(free)))
        elif req.locality == "any":
            total = sum(counts.values())
            if total >= req.min_gpus:
                chosen = []
                for k, node in sorted((-k, n) for n, k in counts.items()):
                    more = min(want_max, total) - len(chosen)
                    if more <= 0:
                        break
                    chosen.extend(pick_connected(free_of(node), min(more, -k)))
        return chosen

    def _idle_of(self, node: str) -> list[Slot]:
        return [s for s in self.nodes[node] if s.idle]

    def grow(self, g: Growing) -> Grant | None:
        """Idle GPUs for a holding incremental lease, up to its max_gpus, on its node (any node with locality
        'any'), connected to what it holds where possible; none that a waiting request or a reservation needs."""
        p, req = g.pending, g.pending.request
        want = int(min(req.max_gpus - len(g.devices), self._cap_room(p) + 1e-9))
        if want <= 0:
            return None
        nodes = {self.by_id[d].node for d in g.devices if d in self.by_id}
        fit = self.fit_for(p) or (lambda s: True)
        free = [s for s in self.slots if self._usable(s, g.end, p.user) and (req.locality == "any" or s.node in nodes)
                and fit(s)]
        if not free:
            return None
        groups = {self.by_id[d].link_group for d in g.devices if d in self.by_id}
        free.sort(key=lambda s: (s.node not in nodes, s.link_group not in groups, s.node, s.index))
        chosen = [self.take(s, g.end) for s in self.types.trim(p.user, free[:want], 1)]  # [] past per-type caps
        if not chosen:
            return None
        self._charge(p, len(chosen), chosen)
        return Grant(p.lease_id, tuple(s.id for s in chosen), ",".join(sorted(nodes | {s.node for s in chosen})))

    def still_holds(self, r: Reservation) -> bool:
        """Whether an earlier pass's reservation still stands: its GPUs are still here, none is held past its
        start (a renewal) or planned for an earlier request of this pass, and its start has not passed."""
        start, now, by_id, busy_until = r.start, self.now, self.by_id, self.busy_until
        if start < now or self.windows.of:
            return False
        for gid in r.gpu_ids:
            s = by_id.get(gid)
            if s is None or (s.free_at > start and not s.idle) or busy_until.get(gid, now) > start:
                return False
        return True

    def book(self, r: Reservation) -> None:
        """Hold a reservation's GPUs: later requests of this pass may use them only if they end first."""
        self._changes += 1
        reserved_from, busy_until, start, end = self.reserved_from, self.busy_until, r.start, r.end
        for gid in r.gpu_ids:
            node = self.by_id[gid].node
            self._node_ready.pop(node, None)
            self._booked.add(node)
            if reserved_from.get(gid, INF) > start:
                reserved_from[gid] = start
            if busy_until.get(gid, 0.0) < end:
                busy_until[gid] = end

    def _ready_on(self, node: str) -> list[tuple[float, int]]:
        """(when it is ready for a request, its place on the node) of a node's GPUs, soonest first (ties in the
        node's order), advance reservations aside: now when idle, else when its holders' limits end (INF: never),
        and not before the end of a reservation this pass booked on it. Kept until one of them is taken or booked:
        the full pass reserves for ``backfill_depth`` requests, each asking every node. On the overloaded month
        replay (benchmarks/replay_month.py, 31,000 jobs) ``reserve`` computing them per call was 11.3 s of 49.3 s
        profiled on 6,000 jobs, 132 us a call (profiled, 3,000 jobs); kept per node, 62 us (8,000 jobs)."""
        ready = self._node_ready.get(node)
        if ready is None:
            now, busy_until, members = self.now, self.busy_until, self.nodes[node]
            # (an earlier pass's times of the same slots, none of them ready before now: nothing idle, nothing
            # booked, so the same: ``_kept_ready``)
            mine = node not in self._booked and self.ix.unchanged(node)
            ready = self._kept_ready(node, members) if mine else None
            if ready is None:
                ready = []
                for i, s in enumerate(members):
                    base = now if s.available and not s.exclusive and not s.n_shared else (  # (idle)
                        s.free_at if s.available or s.free_at < INF else INF)
                    until = busy_until.get(s.id, now)
                    ready.append((base if base >= until else until, i))
                ready.sort()
                if mine:
                    self.ix.kept[node] = (members, now, ready)
            self._node_ready[node] = ready
        return ready

    def _kept_ready(self, node: str, members: list[Slot]) -> list[tuple[float, int]] | None:
        """The node's ready times as an earlier pass (at ``then``) worked them out from the same slots (the same
        list: a change of one of them makes a new one), when none is before now: then none was idle or clamped to
        ``then``, and each is its slot's own time, as now. Most nodes of a busy cluster hold their leases from one
        pass to the next: on the 8,000-job version of the overloaded month replay (benchmarks/replay_month.py)
        the 282,645 calls of ``_ready_on`` took 1.49 s of CPU, 0.98 s with this (``reserve`` 3.10 -> 2.48 s)."""
        kept = self.ix.kept.get(node)
        if kept is None or kept[0] is not members:
            return None
        _, then, ready = kept
        return ready if then <= self.now <= ready[0][0] else None

    def reserve(self, p: Pending) -> Reservation | None:
        """Plan the earliest start of a blocked request on the GPUs that free soonest (a whole one for a shared
        request: it may then start on a GPU that others share, or on that one); None: no GPUs ever will."""
        k = 1 if p.request.shared else p.request.min_gpus
        windows, fit = self.windows.of, self.fit_for(p)
        best_start, best = INF, None
        if not windows and fit is None and p.request.locality != "any":  # one node, any of its GPUs: kept times
            # (the kept times read inline, the GPUs listed once, for the node chosen: on the 3,000-job version of the
            # month replay, 438,192 calls of _ready_on became 103,899, and reserve 3.8 -> 2.9 s of 28 s profiled)
            node_ready, best_node = self._node_ready, None
            for node, members in self.nodes.items():
                if len(members) >= k:
                    soonest = node_ready.get(node) or self._ready_on(node)
                    t = soonest[k - 1][0]
                    if t < best_start:
                        best_start, best_node = t, node
            if best_node is None:
                return None
            members = self.nodes[best_node]
            return Reservation(best_start, tuple(members[i].id for _, i in node_ready[best_node][:k]),
                               best_start + p.duration)
        now, busy_until, user = self.now, self.busy_until, p.user
        # slot id -> when it is ready for p, with another's advance reservation: before it if it fits, else after it
        ready: dict[str, float] = {}
        for s in self.slots:
            base = now if s.idle else (s.free_at if s.available or s.free_at < INF else INF)
            for w in windows.get(s.id, ()) if windows else ():
                if user not in w.members and base + p.duration > w.start:
                    base = max(base, w.end)
            ready[s.id] = max(base, busy_until.get(s.id, now))
        groups: list[list[Slot]] = list(self.nodes.values())
        if p.request.locality == "any":
            groups = [self.slots]
        if fit is not None:
            groups = [[s for s in members if fit(s)] for members in groups]
        for members in groups:
            if len(members) < k:
                continue
            times = sorted(members, key=lambda s: ready[s.id])[:k]
            start = ready[times[-1].id]
            if start < best_start:
                best_start, best = start, times
        if best is None:
            return None
        return Reservation(best_start, tuple(s.id for s in best), best_start + p.duration)

    # --- shared ----------------------------------------------------------------------------
    def place_shared(self, p: Pending, end: float) -> Grant | None:
        req = p.request
        if self._cap_room(p) < req.fraction - 1e-9:
            return None
        pol = self.policy
        best: Slot | None = None
        best_key: tuple[Any, ...] | None = None
        fit = self.fit_for(p)
        for s in self.slots:
            if not s.available or s.exclusive or (fit is not None and not fit(s)):
                continue
            if self.reserved_from.get(s.id, INF) < end:  # planned for a waiting request: only if it ends first
                continue
            if not self.windows.ok(s, end, p.user):
                continue
            mem = req.mem_bytes or int(req.fraction * s.memory_total)
            if s.shares + req.fraction > pol.max_shares_per_gpu + 1e-9:
                continue
            if s.n_shared + 1 > pol.max_leases_per_shared_gpu:
                continue
            if s.memory_total and s.mem_used + mem > s.memory_total:
                continue
            # pack: already-shared GPUs first, fullest first
            key = (s.n_shared == 0, -s.shares, s.node, s.index)
            if best_key is None or key < best_key:
                best, best_key = s, key
        if best is None:
            return None
        best = self.take(best, end, exclusive=False)
        best.shares += req.fraction
        best.n_shared += 1
        best.mem_used += req.mem_bytes or int(req.fraction * best.memory_total)
        best.free_at = max(best.free_at, end)
        self._charge(p, req.fraction, [best])
        return Grant(p.lease_id, (best.id,), best.node)
