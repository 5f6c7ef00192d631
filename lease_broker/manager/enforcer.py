"""The enforcer: time limits, heartbeats, idleness, and stopping a lease's processes.

When a lease ends, its process groups get SIGTERM, then SIGKILL after
``term_timeout``; its GPUs stay *draining* until the inventory says they are clean,
and only then can be granted again.
"""

from __future__ import annotations

import logging
import signal
import statistics
from typing import Protocol

from ..core.clock import Clock
from ..core.errors import BadRequest, Forbidden
from ..core.gpu import GpuSample
from ..core.gpufit import constrained, fits
from ..core.identity import Identity
from ..core.lease import HOLDING, RESUMED, Change, Lease, LeaseState, reason_slug
from ..core.slots import SlotIndex
from ..core.small_first import Pressure, small_need
from ..core.words import SUSPEND_FAILED
from ..host.procs import ProcInfo, children_map, is_descendant, proc_info, signal_group
from ..policy.lease_policy import LeasePolicy
from .gpuwatch import GpuWatch
from .state import LeaseOps, LiveState

log = logging.getLogger("lease_broker")
#: The reason of a lease revoked by preemption (``preemption.REASON``, which imports this module).
PREEMPTED = "preempted"
PAUSES_KEPT = 8  # a lease's last idle pauses that pressure_learns_pauses takes the median of


class Probe(Protocol):
    """What the enforcer asks of the inventory."""

    def lease_active(self, lease_id: str, pids: list[int], samples: dict[str, GpuSample],
                     devices: list[str]) -> bool: ...

    def is_drained(self, gpu_id: str, pids: list[int], samples: dict[str, GpuSample]) -> bool: ...


class DrainStore(Protocol):
    """The store's records of processes and draining GPUs (not lease state)."""

    def drain(self, gpu_ids: list[str], lease_id: str, pids: list[int], since: float) -> None: ...

    def drained(self, gpu_id: str) -> None: ...



class HolderCheck(Protocol):
    """Whether a lease's holder process is watched (``Holders``): then its exit ends the lease, not a heartbeat."""

    def watched(self, lease: Lease) -> bool: ...


