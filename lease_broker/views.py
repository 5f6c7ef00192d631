"""JSON views of leases and GPUs, with what a caller may see of other users' leases."""

from __future__ import annotations

from typing import Any

from .identity import Identity
from .inventory import GPU, GpuSample
from .lease import Lease


def may_see(lease: Lease, who: Identity) -> bool:
    return who.admin or lease.user == who.user


def lease_view(
    lease: Lease,
    gpus: dict[str, GPU],
    *,
    simulated: bool,
    visible_devices: str = "",
    position: int | None = None,
    estimate: float | None = None,
    idle_deadline: float | None = None,
) -> dict[str, Any]:
    req = lease.request
    devices = [
        {"id": g.id, "index": g.index, "node": g.node, "name": g.name}
        for g in (gpus.get(d) for d in lease.devices)
        if g is not None
    ]
    out: dict[str, Any] = {
        "id": lease.id,
        "user": lease.user,
        "state": lease.state.value,
        "reason": lease.reason,
        "created_at": lease.created_at,
        "granted_at": lease.granted_at,
        "expires_at": lease.expires_at,
        "ended_at": lease.ended_at,
        "devices": devices,
        "node": lease.node,
        "min_gpus": req.min_gpus,
        "max_gpus": req.max_gpus,
        "fraction": req.fraction,
        "mem_bytes": req.mem_bytes,
        "priority": req.priority,
        "locality": req.locality,
        "labels": dict(req.labels),
        "duration_seconds": lease.duration_seconds,
        "idle_timeout_seconds": lease.idle_timeout_seconds,
        "last_activity": lease.last_activity,
        "idle_deadline": idle_deadline,
        "pids": list(lease.pids),
        "simulated": simulated,
        "position": position,
        "estimated_start": estimate,
        "env": {"CUDA_VISIBLE_DEVICES": visible_devices} if lease.devices else {},
    }
    if req.shared:
        out["env"].update(
            {
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(max(1, int(round(req.fraction * 100)))),
                "GPULEASE_MEMORY_FRACTION": f"{req.fraction:g}",
            }
        )
        if req.mem_bytes:
            out["env"]["GPULEASE_MEMORY_LIMIT"] = str(req.mem_bytes)
    return out


def gpu_view(
    gpu: GPU,
    state: str,
    sample: GpuSample | None,
    holders: list[Lease],
    who: Identity,
) -> dict[str, Any]:
    return {
        "id": gpu.id,
        "index": gpu.index,
        "node": gpu.node,
        "name": gpu.name,
        "memory_total": gpu.memory_total,
        "memory_used": sample.memory_used if sample else 0,
        "utilization": sample.utilization if sample else 0.0,
        "link_group": gpu.link_group,
        "simulated": gpu.simulated,
        "mig": gpu.mig,
        "state": state,
        "holders": [
            {
                "user": h.user,
                "lease_id": h.id if may_see(h, who) else None,
                "fraction": h.request.fraction if h.request.shared else 1.0,
                "expires_at": h.expires_at,
                "mine": h.user == who.user,
            }
            for h in holders
        ],
    }
