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
  after the previous one and a pause). With a sessions file, a session's kernel ends at its ``stop_s`` (moved as its
  bursts were, never before its last burst's end), and the lease it still holds ends with it ("kernel_shutdown",
  as the extension gives its kernel's leases back when the kernel ends) instead of lingering to its idle deadline.
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
from ..manager.events import EventBus
from ..manager.holds import keeps
from ..manager.manager import LeaseManager
from ..policy.lease_policy import LeasePolicy
from ..store.lease_store import Store
from .model import Cluster, Outcome, Progress, Run, Suspend, Suspended, Told
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
_SUSPEND = 5  # a holder asked to suspend reports (or its report deadline passes)
_KEEP = 6  # a suspended gang's suspend_keep_max_seconds is up: the broker's tick takes its GPUs back (holds.py)
PROGRESS_EVERY = 1000  # events between two progress calls


def _deadline(t: float, delay: float) -> float:
    """``t + delay``, nudged up so that ``deadline - t >= delay`` holds in floating point."""
    d = t + delay
    while d - t < delay:
        d = math.nextafter(d, math.inf)
    return d


class _Sim:
    suspendable = False  # the holders' requests are suspendable (lease mode: ``Suspend``)

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
            events=EventBus(clock=self.clock.now, views=False),  # collect() reads which lease changed, not its view
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
        if self.suspendable:
            body["suspendable"] = True
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
        if self.suspendable:
            self._suspension_changes(changed)
        for lid in changed:
            held = self.holding.get(lid)
            if held is not None and held.state not in HOLDING:
                del self.holding[lid]
                self.held_gpus -= len(held.devices)
        for lid in changed:
            if lid not in self.waiting:
                continue
            lease, then = self.waiting[lid]
            if lease.state in (LeaseState.QUEUED, LeaseState.SUSPENDED):  # (suspended: waits for its resume)
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

    def _suspension_changes(self, changed: dict[str, None]) -> None:
        """Asks to suspend, and resumes, among the leases that ``changed`` (before ``collect`` looks at them)."""


