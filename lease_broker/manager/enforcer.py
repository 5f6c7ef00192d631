"""The enforcer: time limits, heartbeats, idleness, and stopping a lease's processes.

When a lease ends, its process groups get SIGTERM, then SIGKILL after
``term_timeout``; its GPUs stay *draining* until the inventory says they are clean,
and only then can be granted again.
"""

from __future__ import annotations

import logging
import signal
from typing import TYPE_CHECKING

from ..core.lease import HOLDING, Lease, LeaseState
from ..host.procs import children_map, proc_info, signal_group
from .gpuwatch import GpuWatch

if TYPE_CHECKING:
    from .manager import LeaseManager

log = logging.getLogger("lease_broker")


class Enforcer:
    def __init__(self, manager: "LeaseManager") -> None:
        self.m = manager
        self.proc_ticks: dict[str, dict[int, int]] = {}  # lease id -> pid -> start ticks
        self.draining: dict[str, tuple[str, float, list[int]]] = {}  # gpu -> (lease, since, pids)
        self.unhealthy: dict[str, str] = {}  # gpu -> why
        self.kills: dict[str, tuple[float, dict[int, int]]] = {}  # lease -> (SIGKILL deadline, pids)
        self.warned: dict[str, set[str]] = {}  # lease -> warnings sent
        self.watch = GpuWatch(manager)

    # ---------------------------------------------------------------- processes
    def remember(self, lease_id: str, pids: dict[int, int]) -> None:
        self.proc_ticks.setdefault(lease_id, {}).update(pids)

    def stop(self, lease: Lease) -> None:
        """SIGTERM a lease's process groups; drain its GPUs until they are gone."""
        known = self.proc_ticks.pop(lease.id, None)  # None: never attached nor restored, nothing stored
        pids = known or {}
        self.warned.pop(lease.id, None)
        alive = {p: t for p, t in pids.items() if _alive(p, t)}
        now = self.m.clock.now()
        # the GPU is clean only when the descendants are gone too (they may have left the process group)
        # (only live ones: a dead pid may since belong to an unrelated process, which must not hold the GPU)
        drain_pids = sorted(set(alive) | _descendants(list(alive)))
        if alive:
            for pid, ticks in alive.items():
                if signal_group(pid, ticks, signal.SIGTERM):
                    log.info("Lease %s ended: SIGTERM to process group of %s", lease.id, pid)
            self.kills[lease.id] = (now + self.m.policy.term_timeout, alive)
        devices = list(lease.devices)
        samples = self.m.samples
        dirty = [d for d in devices if alive or not self.m.inventory.is_drained(d, drain_pids, samples)]
        if dirty:
            for d in dirty:
                self.draining[d] = (lease.id, now, drain_pids)
            self.m.store.drain(dirty, lease.id, drain_pids, now)
        if known is not None:  # a transaction less for the many leases that never attach a process
            self.m.store.detach_all(lease.id)

    def restore_drains(self, drains: dict[str, tuple[str, float, list[int]]]) -> None:
        self.draining.update({g: d for g, d in drains.items() if g in self.m.gpu_by_id})

    def clear_warning(self, lease_id: str, kind: str) -> None:
        warned = self.warned.get(lease_id)
        if warned:
            warned.discard(kind)

    @property
    def busy(self) -> bool:
        """Whether something needs a fast poll (a kill pending or a GPU draining)."""
        return bool(self.kills or self.draining or self.watch.busy)

    # ---------------------------------------------------------------- time
    def tick(self, now: float) -> None:
        m = self.m
        pol = m.policy
        self._escalate(now)
        self.watch.check(now)
        self._drain(now)
        for lease in list(m.leases.values()):
            if lease.state not in HOLDING:
                continue
            if lease.expires_at is not None and now >= lease.expires_at:
                m.end(lease, LeaseState.EXPIRED, "expired")
                continue
            if pol.heartbeat_timeout and lease.request.heartbeat and now - lease.last_heartbeat > pol.heartbeat_timeout:
                m.end(lease, LeaseState.REVOKED, "holder_gone")
                continue
            pids = list(self.proc_ticks.get(lease.id, {}))
            if pids and m.inventory.lease_active(lease.id, pids, m.samples, lease.devices):
                m.activity(lease, now)
            idle_for = now - lease.last_activity
            if lease.idle_timeout_seconds and idle_for >= lease.idle_timeout_seconds:
                m.end(lease, LeaseState.REVOKED, "idle")
                continue
            if lease.state != LeaseState.IDLE and idle_for >= min(pol.idle_mark_seconds, lease.idle_timeout_seconds or 1e18):
                m.transition(lease, LeaseState.IDLE, "no_activity")
            warned = self.warned.setdefault(lease.id, set())
            if (
                lease.idle_timeout_seconds
                and "idle" not in warned
                and idle_for >= lease.idle_timeout_seconds - pol.warn_before_seconds
            ):
                warned.add("idle")
                self._warn(lease, "idle", lease.last_activity + lease.idle_timeout_seconds)
            if (
                lease.expires_at is not None
                and "expiry" not in warned
                and now >= lease.expires_at - pol.warn_before_seconds
            ):
                warned.add("expiry")
                self._warn(lease, "expiry", lease.expires_at)

    def _warn(self, lease: Lease, kind: str, deadline: float) -> None:
        log.info("Lease %s warned: %s at %.0f, user %s", lease.id, kind, deadline, lease.user)
        self.m.events.publish(
            "warning", lease_id=lease.id, user=lease.user, kind=kind, deadline=deadline,
            message=f"Lease {lease.id} will be {'revoked for idleness' if kind == 'idle' else 'expired'} "
            f"in {max(0.0, deadline - self.m.clock.now()):.0f} s",
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
            if self.m.inventory.is_drained(gpu_id, pids, self.m.samples):
                del self.draining[gpu_id]
                self.m.store.drained(gpu_id)
                freed.append(gpu_id)
                log.info("GPU %s drained after lease %s (%.2f s)", gpu_id, lease_id, now - since)
            elif now - since > max(self.m.policy.drain_timeout, 2 * self.m.policy.term_timeout):
                del self.draining[gpu_id]
                self.m.store.drained(gpu_id)
                self.unhealthy[gpu_id] = f"processes of lease {lease_id} still on it after {now - since:.0f} s"
                log.error("GPU %s unhealthy: %s", gpu_id, self.unhealthy[gpu_id])
                self.m.events.publish("gpu_unhealthy", gpu_id=gpu_id, message=self.unhealthy[gpu_id], user=None)
        if freed:
            self.m.schedule()
            self.m._emit_gpus()


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