class Enforcer:
    def __init__(self, *, state: LiveState, ops: LeaseOps, policy: LeasePolicy, probe: Probe, store: DrainStore,
                 clock: Clock, holders: HolderCheck | None = None) -> None:
        self.state, self.ops, self.policy, self.probe, self.store = state, ops, policy, probe, store
        self.clock, self.holders = clock, holders
        self.draining: dict[str, tuple[str, float, list[int]]] = {}  # gpu -> (lease, since, pids)
        self.unhealthy: dict[str, str] = {}  # gpu -> why
        self.kills: dict[str, tuple[float, dict[int, int]]] = {}  # lease -> (SIGKILL deadline, pids)
        self.pressure: Pressure | None = None  # as of the last tick (see pressure_now)
        self.closed: dict[str, str] = {}  # gpu -> why, as an engine closed it (a subset of unhealthy)
        self.watch = GpuWatch(state=state, ops=ops, policy=policy, clock=clock, enforcer=self)
        self._values: tuple[int, float, float, bool] = (-1, 0.0, 0.0, False)  # see ``_options``

    # ---------------------------------------------------------------- processes
    def drain(self, lease: Lease) -> None:
        """A lease that held GPUs ended: drain its GPUs until its processes are gone. At once, when the end is
        committed, before the iteration's scheduling pass: a pass must not hand on a GPU its processes still use
        (the SIGTERM waits for the stored end: ``stop``)."""
        alive = [p for p, t in lease.processes.items() if _alive(p, t)]
        now = self.clock.now()
        # the GPU is clean only when the descendants are gone too (they may have left the process group)
        # (only live ones: a dead pid may since belong to an unrelated process, which must not hold the GPU)
        drain_pids = sorted(set(alive) | _descendants(alive))
        samples = self.state.samples
        dirty = [d for d in lease.devices if alive or not self.probe.is_drained(d, drain_pids, samples)]
        if dirty:
            for d in dirty:
                self.draining[d] = (lease.id, now, drain_pids)
            self.store.drain(dirty, lease.id, drain_pids, now)

    def stop(self, lease: Lease, cont: bool = False) -> None:
        """Once a lease's end is stored: SIGTERM its process groups (SIGKILL after ``term_timeout``). ``cont``: its
        processes were suspended (SIGSTOP): SIGCONT first, so that they can handle the SIGTERM and exit."""
        alive = {p: t for p, t in lease.processes.items() if _alive(p, t)}
        if alive:
            for pid, ticks in alive.items():
                if cont:
                    signal_group(pid, ticks, signal.SIGCONT)
                if signal_group(pid, ticks, signal.SIGTERM):
                    log.info("Lease %s ended: SIGTERM to process group of %s", lease.id, pid)
            self.kills[lease.id] = (self.clock.now() + self.policy.term_timeout, alive)

    def check_attach(self, pid: int, who: Identity) -> ProcInfo:
        """A process the caller may attach to a lease: alive here, the caller's own, the caller or a descendant."""
        info = proc_info(pid)
        if info is None:
            raise BadRequest(f"No process {pid} is running on the broker's host")
        if who.uid < 0:
            raise Forbidden("Processes can be attached only over the broker's Unix socket")
        if info.uid != who.uid:
            raise Forbidden(f"Process {pid} does not belong to you")
        if who.pid and not is_descendant(pid, who.pid):
            raise Forbidden(f"Process {pid} is not the caller or one of its descendants")
        return info

    def restore_drains(self, drains: dict[str, tuple[str, float, list[int]]]) -> None:
        self.draining.update({g: d for g, d in drains.items() if g in self.state.gpu_by_id})

    def set_closed(self, reasons: dict[str, str]) -> bool:
        """The GPUs an engine takes no new leases on (replacing what it said before); whether that changed."""
        if reasons == self.closed:
            return False
        for gid, why in self.closed.items():
            if gid not in reasons and self.unhealthy.get(gid) == why:
                del self.unhealthy[gid]
        for gid, why in reasons.items():
            if gid not in self.unhealthy:
                self.unhealthy[gid] = why
                log.info("GPU %s unavailable: %s", gid, why)
        self.closed = dict(reasons)
        return True

    def slot_index(self, now: float) -> SlotIndex:
        """The GPUs for a pass: the table's index, with draining GPUs free after term_timeout, unhealthy never."""
        return self.state.table.slot_index(self.draining, self.unhealthy, now + self.policy.term_timeout)

    def resumed(self, lease: Lease, now: float) -> tuple[float, ...] | None:
        """Activity on ``lease`` (before it is recorded): its idle warning no longer holds, and a pause of at least
        ``idle_mark_seconds`` is one its holder came back from (``pressure_learns_pauses``): the lease's pauses
        with it, for the activity's own change (None: unchanged). One commit per activity, not two: on the
        3,000-job overloaded replay (benchmarks/replay_month.py) 98,863 of 102,484 activities came back from a
        pause, and the second commit was 1.9 s of 34.5 s profiled."""
        if lease.warned:
            self.clear_warning(lease, "idle")
        pause = now - lease.last_activity
        if pause >= self._options()[1] and lease.state in HOLDING:
            return (*lease.pauses, pause)[-PAUSES_KEPT:]
        return None

    def clear_warning(self, lease: Lease, kind: str) -> None:
        """A warning of ``kind`` no longer holds (activity, a renewal): it is sent again when it holds again."""
        if lease.warned & {kind, kind + ":pressure"}:
            self.ops.commit(lease, Change(warned=lease.warned - {kind, kind + ":pressure"}))

    @property
    def busy(self) -> bool:
        """Whether something needs a fast poll (a kill pending or a GPU draining)."""
        return bool(self.kills or self.draining or self.watch.busy)

    # ---------------------------------------------------------------- time
    def retime(self, step: float) -> None:
        """The wall clock stepped ``step`` seconds (``LeaseManager.retime``): the SIGKILL deadlines and the drains'
        starts move by as much (the drains' in the store too: a restart reads them), so none comes early or late."""
        self.kills = {lid: (deadline + step, pids) for lid, (deadline, pids) in self.kills.items()}
        for gpu_id, (lease_id, since, pids) in list(self.draining.items()):
            self.draining[gpu_id] = (lease_id, since + step, pids)
            self.store.drain([gpu_id], lease_id, pids, since + step)
        self.watch.retime(step)

    def tick(self, now: float) -> None:
        """Expiry, heartbeats, idleness and warnings of every holding lease. The policy's values are read once per
        tick, not per lease (a traitlet read costs ~1 us, and the loop visits every holding lease at every tick):
        on the 8,000-job overloaded replay (benchmarks/replay_month.py) traitlet reads fell from 2.8 M (2.6 s of
        75.7 s profiled) to 1.7 M (1.6 s)."""
        ops, pol, samples = self.ops, self.policy, self.state.samples
        self._escalate(now)
        self.watch.check(now)
        self._drain(now)
        self.pressure = self.pressure_now(now)
        mark, warn_before = pol.idle_mark_seconds, pol.warn_before_seconds
        warn_after: dict[float, float] = {}  # idle timeout -> self.warn_after(it)
        quiet: dict[float, float] = {}  # the lease's own idle timeout -> self.quiet_for(it)
        self._suspended(now)
        suspend, report = bool(pol.suspend_idle), float(pol.suspend_report_seconds)
        for lease in list(self.state.holding()):
            if lease.state not in HOLDING:
                continue  # ended during this tick (an end hands GPUs on at once without a loop: a preemption)
            if lease.request.heartbeat and self.heartbeat_lost(lease, now):
                log.info("Lease %s of %s ends (holder_gone): no heartbeat for %.0f s (heartbeat_timeout %g s)",
                         lease.id, lease.user, now - lease.last_heartbeat, pol.heartbeat_timeout)
                ops.end(lease, LeaseState.REVOKED, "holder_gone")
                continue
            expires = lease.expires_at
            if expires is not None and now >= expires:  # (a suspendable lease was asked before: see below)
                ops.end(lease, LeaseState.EXPIRED, "expired")
                continue
            ask = lease.suspension
            if ask is not None:  # asked to suspend: its holder reports, or at the deadline what it replaced happens
                if now >= ask.deadline:
                    self.fall_back(lease, "")
                continue
            # a time limit is kept to the second (reservations start after it): a suspendable lease is asked
            # suspend_report_seconds before it, and its holder reports by then
            if suspend and expires is not None and now >= expires - report and ops.ask_suspend(
                    lease, "expired", deadline=expires):
                continue
            idle_for = now - lease.last_activity
            if not lease.processes and (expires is None or now < expires - warn_before):
                own = lease.idle_timeout_seconds
                calm = quiet.get(own)
                if calm is None:
                    calm = quiet[own] = self.quiet_for(own)
                if idle_for < calm:
                    continue  # nothing below can hold for it yet: no pass through the idle checks
            pids = lease.pids
            if pids and self.probe.lease_active(lease.id, pids, samples, lease.devices):
                ops.activity(lease, now)
                idle_for = now - lease.last_activity
            timeout, pressed = self.idle_timeout(lease)
            if timeout and idle_for >= timeout:
                if not (suspend and ops.ask_suspend(lease, "pressure" if pressed else "idle")):
                    ops.end(lease, LeaseState.REVOKED, "idle_pressure" if pressed else "idle")
                continue
            if lease.state != LeaseState.IDLE and idle_for >= min(mark, timeout or 1e18):
                ops.mark_idle(lease)
            kind = "idle:pressure" if pressed else "idle"
            if timeout and kind not in lease.warned:
                after = warn_after.get(timeout)
                if after is None:
                    after = warn_after[timeout] = self.warn_after(timeout)
                if idle_for >= after:
                    self._warn(lease, kind, lease.last_activity + timeout)
            if (
                lease.expires_at is not None
                and "expiry" not in lease.warned
                and now >= lease.expires_at - warn_before
            ):
                self._warn(lease, "expiry", lease.expires_at)

    def _suspended(self, now: float) -> None:
        """Suspended leases hold no GPU and are never idle or expired; one whose holder stopped beating (its kernel
        is gone), or that stayed suspended longer than ``suspend_max_seconds``, ends (its processes are continued,
        then stopped: ``stop``)."""
        longest = float(self.policy.suspend_max_seconds)
        for lease in list(self.state.suspended.values()):
            if lease.state != LeaseState.SUSPENDED or lease.suspension is None:
                continue
            if lease.request.heartbeat and self.heartbeat_lost(lease, now):
                log.info("Suspended lease %s of %s ends (holder_gone): no heartbeat for %.0f s", lease.id, lease.user,
                         now - lease.last_heartbeat)
                self.ops.end(lease, LeaseState.REVOKED, "holder_gone")
            elif longest and now - lease.suspension.since >= longest:
                log.info("Suspended lease %s of %s ends: suspended for %.0f s (suspend_max_seconds %g)", lease.id,
                         lease.user, now - lease.suspension.since, longest)
                self.ops.end(lease, LeaseState.REVOKED, "suspended_too_long")

    def fall_back(self, lease: Lease, text: str) -> None:
        """A holding lease asked to suspend was not (its holder said it could not: ``text``, or did not report by
        the deadline): the broker does what it would have done without suspension: the revocation the ask replaced
        (idle, pressure, expiry; a preemption's 'preempted'); an ask of the holder's own or an admin's is withdrawn.
        The holder's words go into the lease's reason (after ';': ``core.words.ended_text``)."""
        ask = lease.suspension
        if ask is None or ask.suspended or lease.state not in HOLDING:
            return
        note = ";" + SUSPEND_FAILED + reason_slug(text, "") if text else ""
        log.info("Lease %s of %s was not suspended (%s): %s", lease.id, lease.user, ask.why,
                 text or f"no report within {self.policy.suspend_report_seconds:g} s")
        if ask.why == "expired":
            self.ops.end(lease, LeaseState.EXPIRED, "expired" + note)
        elif ask.why in ("idle", "pressure"):
            self.ops.end(lease, LeaseState.REVOKED, ("idle_pressure" if ask.why == "pressure" else "idle") + note)
        elif ask.why == "preempted":
            self.ops.end(lease, LeaseState.REVOKED, PREEMPTED + note)
        else:
            self.ops.commit(lease, Change(suspension=RESUMED, event="suspend_withdrawn"))

    def heartbeat_lost(self, lease: Lease, now: float) -> bool:
        """No heartbeat from the lease's holder for ``heartbeat_timeout``; a holder process the broker watches is
        exempt (its exit ends the lease at once, and a busy kernel that beats late loses nothing)."""
        timeout = self.policy.heartbeat_timeout
        return bool(timeout and lease.request.heartbeat and now - lease.last_heartbeat > timeout
                    and not (self.holders is not None and self.holders.watched(lease)))

    def quiet_for(self, own: float) -> float:
        """Seconds without activity before which a holding lease whose own idle timeout is ``own`` meets none of
        the tick's idle checks (marked idle, revoked or asked to suspend, warned), whatever the pressure: under
        pressure its timeout is never below the pressure one (``idle_timeout_under``), and ``warn_after`` only
        grows with the timeout. The tick passes over such a lease (with no processes to probe and no expiry
        warning due) at once: on the 8,000-job version of the overloaded month replay (benchmarks/replay_month.py)
        a tick went from 154 to 92 us of CPU (13,280 ticks: 2.05 -> 1.22 s)."""
        pol = self.policy
        short = float(pol.pressure_idle_timeout_seconds) if pol.pressure_idle_timeout_seconds else 0.0
        least = min(own, short) if short > 0 and own else own
        return min(float(pol.idle_mark_seconds), self.warn_after(least)) if least else float(pol.idle_mark_seconds)

    def warn_after(self, timeout: float) -> float:
        """Seconds without activity after which a lease with this idle timeout is warned: ``warn_before_seconds``
        before the deadline, but never before it has been idle for ``idle_mark_seconds`` (half its timeout if that
        is shorter): with a pressure timeout no longer than the warning's lead, a lease in use would otherwise be
        warned at every tick while someone waits."""
        pol = self.policy
        return max(timeout - pol.warn_before_seconds, min(pol.idle_mark_seconds, timeout / 2))

    def pressure_now(self, now: float) -> Pressure | None:
        """What the first request of a pass needs, as the queue stands now, while requests wait; else None (the
        tick keeps it as ``pressure``; an estimate made the moment a request queues asks afresh, when that request
        already presses). The first request, not any
        waiting one: GPUs freed for a request behind a gang would go to the gang's reservation (on the 2x8 replay,
        revoking for any waiting request made the 1-GPU p95 wait 14 times longer). With small_first_gpus, a small
        request goes before a bigger head (``small_first.small_need``: then only its size is known). A head that
        names a GPU type or memory presses only the leases on GPUs it may get."""
        if not self.policy.pressure_idle_timeout_seconds:
            return None
        head = self.state.queue.head(1)
        if not head:
            return None
        pol = self.policy
        need = small_need(head[0], self.state.queue.smallest_need(), pol.small_first_gpus, pol.small_first_timeout,
                          now)
        req = head[0].request
        usable = None
        if constrained(req) and need == (1 if req.shared else req.min_gpus):
            aliases = pol.gpu_type_aliases()
            usable = frozenset(g.id for g in self.state.gpus if fits(g, req, aliases))
        if usable is None and not self.draining and not self.unhealthy:
            return Pressure(need, self.state.table.free_by_node(), None)
        busy, blocked = self.state.table.busy, self.draining.keys() | self.unhealthy
        free: dict[str, int] = {}
        for g in self.state.gpus:
            if g.id not in busy and g.id not in blocked and (usable is None or g.id in usable):
                free[g.node] = free.get(g.node, 0) + 1
        return Pressure(need, free, usable)

    def idle_timeout(self, lease: Lease) -> tuple[float, bool]:
        """The lease's idle timeout as of the last tick, and whether it is the pressure one (``idle_timeout_under``
        the tick's pressure)."""
        return self.idle_timeout_under(lease, self.pressure)

    def idle_timeout_under(self, lease: Lease, pressure: Pressure | None) -> tuple[float, bool]:
        """The lease's idle timeout under ``pressure``, and whether it is the pressure one: the request at the
        head of the queue would fit on this lease's GPUs with the free GPUs of its node (then
        ``pressure_idle_timeout_seconds``, or with ``pressure_learns_pauses`` the median of the holder's last
        pauses if longer; never above the lease's own timeout)."""
        own = lease.idle_timeout_seconds
        if pressure is None or not own:
            return own, False
        short = self._options()[2]
        if short >= own:
            return own, False
        if not pressure.serves(lease.devices, lease.node):
            return own, False
        short = max(short, self.usual_pause(lease))  # so that a notebook between its cells keeps its GPU
        if short >= own:
            return own, False
        return short, True

    def _options(self) -> tuple[int, float, float, bool]:
        """(the policy's generation, ``idle_mark_seconds``, ``pressure_idle_timeout_seconds``,
        ``pressure_learns_pauses``), read again only when the policy reloaded (``LeasePolicy.generation``: every
        option change, SIGHUP), not on every activity and every holding lease's idle timeout: on the 3,000-job version
        of the overloaded month replay (benchmarks/replay_month.py) ``resumed`` went from 1.6 us to 1.0 us a call
        (with its test of ``warned`` first) and ``idle_timeout`` from 1.1 to 0.9 us (the month makes 1.03 M
        activities: about 0.6 s)."""
        values = self._values
        if values[0] != self.policy.generation:
            pol = self.policy
            values = self._values = (pol.generation, pol.idle_mark_seconds, pol.pressure_idle_timeout_seconds,
                                     pol.pressure_learns_pauses)
        return values

    def usual_pause(self, lease: Lease) -> float:
        """With ``pressure_learns_pauses``, the median of the holder's last pauses (0 without one or the option)."""
        pauses = lease.pauses if self._options()[3] else ()
        return statistics.median(pauses) if pauses else 0.0

    def _warn(self, lease: Lease, kind: str, deadline: float) -> None:
        log.info("Lease %s warned: %s at %.0f, user %s", lease.id, kind, deadline, lease.user)
        self.ops.commit(lease, Change(warned=lease.warned | {kind}))
        kind = kind.split(":")[0]  # "idle:pressure" is an idle warning given again, sooner, under pressure
        self.ops.publish(
            "warning", lease_id=lease.id, user=lease.user, kind=kind, deadline=deadline,
            message=f"Lease {lease.id} will be {'revoked for idleness' if kind == 'idle' else 'expired'} "
            f"in {max(0.0, deadline - self.clock.now()):.0f} s",
        )

    def _escalate(self, now: float) -> None:
        for lease_id, (deadline, pids) in list(self.kills.items()):
            alive = {p: t for p, t in pids.items() if _alive(p, t)}
            if not alive:
                del self.kills[lease_id]
            elif now >= deadline:
                for pid, ticks in alive.items():
                    if signal_group(pid, ticks, signal.SIGKILL):
                        log.info("Lease %s: SIGKILL to process group of %s after term_timeout", lease_id, pid)
                del self.kills[lease_id]

    def _drain(self, now: float) -> None:
        freed = []
        for gpu_id, (lease_id, since, pids) in list(self.draining.items()):
            if self.probe.is_drained(gpu_id, pids, self.state.samples):
                del self.draining[gpu_id]
                self.store.drained(gpu_id)
                freed.append(gpu_id)
                log.info("GPU %s drained after lease %s (%.2f s)", gpu_id, lease_id, now - since)
            elif now - since > max(self.policy.drain_timeout, 2 * self.policy.term_timeout):
                del self.draining[gpu_id]
                self.store.drained(gpu_id)
                self.unhealthy[gpu_id] = f"processes of lease {lease_id} still on it after {now - since:.0f} s"
                log.error("GPU %s unhealthy: %s", gpu_id, self.unhealthy[gpu_id])
                self.ops.publish("gpu_unhealthy", gpu_id=gpu_id, message=self.unhealthy[gpu_id], user=None)
        if freed:
            self.ops.schedule_soon()
            self.ops.gpus_changed()


def _alive(pid: int, ticks: int) -> bool:
    info = proc_info(pid)
    return info is not None and (not ticks or info.start_ticks == ticks)


def _descendants(pids: list[int]) -> set[int]:
    if not pids:
        return set()
    kids = children_map()
    out: set[int] = set()
    todo = list(pids)
    while todo:
        for child in kids.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out
