"""Quotas and limits checked against what leases hold: daily GPU-hours budgets (rolling 24 h), renewals
(max duration, reservations, daily quota) and gangs that no node can hold."""

from __future__ import annotations

import math
from typing import Any

from gpulease_protocol.words import clock_text, duration_text, gpus_text, hours_text

from ..core.errors import BadRequest, Forbidden
from ..core.gpufit import beyond_caps, constrained, unplaceable
from ..core.lease import HOLDING, Lease, LeaseRequest
from ..core.reservation_windows import window_shortfall
from ..policy.lease_policy import LeasePolicy
from ..policy.limits import DAY
from ..store.admin_store import AdminStore
from .enforcer import Enforcer
from .reservations import Reservations
from .state import LiveState


class Quotas:
    def __init__(self, *, state: LiveState, policy: LeasePolicy, store: AdminStore, reservations: Reservations,
                 enforcer: Enforcer) -> None:
        self.state, self.policy, self.store = state, policy, store
        self.reservations, self.enforcer = reservations, enforcer

    def day_budget(self, now: float, users: set[str]) -> dict[str, float] | None:
        """GPU-seconds each user (and "@group") may still be granted in the rolling 24 h, or None (no quotas)."""
        pol = self.policy
        if not pol.quotas_configured():
            return None
        charged, _ = self.charged(now)
        budget: dict[str, float] = {}
        for user in users:
            for key, seconds in pol.day_quotas(user).items():
                budget[key] = seconds - charged.get(key, 0.0)
        return budget

    def charged(self, now: float) -> tuple[dict[str, float], dict[str, float]]:
        """GPU-seconds charged in the rolling 24 h to each user and "@group", and when each one's earliest charge
        in the window leaves it (what is left starts to refill then)."""
        cutoff = now - DAY
        leases = self.state.leases
        charged: dict[str, float] = {}
        refills: dict[str, float] = {}
        for lid, user, gpus, start, ended, expires in self.store.held_intervals(cutoff):
            live = leases.get(lid)
            if live is not None and live.state in HOLDING:
                end = max(live.expires_at or now, now)  # running: its whole time limit is committed
            else:  # ended: the time it held, up to its time limit (stopping it late is not the user's use)
                end = min(e for e in (ended, expires, now) if e is not None)
            secs = gpus * max(0.0, end - max(start, cutoff))
            if secs <= 0:
                continue
            for key in (user, *("@" + g for g in self.policy.groups_of(user))):
                charged[key] = charged.get(key, 0.0) + secs
                refills[key] = min(refills.get(key, math.inf), max(start, cutoff) + DAY)
        return charged, refills

    def view(self, user: str, now: float) -> dict[str, Any]:
        """What is left of each limit and budget that applies to ``user`` (``GET /api/v1/quota``): GPUs at once (the
        user's and each group's) and GPU-hours in the rolling 24 h (the user's and each group's), in numbers and
        in words."""
        pol = self.policy
        held = self.state.table.held_by_user
        charged, refills = self.charged(now)
        limits: list[dict[str, Any]] = []

        def gpus(name: str, whose: str, used: float, cap: float) -> None:
            text = (f"{whose} {used:g} of {gpus_text(cap)} at once" if cap > 0
                    else f"{whose} {gpus_text(used)}; no limit at once")
            limits.append({"name": name, "text": text, "used": used, "limit": cap or None, "unit": "gpus",
                           "refills_at": None})

        def hours(name: str, whose: str, key: str, quota: float) -> None:
            used, refill = charged.get(key, 0.0), refills.get(key)
            text = f"{whose} {hours_text(used)} in the last 24 h"
            if quota > 0:
                text = (f"{whose} {hours_text(used)} of {hours_text(quota)} in the last 24 h, "
                        f"{hours_text(max(0.0, quota - used))} left")
            else:
                text += "; no daily limit"
            if refill is not None and used > 0:
                text += f"; refills from {clock_text(refill, now)}"
            limits.append({"name": name, "text": text, "used": round(used / 3600.0, 4),
                           "limit": round(quota / 3600.0, 4) if quota > 0 else None, "unit": "gpu_hours",
                           "refills_at": refill if used > 0 else None})

        gpus("gpus", "you hold", held.get(user, 0.0), pol.user_cap(user))
        quotas = pol.day_quotas(user)
        hours("gpu_hours", "you used", user, quotas.get(user, 0.0))
        for g in pol.groups_of(user):
            members = sum(n for u, n in held.items() if g in pol.groups_of(u))
            cap = pol.group_cap(g)
            if cap > 0:
                gpus(f"group_gpus:{g}", f"group {g} holds", members, cap)
            if "@" + g in quotas:
                hours(f"group_gpu_hours:{g}", f"group {g} used", "@" + g, quotas["@" + g])
        return {"user": user, "limits": limits}

    def check_placeable(self, req: LeaseRequest, user: str) -> None:
        """Refuse a gang that no node can ever hold, more memory than any GPU has, a GPU type or size that no
        device has, or only devices of types the user is capped below it for (it would wait forever), naming what
        exists."""
        table, aliases = self.state.table, self.policy.gpu_type_aliases()
        if constrained(req) or (req.max_gpus > 1 and not req.shared and any(k.mig for k in table.kinds)):
            why = unplaceable(req, table.kinds, aliases)
            if why is not None:
                raise BadRequest(why, reason="no_such_gpu" if constrained(req) else "too_large")
        why = beyond_caps(req, table.kinds, aliases, self.policy.type_caps(user))
        if why is not None:
            raise Forbidden(why, reason="quota")
        largest = self.state.table.largest_memory
        if req.mem_bytes and largest and req.mem_bytes > largest:
            raise BadRequest(f"Request for mem={req.mem_bytes / 2**30:.4g}G can never be granted: the largest GPU has "
                             f"{largest / 2**30:.4g}G", reason="too_large")
        if req.shared or req.locality != "node":
            return
        biggest = self.state.table.biggest_node
        if req.min_gpus > biggest:
            raise BadRequest(
                f"Request for {req.min_gpus} GPUs on one node can never be granted: the largest node has {biggest}; "
                "ask for fewer, or let the GPUs span nodes (locality 'any', `gpulease request --spread`)",
                reason="too_large",
            )

    def check_renewal(self, lease: Lease, new_expiry: float, now: float) -> None:
        """Refuse a renewal past max_duration_seconds from the grant (reason ``max_duration``), into GPUs a
        reservation needs (``reserved``), or over the holder's (or a group's) daily GPU-hours (``quota``)."""
        max_duration = float(self.policy.limit(lease.user, "max_duration_seconds"))
        limit = (lease.granted_at or now) + max_duration
        if new_expiry > limit + 1e-6:
            raise Forbidden(
                f"Renewal refused: lease {lease.id} may hold its GPUs for at most {duration_text(max_duration)} from "
                f"its grant, until {clock_text(limit, now)}: at most {duration_text(max(0.0, limit - now))} more",
                reason="max_duration", extra={"max_expires_at": limit},
            )
        wins = self.reservations.windows(now) if self.reservations.live else []
        if wins:  # not into a reservation that would then lack GPUs at its start (unless a member holds it)
            ix = self.enforcer.slot_index(now)  # a fork: the renewal is tried on its own copies of the lease's slots
            before = window_shortfall(ix.all(), wins, now)
            for d in lease.devices:
                if d in ix.by_id:
                    s = ix.edit(d)
                    s.free_at = max(s.free_at, new_expiry)
            after = window_shortfall(ix.all(), wins, now)
            w = next((w for w in sorted(wins, key=lambda w: w.start) if after[w.id] > before[w.id]), None)
            if w is not None:
                raise Forbidden(
                    f"Renewal refused: {gpus_text(w.gpus)} are reserved from {clock_text(w.start, now)} "
                    f"(reservation {w.id}) and this lease's GPUs are needed for it; renew until then at most "
                    f"({duration_text(max(0.0, w.start - now))} from now)",
                    reason="reserved", extra={"max_expires_at": w.start},
                )
        extra = lease.gpu_count * max(0.0, new_expiry - max(lease.expires_at or now, now))
        for key, left in (self.day_budget(now, {lease.user}) or {}).items():
            if extra > left + 1e-6:
                raise Forbidden(
                    f"Renewal refused: {hours_text(extra)} more exceed what is left of the daily GPU-hours of "
                    f"{'group ' if key.startswith('@') else ''}{key.lstrip('@')} in the last 24 h "
                    f"({hours_text(left)})",
                    reason="quota",
                )
