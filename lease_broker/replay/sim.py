"""The replay loop: a trace through a real LeaseManager on a virtual clock, event by event.

No model of the scheduler: every request, renewal, release and idle revocation goes through
``LeaseManager`` (the real ``schedule()``, ``LeasePolicy.apply`` and ``Enforcer.tick``) with a
``VirtualClock``, a ``:memory:`` store and a ``SimulatedInventory`` of the cluster's shape. The
loop only decides *when* to call it: a heap of events (arrivals, burst ends, idle deadlines,
session stops); nothing ticks at a fixed step and nothing sleeps. The manager runs as in the service, by event-loop
iterations (``core/driver.py: SyncDriver``): the replay ends the iteration after each call it makes (a request, a
renewal, a release, a tick: as the service's answer waits for the iteration's pass and group commit) and after each
event, so a call sees what the broker would have answered.

Two modes:

- ``lease``: each GPU burst is a ``%%gpu`` request of ``num_gpus`` when it arrives. After the
  burst the lease lingers for the idle timeout; the session's next burst reuses it if it comes
  within that time (a *warm* grant), otherwise the enforcer revokes it as idle and the next burst
  needs a *cold re-grant* (a *warm re-grant* when it is granted at once on the GPUs the last lease gave back,
  within ``REGRANT_WINDOW``: the broker's ``warm_regrant_seconds``). Requests carry the session as their
  ``notebook`` label, as ``%%gpu``'s do. Bursts of one session run in order and keep their think time: when a
  burst waits for GPUs, the session's later bursts move by as much (a notebook runs the next cell
  after the previous one and a pause).
- ``session`` (today's baseline): each session asks for ``max_gpus`` at its start and holds them
  until its stop (moved by however long it waited for them), first come first served.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from typing import Any

from ..core.clock import VirtualClock
from ..core.driver import SyncDriver
from ..core.errors import Forbidden
from ..core.identity import Identity
from ..core.lease import HOLDING, Lease, LeaseState
from ..manager.manager import LeaseManager
from ..policy.lease_policy import LeasePolicy
from ..store.lease_store import Store
from .model import Cluster, Outcome, Progress, Run, Told
from .policy import policy_copy
from .trace import Burst, Trace

OFFSET = 1_000_000.0  # trace time 0 on the virtual clock (exact for whole seconds)
LINGER_SLACK = 60.0  # a lease asks for its burst + idle timeout + this, so it never expires first
#: A session's GPU cell that needs a new lease is a warm re-grant, not a cold one, when it is granted at once on
#: the GPUs its last lease gave back at most this long before (the same yardstick whatever the policy compared)
REGRANT_WINDOW = 60.0
#: The time limits the lease mode's requests ask for: ``oracle``, what the burst needs (burst + idle timeout +
#: LINGER_SLACK; a holder's limit then says when it ends, which no real user knows); ``default``, the policy's
#: default_duration_seconds, or the smallest multiple of it that fits the burst (as users ask for --time 2h
#: when they know a cell is long).
LIMITS = ("oracle", "default")

# event kinds, in the order they run at one instant: ends free GPUs before arrivals ask for them
_END, _STOP, _DEADLINE, _ARRIVE, _PRESSURE = 0, 1, 2, 3, 4
PROGRESS_EVERY = 1000  # events between two progress calls


def _deadline(t: float, delay: float) -> float:
    """``t + delay``, nudged up so that ``deadline - t >= delay`` holds in floating point."""
    d = t + delay
    while d - t < delay:
        d = math.nextafter(d, math.inf)
    return d


class _Sim:
    def __init__(self, trace: Trace, cluster: Cluster, policy: LeasePolicy, mode: str, idle: float) -> None:
        self.trace = trace
        self.cluster = cluster
        starts = [b.start for b in trace.bursts] + [s.start for s in trace.sessions]
        self.clock = VirtualClock(start=OFFSET + min(starts, default=0.0))
        if policy.max_queued_per_user:  # a trace is demand to replay, not a flood to refuse: no cap on a user's queue
            policy = policy_copy(policy, max_queued_per_user=0)
        self.policy = policy
        self.driver = SyncDriver()  # ends the manager's event-loop iterations: ``settle``
        self.m = LeaseManager(
            Store(":memory:"),
            cluster.inventory(),
            policy,
            clock=self.clock,
            driver=self.driver,
        )
        self.run = Run(mode=mode, cluster=cluster, idle_timeout=idle)
        alone = sum(1 for b in trace.bursts if not b.session)
        if alone:
            self.run.notes.append(f"{alone:,} burst(s) have no session_id: each is replayed as its own session")
        self.changes = self.m.events.subscribe()  # lease events: what collect() looks at, not every lease
        self._schedule = self.m.schedule
        self.m.schedule = self._timed_schedule  # type: ignore[method-assign]  # the cost of each pass, measured
        self._event_cost, self._event_passes = 0.0, 0
        self.done, self.total = 0, 0  # work items (bursts or sessions) finished, for progress
        self.heap: list[tuple[float, int, int, tuple[Any, ...]]] = []
        self.seq = itertools.count()
        self.record_estimates = False  # record what each request that queues is told (Run.told)
        self.waiting: dict[str, tuple[Lease, Any]] = {}  # queued lease id -> (lease, what to start)
        self.holding: dict[str, Lease] = {}
        self.held_gpus = 0
        self.gangs_waiting = 0
        self.last_t = self.clock.now()
        self.run.start = self.last_t - OFFSET

    # ------------------------------------------------------------------ plumbing
    def push(self, t: float, kind: int, *payload: Any) -> None:
        heapq.heappush(self.heap, (t, kind, next(self.seq), payload))

    def _timed_schedule(self) -> int:
        t0 = time.perf_counter()
        try:
            return self._schedule()
        finally:
            self._event_cost += time.perf_counter() - t0
            self._event_passes += 1

    def loop(self, progress: Progress | None = None) -> None:
        queue = self.m.state.queue
        while self.heap:
            t, kind, _, payload = heapq.heappop(self.heap)
            self._integrate(t, len(queue))
            self.clock.set(t)
            self.run.events += 1
            self._event_cost, self._event_passes = 0.0, 0
            self.handle(kind, payload)
            self.settle()
            if self._event_passes:  # the wall time of the scheduling passes this event caused
                self.run.pass_seconds.append(self._event_cost)
            self.run.queue_max = max(self.run.queue_max, len(queue))
            if progress is not None and self.run.events % PROGRESS_EVERY == 0:
                progress(self.run.mode, self.done, self.total)
        if progress is not None:
            progress(self.run.mode, self.done, self.total)
        self.run.end = self.last_t - OFFSET
        if self.waiting:
            raise RuntimeError(f"replay ended with {len(self.waiting)} requests never granted")

    def handle(self, kind: int, payload: tuple[Any, ...]) -> None:
        raise NotImplementedError

    def settle(self) -> None:
        """End the manager's event-loop iteration: its scheduling pass, its group commit and what follows them
        (as the service's answer to a call waits for them)."""
        self.driver.run()

    def _integrate(self, t: float, depth: int) -> None:
        dt = t - self.last_t
        if dt > 0:
            self.run.queue_seconds[depth] = self.run.queue_seconds.get(depth, 0.0) + dt
        if dt > 0 and self.gangs_waiting:
            self.run.gang_block_gpu_seconds += dt * (self.cluster.total - self.held_gpus)
        self.last_t = max(self.last_t, t)

    def request(self, who: Identity, gpus: int, duration: float, idle: float, then: Any, session: str = "") -> Lease:
        body: dict[str, Any] = {
            "gpus": gpus,
            "duration_seconds": duration,
            "heartbeat": False,  # the replay stands in for the holder; time and idleness still apply
            "locality": "node" if gpus <= self.cluster.gpus_per_node else "any",
            # a notebook's requests carry its name, as %%gpu's do (warm re-grants: manager/planning.py)
            "labels": {"replay": self.run.mode, **({"notebook": session} if session else {})},
        }
        if idle > 0:
            body["idle_timeout_seconds"] = idle
        lease, _ = self.m.request(who, body)
        self.settle()  # the answer waits for the pass
        self.run.leases.append(lease)
        self.waiting[lease.id] = (lease, then)
        if gpus > 1:
            self.gangs_waiting += 1
        if self.record_estimates and lease.state == LeaseState.QUEUED:
            self.told(lease, who)
        self.collect()
        return lease

    def told(self, lease: Lease, who: Identity) -> None:
        """What a request that queued was told at once (its owner's view), and the time-limit plan."""
        view = self.m.view(lease, who)
        low, high = view["estimated_start_range"] or (None, None)
        self.run.told.append(Told(lease, view["estimated_start"], low, high, self.m.state.planned.get(lease.id)))

    def collect(self) -> None:
        """Notice what the manager did (its lease events since the last call): grants of waiting requests,
        ends of held leases."""
        self.settle()
        changed: dict[str, None] = {}  # in the order they happened, once each
        while not self.changes.empty():
            event = self.changes.get_nowait()
            if event["type"] == "lease":
                changed[event["lease"]["id"]] = None
        for lid in changed:
            held = self.holding.get(lid)
            if held is not None and held.state not in HOLDING:
                del self.holding[lid]
                self.held_gpus -= len(held.devices)
        for lid in changed:
            if lid not in self.waiting:
                continue
            lease, then = self.waiting[lid]
            if lease.state == LeaseState.QUEUED:
                continue
            del self.waiting[lid]
            if lease.request.min_gpus > 1:
                self.gangs_waiting -= 1
            if lease.state in HOLDING:
                self.holding[lid] = lease
                self.held_gpus += len(lease.devices)
                self.granted(lease, then)
            else:
                raise RuntimeError(f"lease {lid} ended while queued: {lease.state.value} ({lease.reason})")

    def granted(self, lease: Lease, then: Any) -> None:
        raise NotImplementedError


class _LeaseSim(_Sim):
    """Every GPU burst asks for a lease; leases linger for the idle timeout."""

    def __init__(self, trace: Trace, cluster: Cluster, policy: LeasePolicy, idle: float, limits: str = "oracle",
                 estimates: bool = False) -> None:
        if limits not in LIMITS:
            raise ValueError(f"Unknown limits {limits!r}: use one of {', '.join(LIMITS)}")
        self.limits, self.default_limit = limits, policy.default_duration_seconds
        longest = self.limit(max((b.duration for b in trace.bursts), default=0.0) + idle + LINGER_SLACK)
        self.notes: list[str] = []
        if longest > policy.max_duration_seconds:
            self.notes.append(
                f"LeasePolicy.max_duration_seconds raised from {policy.max_duration_seconds:g} to {longest:g} s "
                "so the trace's longest burst fits in one lease"
            )
            policy = policy_copy(policy, max_duration_seconds=longest)
        super().__init__(trace, cluster, policy, "lease", idle)
        self.run.notes.extend(self.notes)
        self.run.limits, self.record_estimates = limits, estimates
        self.idle_req = idle
        # a running lease whose last activity is more recent than this meets none of the enforcer's idle checks
        # (mark idle, idle or pressure revocation, their warnings): the runner need not report it again
        pol = self.m.policy
        timeouts = [t for t in (idle, pol.pressure_idle_timeout_seconds) if t > 0]
        self.quiet = min([pol.idle_mark_seconds] + [self.m.enforcer.warn_after(t) for t in timeouts])
        self.sessions: dict[str, list[Burst]] = {}
        for i, b in enumerate(trace.bursts):
            self.sessions.setdefault(b.session or f"#burst{i}", []).append(b)
        self.state: dict[str, dict[str, Any]] = {}
        for key, bursts in self.sessions.items():
            bursts.sort(key=lambda b: b.start)
            self.state[key] = {"lease": None, "shift": 0.0, "gpu_seen": False, "who": Identity(bursts[0].owner)}
            self.push(OFFSET + bursts[0].start, _ARRIVE, key, 0)
        self.running: dict[str, Lease] = {}
        self.total = len(trace.bursts)

    def limit(self, need: float) -> float:
        """The time limit a burst's lease asks for (see LIMITS), ``need`` the burst + idle timeout + slack."""
        if self.limits == "oracle" or self.default_limit <= 0:
            return need
        return self.default_limit * max(1, math.ceil(need / self.default_limit))

    def handle(self, kind: int, payload: tuple[Any, ...]) -> None:
        if kind == _ARRIVE:
            self.arrive(*payload)
        elif kind == _END:
            self.burst_end(*payload)
        elif kind == _DEADLINE:
            self.idle_deadline(*payload)
        elif kind == _PRESSURE:
            self.pressure_check(*payload)

    def arrive(self, key: str, idx: int) -> None:
        now = self.clock.now()
        b = self.sessions[key][idx]
        st = self.state[key]
        if b.gpus == 0:
            self.run.cpu_bursts += 1
            self.push(now + b.duration, _END, key, idx, None, None)
            return
        out = Outcome(b.owner, b.gpus, b.duration, now - OFFSET, first=not st["gpu_seen"])
        st["gpu_seen"] = True
        self.run.outcomes.append(out)
        self.run.busy_gpu_seconds += b.gpus * b.duration
        lease: Lease | None = st["lease"]
        if lease is not None and lease.state in HOLDING and len(lease.devices) >= b.gpus:
            try:
                self.m.renew(lease.id, st["who"], self.limit(b.duration + lease.idle_timeout_seconds + LINGER_SLACK))
            except Forbidden:
                self.run.renewals_refused += 1
                self.m.release(lease.id, st["who"], "replay_renewal_refused")
                self.collect()
            else:
                self.settle()
                out.warm = True
                self.start_burst(lease, (key, idx, out))
                return
        elif lease is not None and lease.state in HOLDING:
            self.m.release(lease.id, st["who"], "replay_too_small")  # a bigger cell: give back, ask anew
            self.collect()
        st["lease"], st["last"] = None, lease
        # active: their runners say so (one heard from within ``quiet`` meets no idle check, nor an idle deadline
        # in the estimates: as in _tick)
        for running in self.running.values() if self.record_estimates else ():
            if running.state in HOLDING and now - running.last_activity >= self.quiet:
                self.m.activity(running, now)
        lease = self.request(st["who"], b.gpus, self.limit(b.duration + self.idle_req + LINGER_SLACK), self.idle_req,
                             (key, idx, out), key)
        if lease.state == LeaseState.QUEUED and self.m.policy.pressure_idle_timeout_seconds \
                and self.m.enforcer.pressure_now(now) != self.m.enforcer.pressure:
            self.push(now, _PRESSURE, None, now)  # the broker's next tick: idle leases it waits for may go

    def granted(self, lease: Lease, then: Any) -> None:
        key, idx, out = then
        st = self.state[key]
        st["lease"], last = lease, st.pop("last", None)
        now = self.clock.now()
        if last is not None and last.ended_at is not None and now - OFFSET == out.arrival \
                and now - last.ended_at <= REGRANT_WINDOW and set(lease.devices) == set(last.devices):
            out.regranted = True  # its notebook's GPUs again, at once (manager/planning.py: WarmRegrants)
        self.start_burst(lease, then)

    def start_burst(self, lease: Lease, then: tuple[str, int, Outcome]) -> None:
        key, idx, out = then
        now = self.clock.now()
        out.granted = True
        out.wait = now - OFFSET - out.arrival
        self.m.activity(lease, now)
        self.running[lease.id] = lease
        self.push(now + out.duration, _END, key, idx, lease, out)

    def burst_end(self, key: str, idx: int, lease: Lease | None, out: Outcome | None) -> None:
        now = self.clock.now()
        st = self.state[key]
        b = self.sessions[key][idx]
        self.done += 1
        if lease is not None:
            self.running.pop(lease.id, None)
            if lease.state in HOLDING:
                self.m.activity(lease, now)
                if lease.idle_timeout_seconds > 0 and self.idle_req > 0:
                    self.push(_deadline(now, lease.idle_timeout_seconds), _DEADLINE, lease, now)
                    pressure = self.m.policy.pressure_idle_timeout_seconds
                    if 0 < pressure < lease.idle_timeout_seconds:  # revoked then if someone waits for it
                        self.push(_deadline(now, pressure), _PRESSURE, lease, now)
                        usual = self.m.enforcer.usual_pause(lease)
                        if pressure < usual < lease.idle_timeout_seconds:  # its holder's usual pause instead
                            self.push(_deadline(now, usual), _PRESSURE, lease, now)
                else:
                    self.m.release(lease.id, st["who"], "cell_done")
                    self.collect()
            else:
                self.run.notes.append(f"lease {lease.id} ended during its burst: {lease.state.value} ({lease.reason})")
        # the session's next cell comes after the same pause as in the trace
        st["shift"] = max(st["shift"], now - OFFSET - (b.start + b.duration))
        if idx + 1 < len(self.sessions[key]):
            nb = self.sessions[key][idx + 1]
            self.push(max(now, OFFSET + nb.start + st["shift"]), _ARRIVE, key, idx + 1)

    def pressure_check(self, lease: Lease | None, stamp: float) -> None:
        """A tick when an idle lease reaches the pressure idle timeout, or a request queued (``lease`` None): the
        real enforcer revokes the idle leases that someone waits for (``pressure_idle_timeout_seconds``)."""
        if lease is not None and (lease.state not in HOLDING or lease.id in self.running
                                  or lease.last_activity != stamp):
            return
        self._tick()

    def _tick(self) -> None:
        now = self.clock.now()
        for running in self.running.values():  # running cells are active: the runner says so
            if running.state in HOLDING and now - running.last_activity >= self.quiet:
                self.m.activity(running, now)
        self.m.tick()
        self.collect()

    def idle_deadline(self, lease: Lease, stamp: float) -> None:
        if lease.state not in HOLDING or lease.id in self.running or lease.last_activity != stamp:
            return  # ended already, or reused since
        self._tick()  # the real enforcer revokes it as idle
        if lease.state in HOLDING:
            raise RuntimeError(f"lease {lease.id} not revoked at its idle deadline ({lease.state.value})")