class _LeaseSim(_Sim):
    """Every GPU burst asks for a lease; leases linger for the idle timeout."""

    def __init__(self, trace: Trace, cluster: Cluster, policy: LeasePolicy, idle: float, limits: str = "oracle",
                 estimates: bool = False, suspend: Suspend | None = None) -> None:
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
        self.stops = {s.id: s.stop for s in trace.sessions}  # a session's kernel ends then (trace time)
        self._suspend_setup(suspend)

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
        elif kind == _STOP:
            self.kernel_end(*payload)
        elif kind == _PRESSURE:
            self.pressure_check(*payload)
        elif kind == _SUSPEND:
            self.report_suspended(*payload)
        elif kind == _KEEP:
            self._tick()  # (the real broker ticks every second or so: a kept gang's deadline is met then)

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
        if self.suspendable and self._suspended_cell(key, idx, out, lease):
            return
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
        self.ends[lease.id] = (now + out.duration, idx, out)
        self.push(now + out.duration, _END, key, idx, lease, out)

    def burst_end(self, key: str, idx: int, lease: Lease | None, out: Outcome | None) -> None:
        now = self.clock.now()
        st = self.state[key]
        b = self.sessions[key][idx]
        if lease is not None and self._stale_end(lease, now):
            return  # its burst was suspended: it ends later
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
        elif key in self.stops:  # its last cell: the kernel ends at its stop, moved as its cells were
            self.push(max(now, OFFSET + self.stops[key] + st["shift"]), _STOP, key)

    def kernel_end(self, key: str) -> None:
        """Session ``key``'s kernel ended: the lease it still holds (lingering, or suspended) ends with it."""
        st = self.state[key]
        lease: Lease | None = st["lease"]
        if lease is None or lease.state.terminal or lease.id in self.running:
            return
        self.m.release(lease.id, st["who"], "kernel_shutdown")
        self.collect()

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
        if lease.state in HOLDING and lease.suspension is None:  # (or asks it to suspend: suspend_idle)
            raise RuntimeError(f"lease {lease.id} not revoked at its idle deadline ({lease.state.value})")

    # ------------------------------------------------------------------ suspension (issue 33)
    # The replay's holder of a suspendable lease: asked to suspend (``Lease.suspension``, since 0), it reports its
    # processes suspended after the suspend cost (``POST .../suspended``); a burst running then stops where it was
    # and goes on after the resume cost once the broker grants the lease again (reason "resumed"); a cell of a
    # session whose lease is suspended asks for it back (``POST .../resume``). The broker decides everything else.
    def _suspend_setup(self, suspend: Suspend | None) -> None:
        model = suspend or Suspend()
        on = model.suspendable if model.suspendable is not None else self.m.policy.preempt_mode == "suspend"
        self.suspendable = bool(on)
        self.costs = model
        self.run.suspend = model if on else None
        self.ends: dict[str, tuple[float, int, Outcome]] = {}  # running burst's lease -> when it ends, which burst
        self.asked: dict[str, float] = {}  # lease asked to suspend -> the suspend cost its holder pays
        self.paused: dict[str, tuple[str, int, Outcome, float]] = {}  # lease -> its burst stopped: key, idx, work left
        self.deferred: dict[str, tuple[str, int, Outcome]] = {}  # lease -> a cell that came while it suspended
        self.susp: dict[str, tuple[Lease, Suspended, str]] = {}  # suspended lease -> its record and session
        self.lost: list[str] = []  # suspended bursts whose lease ended before they resumed

    def _gib(self, key: str, gpus: int) -> float:
        """The GPU-memory footprint in GiB of a lease of ``gpus`` GPUs of session ``key`` (its last burst's)."""
        return gpus * (self.state[key].get("mem") or self.costs.gib_per_gpu)

    def _suspension_changes(self, changed: dict[str, None]) -> None:
        now = self.clock.now()
        for lid in changed:
            held = self.holding.get(lid)
            if held is not None and held.state in HOLDING and held.suspension is not None \
                    and not held.suspension.suspended and lid not in self.asked:
                self._asked(held, now)
            entry = self.susp.get(lid)
            if entry is not None and entry[0].state != LeaseState.SUSPENDED:
                self._left_suspension(entry, now)

    def _asked(self, lease: Lease, now: float) -> None:
        """The broker asked ``lease`` to suspend: its holder stops the running burst, if any, and reports after the
        suspend cost (or, if that comes after the ask's deadline, the broker falls back then)."""
        key = lease.request.labels.get("notebook", "")
        ask = lease.suspension
        assert ask is not None
        cost = self._gib(key, len(lease.devices)) * self.costs.suspend_seconds_per_gib
        self.asked[lease.id] = cost
        report = _deadline(now, cost)
        ok = report <= ask.deadline
        if not ok and not any(n.startswith("a holder cannot report") for n in self.run.notes):
            self.run.notes.append(f"a holder cannot report within suspend_report_seconds "
                                  f"({self.m.policy.suspend_report_seconds:g} s): its suspend takes {cost:.0f} s; "
                                  "the broker falls back (revokes) at the deadline")
        self.push(report if ok else ask.deadline, _SUSPEND, key, lease, ok)
        if lease.id in self.running:  # its processes are locked from now on: the burst's work waits
            del self.running[lease.id]
            end, idx, out = self.ends.pop(lease.id)
            self.paused[lease.id] = (key, idx, out, end - now)

    def report_suspended(self, key: str, lease: Lease, ok: bool) -> None:
        now = self.clock.now()
        cost = self.asked.pop(lease.id, 0.0)
        ask = lease.suspension
        if not ok and lease.state in HOLDING:
            self._tick()  # the report deadline: the real enforcer falls back
        if lease.state not in HOLDING or ask is None or ask.suspended:
            self._ended_suspending(lease, key)
            return
        n = len(lease.devices)
        self.run.suspended_held_gpu_s += n * (now - (lease.granted_at or now))
        del self.holding[lease.id]
        self.held_gpus -= n
        who = self.state[key]["who"]
        gib = self._gib(key, n)
        self.m.suspended(lease.id, who, {"ok": True, "how": "checkpoint", "host_bytes": int(gib * 2**30)})
        paused = self.paused.get(lease.id)
        rec = Suspended(lease.id, n, ask.why, now - OFFSET, running=paused is not None, suspend_cost=cost)
        self.run.suspended.append(rec)
        self.susp[lease.id] = (lease, rec, key)
        if keeps(lease, self.m.policy) and self.m.policy.suspend_keep_max_seconds:
            self.push(_deadline(now, self.m.policy.suspend_keep_max_seconds), _KEEP)
        if paused is not None:
            paused[2].suspensions += 1
            paused[2].costs += cost
        s = lease.suspension
        if (paused is not None or lease.id in self.deferred) and s is not None and not s.resume:
            self.m.resume(lease.id, who)  # a cell runs (or came meanwhile): it wants its GPUs back now
        cell = self.deferred.pop(lease.id, None)
        if cell is not None:
            self.waiting[lease.id] = (lease, cell)
            if lease.request.min_gpus > 1:
                self.gangs_waiting += 1
        self.collect()

    def _ended_suspending(self, lease: Lease, key: str) -> None:
        """``lease`` ended (or its ask was withdrawn) before it was suspended."""
        paused = self.paused.pop(lease.id, None)
        if paused is not None and lease.state in HOLDING:  # withdrawn: the burst goes on
            self._run_on(lease, paused[0], paused[1], paused[2], paused[3])
        elif paused is not None:
            self.lost.append(f"{lease.id} ({lease.state.value}: {lease.reason})")
        cell = self.deferred.pop(lease.id, None)
        if cell is not None:  # the cell comes again, as if it came now
            self._again(cell)

    def _again(self, cell: tuple[str, int, Outcome]) -> None:
        self.run.outcomes.remove(cell[2])
        self.run.busy_gpu_seconds -= cell[2].gpus * cell[2].duration
        self.push(self.clock.now(), _ARRIVE, cell[0], cell[1])

    def _left_suspension(self, entry: tuple[Lease, Suspended, str], now: float) -> None:
        """A suspended lease was granted again (resumed) or ended."""
        lease, rec, key = entry
        del self.susp[lease.id]
        rec.until = now - OFFSET
        waiting = self.waiting.pop(lease.id, None)
        if waiting is not None and lease.request.min_gpus > 1:
            self.gangs_waiting -= 1
        if lease.state not in HOLDING:
            if self.paused.pop(lease.id, None) is not None:
                self.lost.append(f"{lease.id} ({lease.state.value}: {lease.reason})")
            if waiting is not None:  # (suspended too long, say): the cell asks anew
                self._again(waiting[1])
            return
        n = len(lease.devices)
        self.holding[lease.id] = lease
        self.held_gpus += n
        cost = self._gib(key, n) * self.costs.resume_seconds_per_gib
        rec.resume_cost = cost
        paused = self.paused.pop(lease.id, None)
        if paused is not None:  # its burst goes on where it stopped
            _, idx, out, work = paused
            out.suspended += now - OFFSET - rec.since
            out.costs += cost
            self._run_on(lease, key, idx, out, cost + work)
        elif waiting is not None:  # a cell of its session: it runs once the lease is resumed
            _, (_, idx, out) = waiting
            out.granted, out.resumed = True, True
            out.wait = now - OFFSET - out.arrival + cost
            self._run_on(lease, key, idx, out, cost + out.duration)
        else:
            self.run.notes.append(f"lease {lease.id} resumed with no cell to run")

    def _run_on(self, lease: Lease, key: str, idx: int, out: Outcome, seconds: float) -> None:
        """The burst ``out`` runs on ``lease`` for ``seconds`` more (its work left and the resume cost); the lease's
        time limit is renewed to cover it, as a kernel renews for a cell."""
        now = self.clock.now()
        try:
            self.m.renew(lease.id, self.state[key]["who"],
                         self.limit(seconds + lease.idle_timeout_seconds + LINGER_SLACK))
        except Forbidden:
            self.run.renewals_refused += 1
        self.m.activity(lease, now)
        self.running[lease.id] = lease
        end = _deadline(now, seconds)
        self.ends[lease.id] = (end, idx, out)
        self.push(end, _END, key, idx, lease, out)

    def _suspended_cell(self, key: str, idx: int, out: Outcome, lease: Lease | None) -> bool:
        """A GPU cell of session ``key`` came: its lease being suspended, it waits for the report and resumes it; its
        lease suspended, it resumes it (or releases it for a bigger one). True: the cell is taken care of."""
        b = self.sessions[key][idx]
        st = self.state[key]
        st["mem"] = b.mem_gib
        if lease is None:
            return False
        s = lease.suspension
        if lease.id in self.asked and lease.state in HOLDING:
            self.deferred[lease.id] = (key, idx, out)
            return True
        if lease.state != LeaseState.SUSPENDED or s is None:
            return False
        if len(s.devices) < b.gpus:
            self.m.release(lease.id, st["who"], "replay_too_small")
            self.collect()
            return False
        self.m.resume(lease.id, st["who"])
        self.waiting[lease.id] = (lease, (key, idx, out))
        if lease.request.min_gpus > 1:
            self.gangs_waiting += 1
        self.collect()
        now = self.clock.now()
        if lease.state == LeaseState.SUSPENDED and self.m.policy.pressure_idle_timeout_seconds \
                and self.m.enforcer.pressure_now(now) != self.m.enforcer.pressure:
            self.push(now, _PRESSURE, None, now)  # as a request that queues (arrive)
        return True

    def _stale_end(self, lease: Lease, now: float) -> bool:
        """An end of a burst that was suspended since (it ends later), or the burst's end: marked done."""
        end = self.ends.get(lease.id)
        if end is None or end[0] != now:
            return True
        del self.ends[lease.id]
        end[2].done = True
        return False

    def loop(self, progress: Progress | None = None) -> None:
        super().loop(progress)
        if self.paused or self.lost:
            raise RuntimeError(f"{len(self.paused) + len(self.lost)} suspended burst(s) never completed: "
                               f"{', '.join(self.lost + list(self.paused))}")
