"""Figures of one replay: idle reserved GPU-time, time to GPU, re-grants, gang blocking, fairness."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from .accuracy import accuracy
from .model import Run


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def jain(values: Sequence[float]) -> float:
    """Jain's fairness index: 1 when all equal, 1/n when one gets everything."""
    if not values:
        return math.nan
    s, s2 = sum(values), sum(v * v for v in values)
    return 1.0 if s2 == 0 else s * s / (len(values) * s2)


def weighted_percentile(weights: dict[int, float], q: float) -> float:
    """The value below which ``q`` % of the total weight lies (``weights``: value -> weight); NaN if none."""
    total = sum(weights.values())
    if total <= 0:
        return math.nan
    acc = 0.0
    for value in sorted(weights):
        acc += weights[value]
        if acc >= total * q / 100.0:
            return float(value)
    return float(max(weights))


def _ttg(waits: Sequence[float]) -> dict[str, float]:
    return {"n": len(waits), "p50": percentile(waits, 50), "p95": percentile(waits, 95),
            "p99": percentile(waits, 99), "max": max(waits) if waits else math.nan}


def summarize(run: Run) -> dict[str, Any]:
    """The run's figures as a JSON-able dict (times in seconds, fractions in 0..1)."""
    reserved = 0.0
    for lease in run.leases:
        if lease.granted_at is not None and lease.ended_at is not None:
            reserved += len(lease.devices) * (lease.ended_at - lease.granted_at)
    reserved += run.suspended_held_gpu_s  # (a suspended lease's grant time is its last resume)
    horizon = max(run.end - run.start, 1e-9)
    cluster_time = run.cluster.total * horizon
    outcomes = run.outcomes
    by_size: dict[str, list[float]] = {}
    for o in outcomes:
        by_size.setdefault(str(o.gpus), []).append(o.wait)
    later = [o for o in outcomes if not o.first]
    regranted = sum(1 for o in later if o.regranted)
    cold = sum(1 for o in later if not o.warm and not o.regranted and not o.resumed)  # a resume loses nothing
    per_owner: dict[str, list[float]] = {}
    for o in outcomes:
        acc = per_owner.setdefault(o.owner, [0.0, 0.0])
        acc[0] += o.duration
        acc[1] += o.duration + o.wait
    shares = [a / b if b > 0 else 1.0 for a, b in per_owner.values()]
    return {
        "mode": run.mode,
        "cluster": str(run.cluster),
        "gpus": run.cluster.total,
        "idle_timeout_s": run.idle_timeout if run.mode == "lease" else None,
        "gpu_bursts": len(outcomes),
        "granted": sum(1 for o in outcomes if o.granted),
        "cpu_bursts": run.cpu_bursts,
        "leases": len(run.leases),
        "reserved_gpu_s": reserved,
        "busy_gpu_s": run.busy_gpu_seconds,
        "reserved_idle_fraction": 1.0 - run.busy_gpu_seconds / reserved if reserved > 0 else 0.0,
        "time_to_gpu_s": {"all": _ttg([o.wait for o in outcomes]),
                          **{k: _ttg(v) for k, v in sorted(by_size.items(), key=lambda kv: int(kv[0]))}},
        "warm_grants": sum(1 for o in outcomes if o.warm),
        "warm_regrants": regranted,  # new leases at once on the GPUs the session's last one gave back
        "cold_regrants": cold,
        "cold_regrant_rate": cold / len(later) if later else 0.0,  # of GPU cells after the session's first
        "cold_regrants_per_cell": cold / (len(outcomes) + run.cpu_bursts) if outcomes else 0.0,  # of all cells
        "renewals_refused": run.renewals_refused,
        "gang_block_gpu_s": run.gang_block_gpu_seconds,
        "gang_block_fraction": run.gang_block_gpu_seconds / cluster_time,
        "allocation": reserved / cluster_time,
        "fairness_jain": jain(shares),
        "owners": len(per_owner),
        "span_s": horizon,
        "events": run.events,
        "queue_depth": {"max": run.queue_max, "p95": weighted_percentile(run.queue_seconds, 95),
                        "p50": weighted_percentile(run.queue_seconds, 50)},  # over virtual time
        "pass_ms_per_event": {"n": len(run.pass_seconds), "p50": 1000 * percentile(run.pass_seconds, 50),
                              "p99": 1000 * percentile(run.pass_seconds, 99),
                              "max": 1000 * max(run.pass_seconds) if run.pass_seconds else math.nan},
        "wall_s": run.wall_seconds,
        "notes": list(run.notes),
        "limits": run.limits if run.mode == "lease" else None,
        "estimates": accuracy(run.told) if run.told else None,  # start estimates against real waits (if recorded)
        "suspension": suspension(run),
    }


