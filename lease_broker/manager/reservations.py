"""Advance reservations: N GPUs for a user or a group during a time window.

Before the window, other leases get those GPUs only if they end before it starts; during it, only the
reservation's members get them (the scheduler's ``Window``). Persisted in the store's ``reservations`` table.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Iterable
from typing import Any

from gpulease_protocol.requests import MAX_SECONDS, quoted

from ..core.errors import BadRequest, Forbidden, InvalidTransition, NotFound
from ..core.identity import Identity
from ..core.lease import HOLDING, parse_duration
from ..core.reservation_windows import Window, window_slots
from ..policy.lease_policy import LeasePolicy
from ..store.admin_store import AdminStore, Reservation
from .enforcer import Enforcer
from .state import LeaseOps, LiveState


def _when(value: Any, now: float, what: str) -> float:
    """An absolute epoch time, or a relative one: "+2h" / "in 30m" / "now"."""
    if value is None or value == "now":
        return now
    if isinstance(value, str) and value.startswith("+"):
        return now + parse_duration(value[1:], what)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        when = float(value) if isinstance(value, float) or abs(value) < 2**63 else math.inf
        if abs(when - now) < MAX_SECONDS:  # also refuses NaN and infinities
            return when
        raise BadRequest(f"Invalid {what} {quoted(value)}: give epoch seconds within 10 years of now")
    raise BadRequest(f"Invalid {what} {quoted(value)}: give epoch seconds, 'now' or '+2h'")


class Reservations:
    """The live reservations (not cancelled, not ended before the broker started) and what they hold."""

    def __init__(self, *, state: LiveState, ops: LeaseOps, policy: LeasePolicy, store: AdminStore,
                 enforcer: Enforcer, now: float) -> None:
        self.state, self.ops, self.policy, self.store, self.enforcer = state, ops, policy, store, enforcer
        self.live: list[Reservation] = store.reservations(since=now)

    def create(self, who: Identity, body: dict[str, Any], now: float) -> Reservation:
        gpus_total = len(self.state.gpus)
        user, group = str(body.get("user") or ""), str(body.get("group") or "")
        if bool(user) == bool(group):
            raise BadRequest("A reservation is for exactly one of user or group")
        gpus = body.get("gpus")
        if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
            raise BadRequest(f"Invalid gpus {gpus!r}: give a whole number >= 1")
        if gpus > gpus_total:
            raise BadRequest(f"Invalid gpus {gpus!r}: the inventory has {gpus_total} GPUs", reason="too_large")
        start = _when(body.get("start"), now, "start")
        end = _when(body.get("end"), now, "end") if "end" in body else start + parse_duration(
            body.get("duration_seconds", 3600), "duration_seconds")
        if end <= start or end <= now:
            raise BadRequest(f"Invalid window: end {end!r} must be after start {start!r} and in the future")
        if not who.admin:
            pol = self.policy
            if user != who.user:
                raise Forbidden("Only admins reserve GPUs for other users or for groups")
            if gpus > pol.user_reservation_max_gpus:
                raise Forbidden(
                    f"Reservation of {gpus} GPUs exceeds your limit of {pol.user_reservation_max_gpus} "
                    "(user_reservation_max_gpus)", reason="quota")
            if pol.max_reservation_seconds and end - start > pol.max_reservation_seconds:
                raise Forbidden(
                    f"Reservation of {end - start:g} s exceeds {pol.max_reservation_seconds:g} s "
                    "(max_reservation_seconds)", reason="quota")
        overlapping = sum(r.gpus for r in self.live if r.start < end and start < r.end)
        if overlapping + gpus > gpus_total:
            raise InvalidTransition(
                f"Cannot reserve {gpus} GPUs: {overlapping} of {gpus_total} are already reserved in that window",
                reason="reserved")
        r = Reservation(id="r-" + secrets.token_hex(5), user=user, group=group, gpus=gpus, start=start, end=end,
                        created_by=who.user, created_at=now, note=str(body.get("note", ""))[:200])
        self.store.add_reservation(r)
        self.live.append(r)
        return r

    def get(self, rid: str) -> Reservation:
        r = self.store.reservation(rid)
        if r is None:
            raise NotFound(f"No reservation {rid!r}")
        return r

    def cancel(self, who: Identity, rid: str, now: float) -> Reservation:
        r = self.get(rid)
        if not who.admin and r.created_by != who.user:
            raise Forbidden(f"Reservation {rid!r} belongs to another user")
        if r.cancelled_at is None:
            r.cancelled_at = now
            self.store.cancel_reservation(rid, r.cancelled_at)
        self.live[:] = [x for x in self.live if x.id != rid]
        return r

    def changed(self, r: Reservation, change: str, now: float) -> dict[str, Any]:
        """A reservation was created or cancelled: the next pass (soon) is a full one that honours it, and an event
        tells the sidebar and `gpulease status`; its view is returned."""
        self.ops.replan()
        view = self.view(r, now)
        self.ops.publish("reservation", change=change, reservation=view, user=None)
        self.ops.gpus_changed()
        return view

    def members(self, r: Reservation, users: Iterable[str]) -> frozenset[str]:
        if r.user:
            return frozenset({r.user})
        return frozenset(u for u in users if r.group in self.policy.groups_of(u))

    def windows(self, now: float) -> list[Window]:
        rs = [r for r in self.live if r.end > now]
        if not rs:
            return []
        leases = self.state.leases.values()
        users = {lease.user for lease in leases}
        holders: dict[str, set[str]] = {}  # GPU -> users holding it (several on a shared GPU)
        for lease in leases:
            if lease.state in HOLDING:
                for d in lease.devices:
                    holders.setdefault(d, set()).add(lease.user)
        out = []
        for r in rs:
            mem = self.members(r, users)
            # GPUs its members hold count toward it first, unless a non-member shares them
            held = tuple(sorted(d for d, who in holders.items() if who <= mem))
            out.append(Window(r.id, r.gpus, r.start, r.end, mem, held))
        return out

    def reserved_now(self, now: float, free_only: bool = True) -> dict[str, str]:
        """GPUs held for a reservation whose window is open now (GPU id -> reservation id): those no lease
        holds (shown as 'reserved'), or with ``free_only=False`` also those its members hold."""
        if not any(r.start <= now < r.end for r in self.live):
            return {}
        wins = [w for w in self.windows(now) if w.start <= now]
        out = {gpu_id: ws[0].id for gpu_id, ws in window_slots(self.enforcer.slot_index(now).all(), wins,
                                                                 now).items()}
        if free_only:
            held = {d for lease in self.state.holding() for d in lease.devices}
            out = {g: rid for g, rid in out.items() if g not in held}
        return out

    def view(self, r: Reservation, now: float) -> dict[str, Any]:
        state = "cancelled" if r.cancelled_at else ("ended" if r.end <= now else "active" if r.start <= now
                                                    else "booked")
        out = {**r.to_json(), "state": state}
        if state == "active":
            out["gpu_ids"] = sorted(g for g, rid in self.reserved_now(now, free_only=False).items() if rid == r.id)
        return out
