"""Today's baseline for the replay: each session holds ``max_gpus`` from its start to its stop,
first come first served, through the same real LeaseManager as the lease mode (see sim.py)."""

from __future__ import annotations

from typing import Any

from ..core.errors import LeaseError
from ..core.identity import Identity
from ..core.lease import Lease
from ..policy.lease_policy import LeasePolicy
from .model import Cluster, Outcome
from .policy import policy_copy
from .sim import _ARRIVE, _STOP, LINGER_SLACK, OFFSET, _Sim
from .trace import Burst, Session, Trace, TraceError, derive_sessions


class SessionSim(_Sim):
    """Today's baseline: a session holds ``max_gpus`` from its start to its stop."""

    def __init__(self, trace: Trace, cluster: Cluster, policy: LeasePolicy) -> None:
        sessions = list(trace.sessions) or derive_sessions(trace.bursts)
        longest = max((s.stop - s.start for s in sessions), default=0.0) + LINGER_SLACK
        policy = policy_copy(
            policy, max_duration_seconds=max(policy.max_duration_seconds, longest), default_idle_timeout_seconds=0.0
        )
        super().__init__(trace, cluster, policy, "session", 0.0)
        self.bursts: dict[str, list[Burst]] = {}
        for i, b in enumerate(trace.bursts):
            self.bursts.setdefault(b.session or f"#burst{i}", []).append(b)
        for s in sessions:
            self.push(OFFSET + s.start, _ARRIVE, s)
        self.total = len(sessions)

    def handle(self, kind: int, payload: tuple[Any, ...]) -> None:
        if kind == _ARRIVE:
            (s,) = payload
            self.arrive(s)
        elif kind == _STOP:
            lease, who = payload
            self.m.release(lease.id, who, "session_stopped")
            self.collect()

    def plan(self, s: Session) -> tuple[list[tuple[Burst, float]], float]:
        """The session's GPU bursts with their start times, one cell at a time, and when it stops.

        Cells run in order (a cell that would overlap the previous one starts when it ends, and the
        later ones move with it), never before the session starts; the session holds its GPUs until
        its stop or its last cell's end, whichever is later.
        """
        plan: list[tuple[Burst, float]] = []
        prev_end, shift = s.start, 0.0
        for b in sorted(self.bursts.get(s.id, []), key=lambda b: b.start):
            start = max(b.start + shift, prev_end)
            shift = start - b.start
            prev_end = start + b.duration
            if b.gpus == 0:
                self.run.cpu_bursts += 1
                continue
            if s.max_gpus == 0:
                raise TraceError(
                    f"{self.trace.bursts_file}:{b.line}: num_gpus={b.gpus} in session {s.id!r}, which has max_gpus=0"
                )
            plan.append((b, start))
        return plan, max(s.stop, prev_end)

    def arrive(self, s: Session) -> None:
        who = Identity(s.user or s.id)
        plan, stop = self.plan(s)
        if s.max_gpus == 0:
            self.done += 1
            return
        try:
            self.request(who, s.max_gpus, stop - s.start + LINGER_SLACK, 0.0, (s, who, plan, stop))
        except LeaseError as e:
            raise TraceError(
                f"{self.trace.sessions_file}:{s.line}: session {s.id!r}: the broker refuses it: {e.message}"
            ) from None

    def granted(self, lease: Lease, then: Any) -> None:
        s, who, plan, stop = then
        self.done += 1
        delay = self.clock.now() - OFFSET - s.start
        held = len(lease.devices)
        first = True
        for b, start in plan:
            n = min(b.gpus, held)
            self.run.busy_gpu_seconds += n * b.duration
            # the session's wait for its GPUs is its first GPU cell's time to GPU; later cells find them held
            self.run.outcomes.append(
                Outcome(b.owner, n, b.duration, start + delay, wait=delay if first else 0.0, first=first, granted=True)
            )
            first = False
        self.push(OFFSET + stop + delay, _STOP, lease, who)
