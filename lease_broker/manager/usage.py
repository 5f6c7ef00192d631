"""What users used: decayed past GPU-seconds for fair share (ended leases from the store, plus running ones)
and the usage report (GPU-hours held and busy, leases, revocations)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from ..core.errors import BadRequest
from ..core.fairshare import FairShare
from ..core.identity import Identity
from ..policy.lease_policy import LeasePolicy
from ..store.admin_store import AdminStore
from .preemption import REASON as PREEMPTED
from .state import LiveState

#: What the usage report groups by.
REPORT_BY = ("user", "group", "label", "notebook")


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
        usage = fs.of(users)
        for user, running in table.running_usage(table.holding_by_user if users is None else users, now,
                                                 fs.half_life).items():
            usage[user] = usage.get(user, 0.0) + running
        return usage

    def report(self, who: Identity, since: float, now: float, by: str = "user", label: str = "") -> list[dict[str, Any]]:
        """Per user (or group, label value, notebook: ``by``) since ``since``: GPU-hours held and busy (active),
        leases, revocations, preemptions, and what the leases used (the highest peak memory, the mean utilisation
        weighted by GPU-hours). A lease counts in each of its user's groups; one without the label under ''."""
        if by not in REPORT_BY:
            raise BadRequest(f"Invalid by {by!r}: use one of {', '.join(REPORT_BY)}")
        if by == "label" and not label:
            raise BadRequest("by=label needs label=KEY, the label to group by (e.g. project)")
        key_of: dict[str, Callable[[dict[str, Any]], Iterable[str]]] = {
            "user": lambda row: (row["user"],),
            "group": lambda row: self.policy.groups_of(row["user"]) or ("",),
            "label": lambda row: (row["labels"].get(label, ""),),
            "notebook": lambda row: (row["labels"].get("notebook", ""),),
        }
        out: dict[str, dict[str, Any]] = {}
        weights: dict[str, tuple[float, float]] = {}  # key -> (GPU-hours with a utilisation figure, their util sum)
        for row in self.store.usage_rows(since):
            if not who.admin and row["user"] != who.user:
                continue
            live = self.state.leases.get(row["id"])
            use = live.use if live is not None else row["use"]  # a live lease's figures are newer than its row
            end = row["ended_at"] if row["ended_at"] is not None else now
            held = row["gpus"] * max(0.0, end - max(row["granted_at"], since)) / 3600
            busy = 0.0
            trans = row["transitions"] + [("", end)]
            for (state, at), (_, nxt) in zip(trans, trans[1:], strict=False):
                if state == "active":
                    busy += row["gpus"] * max(0.0, min(nxt, end) - max(at, since)) / 3600
            for key in key_of[by](row):
                u = out.setdefault(key, {"key": key, "gpu_hours_held": 0.0, "gpu_hours_busy": 0.0, "leases": 0,
                                         "revocations": 0, "preempted": 0, "peak_memory": None,
                                         "mean_utilization": None})
                if by == "user":
                    u["user"] = key
                u["gpu_hours_held"] += held
                u["gpu_hours_busy"] += busy
                u["leases"] += 1
                u["revocations"] += row["state"] == "revoked"
                u["preempted"] += row["reason"] == PREEMPTED
                if use.samples:
                    u["peak_memory"] = max(u["peak_memory"] or 0, use.peak_memory)
                if use.util_mean is not None:
                    w, total = weights.get(key, (0.0, 0.0))
                    weights[key] = (w + held, total + held * use.util_mean)
                    u["mean_utilization"] = round(weights[key][1] / weights[key][0], 2) if weights[key][0] else \
                        round(use.util_mean, 2)
        return sorted(out.values(), key=lambda u: (-u["gpu_hours_held"], u["key"]))
