"""Watching what really runs on the GPUs: lost devices and processes that hold no lease.

A process on a GPU that is neither a process attached to a lease holding (or draining)
that GPU nor a descendant of one is *unleased*: it is reported once (an event, a log
line), shown in the GPU view and counted in the metrics for as long as it runs, and,
where policy says ``kill`` and the broker has the right (same uid, or root), stopped
with SIGTERM, then SIGKILL after ``term_timeout``.
"""

from __future__ import annotations

import logging
import os
import pwd
import signal
from typing import Any, Protocol

from ..core.clock import Clock
from ..core.fractional import memory_cap
from ..core.gpu import GpuSample
from ..core.identity import Identity
from ..core.lease import HOLDING, LeaseState
from ..host.procs import is_descendant, proc_info
from ..policy.lease_policy import LeasePolicy
from .state import LeaseOps, LiveState


class Enforcement(Protocol):
    """What the watch reads and marks of the enforcer's records."""

    unhealthy: dict[str, str]
    draining: dict[str, tuple[str, float, list[int]]]

log = logging.getLogger("lease_broker")
OVER_MEMORY_CAP = "over_memory_cap"


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


class GpuWatch:
    def __init__(self, *, state: LiveState, ops: LeaseOps, policy: LeasePolicy, clock: Clock,
                 enforcer: Enforcement) -> None:
        self.state, self.ops, self.policy, self.clock, self.enforcer = state, ops, policy, clock, enforcer
        self.unleased: dict[str, dict[int, dict[str, Any]]] = {}  # gpu -> pid -> report
        self.kills_total = 0
        self._reported: set[tuple[str, int, int]] = set()  # (gpu, pid, start ticks)
        self._kills: dict[int, tuple[float, int]] = {}  # pid -> (SIGKILL deadline, start ticks)
        self._last_samples: object = None

    def check(self, now: float) -> None:
        self._escalate(now)
        samples = self.state.samples
        if samples is self._last_samples:
            return  # nothing new from the inventory since the last tick
        self._last_samples = samples
        enf = self.enforcer
        for gpu_id, s in samples.items():
            if not s.healthy and gpu_id not in enf.unhealthy and gpu_id in self.state.gpu_by_id:
                enf.unhealthy[gpu_id] = "lost: NVML does not answer for it"
                log.error("GPU %s unhealthy: %s", gpu_id, enf.unhealthy[gpu_id])
                self.ops.publish("gpu_unhealthy", gpu_id=gpu_id, message=enf.unhealthy[gpu_id], user=None)
                self.ops.gpus_changed()
        owners = self._owners()
        for gpu_id, s in samples.items():
            current: dict[int, dict[str, Any]] = {}
            for pid, memory in s.pids.items():
                if any(is_descendant(pid, a) for a in owners.get(gpu_id, ())):
                    continue
                current[pid] = self._report(gpu_id, pid, memory)
            if current or gpu_id in self.unleased:
                self.unleased[gpu_id] = current
        self._check_memory_caps(samples)  # shared leases over their memory cap are stopped

    def _owners(self) -> dict[str, list[int]]:
        """Per GPU, the pids whose process trees may use it: leases holding it, leases draining from it."""
        out: dict[str, list[int]] = {}
        for lease in self.state.leases.values():
            if lease.state in HOLDING:
                pids = lease.pids
                for d in lease.devices:
                    out.setdefault(d, []).extend(pids)
            elif lease.state == LeaseState.SUSPENDED and lease.suspension is not None:  # (stopped: not unleased)
                for d in lease.suspension.devices:
                    out.setdefault(d, []).extend(lease.pids)
        for gpu_id, (_lease, _since, pids) in self.enforcer.draining.items():
            out.setdefault(gpu_id, []).extend(pids)
        return out

    def _report(self, gpu_id: str, pid: int, memory: int) -> dict[str, Any]:
        info = proc_info(pid)
        uid = info.uid if info is not None else -1
        user = _user_name(uid) if info is not None else "?"
        report = {"pid": pid, "user": user, "uid": uid, "memory": memory, "gpu_id": gpu_id}
        key = (gpu_id, pid, info.start_ticks if info is not None else 0)
        if key in self._reported:
            return report
        self._reported.add(key)
        gpu = self.state.gpu_by_id.get(gpu_id)
        action = self.policy.unleased_process_action
        log.warning("GPU %s (index %s) has unleased process %d of user %s using %d MiB: %s", gpu_id,
                    gpu.index if gpu else "?", pid, user, memory >> 20, action)
        self.ops.publish(
            "gpu.unleased_process", gpu_id=gpu_id, pid=pid, process_user=user, memory=memory, action=action,
            user=user if info is not None else "", index=gpu.index if gpu else None,
            message=f"Process {pid} of {user} uses GPU {gpu.index if gpu else gpu_id} without a lease",
        )
        if action == "kill":
            self._kill(pid, info, gpu_id)
        return report

    def _kill(self, pid: int, info: Any, gpu_id: str) -> None:
        if info is None:
            log.warning("GPU %s: cannot stop unleased process %d: it is not visible in /proc here", gpu_id, pid)
            return
        if os.geteuid() != 0 and info.uid != os.geteuid():
            log.warning("GPU %s: not stopping unleased process %d of uid %d: the broker runs as uid %d, not root",
                        gpu_id, pid, info.uid, os.geteuid())
            return
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        self.kills_total += 1
        log.info("GPU %s: SIGTERM to unleased process %d of uid %d", gpu_id, pid, info.uid)
        self._kills[pid] = (self.clock.now() + self.policy.term_timeout, info.start_ticks)

    def retime(self, step: float) -> None:
        """The wall clock stepped ``step`` seconds: the SIGKILL deadlines move by as much."""
        self._kills = {pid: (deadline + step, ticks) for pid, (deadline, ticks) in self._kills.items()}

    def _escalate(self, now: float) -> None:
        for pid, (deadline, ticks) in list(self._kills.items()):
            info = proc_info(pid)
            if info is None or info.start_ticks != ticks:
                del self._kills[pid]
            elif now >= deadline:
                del self._kills[pid]
                try:
                    os.kill(pid, signal.SIGKILL)
                    log.info("SIGKILL to unleased process %d after term_timeout", pid)
                except ProcessLookupError:
                    pass

    @property
    def busy(self) -> bool:
        return bool(self._kills)

    def view(self, gpu_id: str, who: Identity) -> list[dict[str, Any]]:
        """Unleased processes on a GPU: everything for admins and the process's owner; the user name for others."""
        out = []
        for r in self.unleased.get(gpu_id, {}).values():
            if who.admin or r["user"] == who.user:
                out.append({"pid": r["pid"], "user": r["user"], "memory": r["memory"]})
            else:
                out.append({"user": r["user"]})
        return out

    def _check_memory_caps(self, samples: dict[str, GpuSample]) -> None:
        """Revoke shared leases whose processes (and their descendants) use more GPU memory than their cap."""
        if not self.policy.enforce_memory_caps:
            return
        for lease in list(self.state.leases.values()):
            if lease.state not in HOLDING or not lease.request.shared or not lease.devices:
                continue
            gpu = self.state.gpu_by_id.get(lease.devices[0])
            s = samples.get(lease.devices[0])
            if gpu is None or s is None or not s.pids:
                continue
            roots = lease.pids
            if not roots:
                continue
            used = {pid: mem for pid, mem in s.pids.items() if any(is_descendant(pid, r) for r in roots)}
            cap = memory_cap(lease.request, gpu.memory_total)
            total = sum(used.values())
            if cap and total > cap:
                message = (f"Lease {lease.id} used {total >> 20} MiB of GPU memory, over its cap of {cap >> 20} "
                           "MiB (a shared GPU: ask for more with --mem, or use a whole GPU); its processes were "
                           "stopped")
                log.info("Lease %s of %s over its memory cap on GPU %s: %s", lease.id, lease.user, gpu.index,
                         ", ".join(f"pid {p}: {b >> 20} MiB" for p, b in sorted(used.items())))
                self.ops.publish("lease.memory_exceeded", lease_id=lease.id, user=lease.user, gpu_id=gpu.id,
                                    memory=total, limit=cap, message=message)
                self.ops.end(lease, LeaseState.REVOKED, OVER_MEMORY_CAP)
