"""Trace replay: real GPU workload traces through the broker's real scheduler on a virtual clock.

``gpulease replay bursts.csv --sessions sessions.csv --cluster 8x8 --sweep idle=1m,5m,10m,30m``
(or ``python -m lease_broker.replay``) replays each burst as a ``%%gpu`` lease request through a
``LeaseManager`` with a ``VirtualClock``, and compares with sessions that hold their GPUs.
"""

from __future__ import annotations

from .metrics import compare, jain, percentile, summarize
from .model import Cluster, Run, Suspend
from .policy import load_policy
from .run import replay
from .trace import Burst, Session, Trace, TraceError, jitter, load_bursts, load_sessions, load_trace, tile

__all__ = [
    "Burst", "Cluster", "Run", "Session", "Suspend", "Trace", "TraceError", "compare", "jain", "load_bursts", "load_policy",
    "jitter", "load_sessions", "load_trace", "percentile", "replay", "summarize", "tile",
]
