"""Replaying a trace through the real scheduler: the lease mode (sim.py) or today's session baseline
(baseline.py), chosen by ``mode``."""

from __future__ import annotations

import logging
import time

from ..policy.lease_policy import LeasePolicy
from .baseline import SessionSim
from .model import Cluster, Progress, Run, Suspend
from .sim import _LeaseSim, _Sim
from .trace import Trace, TraceError, check_fits


def replay(
    trace: Trace, cluster: Cluster, policy: LeasePolicy | None = None, *, mode: str = "lease", idle: float = 600.0,
    progress: Progress | None = None, limits: str = "oracle", estimates: bool = False, suspend: Suspend | None = None,
) -> Run:
    """Replay ``trace`` on ``cluster`` under ``policy``: ``mode`` is ``lease`` or ``session``; ``progress``
    is called now and then with the mode and the work items (bursts, or sessions) done of the total; ``limits``:
    the time limits the lease mode's requests ask for (``sim.LIMITS``); ``estimates``: record the start estimate
    each request that queues is told (``Run.told``; it costs a walk of the head of the queue per such request);
    ``suspend``: how the lease mode's holders suspend (``Suspend``: suspendable when the policy's ``preempt_mode`` is
    "suspend", unless it says; the costs per GiB)."""
    policy = policy or LeasePolicy()
    check_fits(trace, cluster.total)
    if not trace.bursts:
        raise TraceError("the trace has no bursts")
    t0 = time.perf_counter()
    logger = logging.getLogger("lease_broker")
    level = logger.level
    logger.setLevel(logging.WARNING)  # one INFO line per transition would dominate the run time
    try:
        sim: _Sim
        if mode == "lease":
            sim = _LeaseSim(trace, cluster, policy, idle, limits, estimates, suspend)
        elif mode == "session":
            sim = SessionSim(trace, cluster, policy)
        else:
            raise ValueError(f"Unknown replay mode {mode!r}: use 'lease' or 'session'")
        sim.loop(progress)
    finally:
        logger.setLevel(level)
    sim.run.wall_seconds = time.perf_counter() - t0
    return sim.run
