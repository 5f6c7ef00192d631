"""Shared (fractional) leases: the limits a lease's worker gets, and its memory cap (enforced by the GpuWatch).

Several shared leases pack onto one GPU up to ``max_shares_per_gpu`` and its memory (the scheduler). Each
lease's worker gets its limits as environment: ``GPULEASE_MEMORY_LIMIT`` (bytes) and
``GPULEASE_MEMORY_FRACTION`` (of the GPU's memory; the worker applies it to PyTorch when torch is imported),
and, where CUDA MPS runs, ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` and ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``.
The NVML inventory reports each process's GPU memory: a lease whose processes use more than its cap is
revoked with reason ``over_memory_cap`` (its processes are stopped) and the holder gets a message.
"""

from __future__ import annotations

from .gpu import GPU
from .lease import Lease, LeaseRequest


def memory_cap(req: LeaseRequest, memory_total: int) -> int:
    """Bytes of GPU memory a shared lease may use: what it asked for (--mem), else its fraction of the GPU."""
    return req.mem_bytes or int(req.fraction * memory_total)


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


def held_memory(lease: Lease, gpus: dict[str, GPU]) -> int:
    """Bytes of GPU memory a lease held: its cap on a shared GPU, else its devices' memory."""
    devices = [gpus[d] for d in lease.devices if d in gpus]
    if lease.request.shared:
        return memory_cap(lease.request, devices[0].memory_total) if devices else lease.request.mem_bytes
    return sum(g.memory_total for g in devices)
