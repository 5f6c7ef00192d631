"""Shared (fractional) leases: the limits a lease's worker gets, and the memory cap the broker enforces.

Several shared leases pack onto one GPU up to ``max_shares_per_gpu`` and its memory (the scheduler). Each
lease's worker gets its limits as environment: ``GPULEASE_MEMORY_LIMIT`` (bytes) and
``GPULEASE_MEMORY_FRACTION`` (of the GPU's memory; the worker applies it to PyTorch when torch is imported),
and, where CUDA MPS runs, ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` and ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``.
The NVML inventory reports each process's GPU memory: a lease whose processes use more than its cap is
revoked with reason ``over_memory_cap`` (its processes are stopped) and the holder gets a message.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from ..host.procs import is_descendant
from ..inventory import GpuSample
from .lease import HOLDING, LeaseRequest, LeaseState

if TYPE_CHECKING:
    from ..manager.manager import LeaseManager

log = logging.getLogger("lease_broker")
REASON = "over_memory_cap"


def memory_cap(req: LeaseRequest, memory_total: int) -> int:
    """Bytes of GPU memory a shared lease may use: what it asked for (--mem), else its fraction of the GPU."""
    return req.mem_bytes or int(req.fraction * memory_total)


def mps_running() -> bool:
    """Whether the CUDA MPS control daemon runs for this host (its control pipe exists)."""
    pipes = os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps"
    return os.path.exists(os.path.join(pipes, "control"))


def shared_env(req: LeaseRequest, memory_total: int, mps: bool) -> dict[str, str]:
    """The environment of a shared lease's worker (its one GPU is device 0 of CUDA_VISIBLE_DEVICES)."""
    cap = memory_cap(req, memory_total)
    env = {"GPULEASE_MEMORY_FRACTION": f"{min(1.0, cap / memory_total):.4g}" if memory_total and cap
           else f"{req.fraction:g}"}
    if cap:
        env["GPULEASE_MEMORY_LIMIT"] = str(cap)
    if mps:
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(max(1, int(round(req.fraction * 100))))
        if cap:
            env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={max(1, cap >> 20)}M"
    return env


def check_memory_caps(m: LeaseManager, samples: dict[str, GpuSample]) -> None:
    """Revoke shared leases whose processes (and their descendants) use more GPU memory than their cap."""
    if not m.policy.enforce_memory_caps:
        return
    for lease in list(m.leases.values()):
        if lease.state not in HOLDING or not lease.request.shared or not lease.devices:
            continue
        gpu = m.gpu_by_id.get(lease.devices[0])
        s = samples.get(lease.devices[0])
        if gpu is None or s is None or not s.pids:
            continue
        roots = list(m.enforcer.proc_ticks.get(lease.id, {})) or list(lease.pids)
        if not roots:
            continue
        used = {pid: mem for pid, mem in s.pids.items() if any(is_descendant(pid, r) for r in roots)}
        cap = memory_cap(lease.request, gpu.memory_total)
        total = sum(used.values())
        if cap and total > cap:
            message = (f"Lease {lease.id} used {total >> 20} MiB of GPU memory, over its cap of {cap >> 20} MiB "
                       f"(a shared GPU: ask for more with --mem, or use a whole GPU); its processes were stopped")
            log.info("Lease %s of %s over its memory cap on GPU %s: %s", lease.id, lease.user, gpu.index,
                     ", ".join(f"pid {p}: {b >> 20} MiB" for p, b in sorted(used.items())))
            m.events.publish("lease.memory_exceeded", lease_id=lease.id, user=lease.user, gpu_id=gpu.id,
                             memory=total, limit=cap, message=message)
            m.end(lease, LeaseState.REVOKED, REASON)