#: Request sizes the suspensions are counted by (the lease's GPUs)
SIZES = ((1, 1, "1"), (2, 4, "2-4"), (5, 8, "5-8"), (9, 1 << 30, "9+"))


def _size(gpus: int) -> str:
    return next(name for lo, hi, name in SIZES if lo <= gpus <= hi)


def suspension(run: Run) -> dict[str, Any] | None:
    """The suspensions of a run whose holders were suspendable (None otherwise): how many (by request size, by why,
    of running bursts), the time suspended (GPU-seconds: the lease's GPUs times the time; of running bursts, and
    their share of the bursts' GPU-time), the suspend and resume costs paid, and whether every burst suspended
    while it ran completed."""
    model = run.suspend
    if model is None:
        return None
    recs = run.suspended
    by_size: dict[str, int] = {}
    by_why: dict[str, int] = {}
    for r in recs:
        by_size[_size(r.gpus)] = by_size.get(_size(r.gpus), 0) + 1
        by_why[r.why] = by_why.get(r.why, 0) + 1
    running = [r for r in recs if r.running]
    seconds = [((r.until if r.until is not None else run.end) - r.since, r) for r in recs]
    bursts = [o for o in run.outcomes if o.suspensions]
    running_gpu_s = sum(o.gpus * o.suspended for o in bursts)
    return {
        "source": model.source,
        "suspend_s_per_gib": model.suspend_seconds_per_gib,
        "resume_s_per_gib": model.resume_seconds_per_gib,
        "gib_per_gpu": model.gib_per_gpu,
        "suspensions": len(recs),
        "of_running_bursts": len(running),
        "by_size": {name: by_size[name] for _, _, name in SIZES if name in by_size},
        "running_by_size": {name: n for _, _, name in SIZES
                            if (n := sum(1 for r in running if _size(r.gpus) == name))},
        "by_why": by_why,
        "suspended_s": sum(t for t, _ in seconds),  # lease-seconds, every suspension
        "suspended_gpu_s": sum(t * r.gpus for t, r in seconds),
        "running_suspended_gpu_s": running_gpu_s,  # of bursts suspended while they ran
        "running_suspended_share": running_gpu_s / run.busy_gpu_seconds if run.busy_gpu_seconds else 0.0,
        "suspend_cost_s": sum(r.suspend_cost for r in recs),
        "resume_cost_s": sum(r.resume_cost for r in recs),
        "cost_gpu_s": sum(r.gpus * (r.suspend_cost + r.resume_cost) for r in recs),
        "bursts_suspended": len(bursts),
        "bursts_suspended_completed": sum(1 for o in bursts if o.done),
        "all_completed": all(o.done for o in bursts),
        "delay_s": {"p50": percentile([o.suspended + o.costs for o in bursts], 50),
                    "max": max((o.suspended + o.costs for o in bursts), default=math.nan)},
        "resumed_cells": sum(1 for o in run.outcomes if o.resumed),
    }


def compare(lease: dict[str, Any], baseline: dict[str, Any]) -> dict[str, float]:
    """GPU-time the leasing run gave back against the baseline."""
    base = baseline["reserved_gpu_s"]
    return {
        "reclaimed_fraction": 1.0 - lease["reserved_gpu_s"] / base if base > 0 else 0.0,
        "reclaimed_gpu_s": base - lease["reserved_gpu_s"],
    }
