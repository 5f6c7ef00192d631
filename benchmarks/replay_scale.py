"""Replay at scale: a month of overloaded batch traffic (30,000 jobs, offered load 3x of 8x8) through the real
scheduler, leasing against the session baseline in the same run.

The trace is generated into a temporary directory by :mod:`benchmarks.overload_trace` (seed 1; 60 users, a Zipf
law, so fair share orders the queue as on a shared cluster). The bar is the design's "a month of overloaded
cluster traffic replays in a minute": the lease-mode replay's wall time. A 3x load takes about three months of
the clock to drain, so the replay covers some 90,000 events and 2,250 full passes over a queue up to 15,000 deep.

The policy is the default but for ``full_pass_seconds`` (:data:`FULL_PASS_SECONDS`): the full scheduling pass
costs O(queue) and the default (every 10 s of the clock) makes nearly every event of this trace run one over a
queue of up to 20,000 requests: measured, 3,476 of the 30,000 jobs done after 342 s, every 1,000 events slower
than the last (hours in all, not a minute).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from traitlets.config import Config

from lease_broker.policy.lease_policy import LeasePolicy
from lease_broker.replay import Cluster, load_trace, replay, summarize

from .overload_trace import generate
from .report import Figure, figure

TITLE = "Replay at scale: 30,000 overloaded jobs on 8x8"
SESSION = "sessions hold max_gpus (today)"
FULL_PASS_SECONDS = 3600.0  # of virtual time; the event pass (head of the queue) still runs at every event


def run(opts: Any) -> list[Figure]:
    quick = bool(getattr(opts, "quick", False))
    jobs, days = (300, 1) if quick else (30000, 30)
    with tempfile.TemporaryDirectory() as tmp:
        path = generate(Path(tmp) / "overload.csv", jobs=jobs, days=days)
        trace = load_trace(path)
    cluster = Cluster(8, 8)
    policy = LeasePolicy(config=Config(LeasePolicy=Config(full_pass_seconds=FULL_PASS_SECONDS)))
    t0 = time.perf_counter()
    lease = summarize(replay(trace, cluster, policy, mode="lease"))  # idle 10m, queue_depth 100
    wall = time.perf_counter() - t0
    t0 = time.perf_counter()
    base = summarize(replay(trace, cluster, policy, mode="session"))
    base_wall = time.perf_counter() - t0
    cmd = (f"python -m benchmarks.overload_trace overload.csv --jobs {jobs} --days {days:g} && "
           f"gpulease replay overload.csv --cluster 8x8 --config C (c.LeasePolicy.full_pass_seconds = "
           f"{FULL_PASS_SECONDS:g})")
    figures = [figure(
        f"replay wall time, {jobs:,} jobs over {days:g} days (load 3x), 8x8, idle 10m, full pass "
        f"{FULL_PASS_SECONDS / 60:g}m", "s", [wall],
        "session-baseline replay of the same trace", [base_wall], bar=None if quick else ("max", "<=", 60.0),
        note=f"`{cmd}`: {lease['events']:,} events, {lease['granted']:,} of {lease['gpu_bursts']:,} jobs granted "
             f"(baseline {base['events']:,} events).",
    )]
    figures.append(figure(
        "held-but-idle GPU-time", "%", [100 * lease["reserved_idle_fraction"]],
        SESSION, [100 * base["reserved_idle_fraction"]],
        note="a job is busy for its whole duration; a lease lingers for its idle timeout (10 min) after it.",
    ))
    for size in ("1", "4", "8"):
        t, b = lease["time_to_gpu_s"].get(size), base["time_to_gpu_s"].get(size)
        if not t or not b:
            continue
        for q in ("p50", "p95"):
            figures.append(figure(f"time to GPU, {size}-GPU jobs, {q}", "h", [t[q] / 3600], SESSION, [b[q] / 3600],
                                  note=f"{t['n']:,} jobs" if q == "p50" else ""))
    for key, label in (("max", "max"), ("p95", "p95 over time")):
        figures.append(figure(f"queue depth, {label}", "requests", [float(lease["queue_depth"][key])],
                              SESSION, [float(base["queue_depth"][key])]))
    c, bc = lease["pass_ms_per_event"], base["pass_ms_per_event"]
    for q in ("p50", "p99"):
        figures.append(figure(
            f"scheduling cost per event, {q}", "ms", [c[q]], SESSION, [bc[q]],
            note=f"wall time of the LeaseManager.schedule() passes an event causes, over the {c['n']:,} events "
                 f"with a pass (baseline {bc['n']:,})" if q == "p50" else "",
        ))
    return figures
