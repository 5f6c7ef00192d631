"""What users used: decayed past GPU-seconds for fair share (ended leases from the store, plus running ones)
and the usage report (GPU-hours held and busy, leases, revocations)."""

from __future__ import annotations

from typing import Any

from ..core.fairshare import FairShare
from ..core.identity import Identity
from ..policy.lease_policy import LeasePolicy
from ..store.admin_store import AdminStore
from .preemption import REASON as PREEMPTED
from .state import LiveState


class Usage:
    def __init__(self, state: LiveState, policy: LeasePolicy, store: AdminStore) -> None:
        self.state, self.policy, self.store = state, policy, store
        self._fairshare = FairShare(policy.fairshare_half_life_seconds)

    def fairshare(self, now: float, users: set[str] | None = None) -> dict[str, float]:
        """Decayed past GPU-seconds per user; only of ``users`` when given (a pass needs those of the waiting
        requests only)."""
        fs = self._fairshare
        if fs.half_life != self.policy.fairshare_half_life_seconds:
            fs = self._fairshare = FairShare(self.policy.fairshare_half_life_seconds)
        table = self.state.table
        left = table.take_left()  # leases that stopped holding since the last call
        if not fs.loaded:
            holding = {lid for by_user in table.holding_by_user.values() for lid in by_user}
            ended = [(u, g, a, e) for lid, u, g, a, e, _ in self.store.held_intervals(0.0)
                     if e is not None and lid not in holding]
            fs.load(ended, now)
        else:
            fs.decay_to(now)
            for user, gpus, granted_at, ended_at in left:  # ended since the last call: to the ended total
                if granted_at is not None and ended_at is not None:
                    fs.add(user, gpus, granted_at, ended_at, now=now)
        fs.decay_to(now)
        usage = dict(fs.ended) if users is None else {u: fs.ended[u] for u in users if u in fs.ended}
        for user, running in table.running_usage(table.holding_by_user if users is None else users, now,
                                                 fs.half_life).items():
            usage[user] = usage.get(user, 0.0) + running
        return usage

    def report(self, who: Identity, since: float, now: float) -> list[dict[str, Any]]:
        """Per user since ``since``: GPU-hours held, GPU-hours busy (active), leases, revocations."""
        out: dict[str, dict[str, Any]] = {}
        for row in self.store.usage_rows(since):
            if not who.admin and row["user"] != who.user:
                continue
            u = out.setdefault(row["user"], {"user": row["user"], "gpu_hours_held": 0.0, "gpu_hours_busy": 0.0,
                                             "leases": 0, "revocations": 0, "preempted": 0})
            end = row["ended_at"] if row["ended_at"] is not None else now
            u["gpu_hours_held"] += row["gpus"] * max(0.0, end - max(row["granted_at"], since)) / 3600
            trans = row["transitions"] + [("", end)]
            for (state, at), (_, nxt) in zip(trans, trans[1:], strict=False):
                if state == "active":
                    u["gpu_hours_busy"] += row["gpus"] * max(0.0, min(nxt, end) - max(at, since)) / 3600
            u["leases"] += 1
            u["revocations"] += row["state"] == "revoked"
            u["preempted"] += row["reason"] == PREEMPTED
        return sorted(out.values(), key=lambda u: -u["gpu_hours_held"])
