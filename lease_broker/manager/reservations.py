"""Advance reservations: N GPUs for a user or a group during a time window.

Before the window, other leases get those GPUs only if they end before it starts; during it, only the
reservation's members get them (the scheduler's ``Window``). Persisted in the store's ``reservations`` table.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ..core.errors import BadRequest, Forbidden, InvalidTransition, NotFound
from ..core.identity import Identity
from ..core.lease import HOLDING, parse_duration
from ..core.reservation_windows import Window
from ..store.admin_store import Reservation

if TYPE_CHECKING:
    from .manager import LeaseManager


def _when(value: Any, now: float, what: str) -> float:
    """An absolute epoch time, or a relative one: "+2h" / "in 30m" / "now"."""
    if value is None or value == "now":
        return now
    if isinstance(value, str) and value.startswith("+"):
        return now + parse_duration(value[1:], what)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise BadRequest(f"Invalid {what} {value!r}: give epoch seconds, 'now' or '+2h'")


def create(m: LeaseManager, who: Identity, body: dict[str, Any]) -> Reservation:
    now = m.clock.now()
    user, group = str(body.get("user") or ""), str(body.get("group") or "")
    if bool(user) == bool(group):
        raise BadRequest("A reservation is for exactly one of user or group")
    gpus = body.get("gpus")
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise BadRequest(f"Invalid gpus {gpus!r}: give a whole number >= 1")
    if gpus > len(m.gpus):
        raise BadRequest(f"Invalid gpus {gpus!r}: the inventory has {len(m.gpus)} GPUs", reason="too_large")
    start = _when(body.get("start"), now, "start")
    end = _when(body.get("end"), now, "end") if "end" in body else start + parse_duration(
        body.get("duration_seconds", 3600), "duration_seconds")
    if end <= start or end <= now:
        raise BadRequest(f"Invalid window: end {end!r} must be after start {start!r} and in the future")
    if not who.admin:
        pol = m.policy
        if user != who.user:
            raise Forbidden("Only admins reserve GPUs for other users or for groups")
        if gpus > pol.user_reservation_max_gpus:
            raise Forbidden(
                f"Reservation of {gpus} GPUs exceeds your limit of {pol.user_reservation_max_gpus} "
                "(user_reservation_max_gpus)", reason="quota")
        if pol.max_reservation_seconds and end - start > pol.max_reservation_seconds:
            raise Forbidden(
                f"Reservation of {end - start:g} s exceeds {pol.max_reservation_seconds:g} s (max_reservation_seconds)",
                reason="quota")
    overlapping = sum(r.gpus for r in m.reservation_list(now) if r.start < end and start < r.end)
    if overlapping + gpus > len(m.gpus):
        raise InvalidTransition(
            f"Cannot reserve {gpus} GPUs: {overlapping} of {len(m.gpus)} are already reserved in that window",
            reason="reserved")
    r = Reservation(id="r-" + secrets.token_hex(5), user=user, group=group, gpus=gpus, start=start, end=end,
                    created_by=who.user, created_at=now, note=str(body.get("note", ""))[:200])
    m.admin_store.add_reservation(r)
    m.reservation_list(now).append(r)
    return r


def cancel(m: LeaseManager, who: Identity, rid: str) -> Reservation:
    r = m.admin_store.reservation(rid)
    if r is None:
        raise NotFound(f"No reservation {rid!r}")
    if not who.admin and r.created_by != who.user:
        raise Forbidden(f"Reservation {rid!r} belongs to another user")
    if r.cancelled_at is None:
        r.cancelled_at = m.clock.now()
        m.admin_store.cancel_reservation(rid, r.cancelled_at)
    m.reservation_list(0.0)[:] = [x for x in m.reservation_list(0.0) if x.id != rid]
    return r


def members(m: LeaseManager, r: Reservation, users: Iterable[str]) -> frozenset[str]:
    if r.user:
        return frozenset({r.user})
    return frozenset(u for u in users if r.group in m.policy.groups_of(u))


def windows(m: LeaseManager, now: float) -> list[Window]:
    rs = [r for r in m.reservation_list(now) if r.end > now]
    if not rs:
        return []
    users = {lease.user for lease in m.leases.values()}
    holders: dict[str, set[str]] = {}  # GPU -> users holding it (several on a shared GPU)
    for lease in m.leases.values():
        if lease.state in HOLDING:
            for d in lease.devices:
                holders.setdefault(d, set()).add(lease.user)
    out = []
    for r in rs:
        mem = members(m, r, users)
        # GPUs its members hold count toward it first, unless a non-member shares them
        held = tuple(sorted(d for d, who in holders.items() if who <= mem))
        out.append(Window(r.id, r.gpus, r.start, r.end, mem, held))
    return out


def view(m: LeaseManager, r: Reservation, now: float) -> dict[str, Any]:
    state = "cancelled" if r.cancelled_at else ("ended" if r.end <= now else "active" if r.start <= now else "booked")
    out = {**r.to_json(), "state": state}
    if state == "active":
        out["gpu_ids"] = sorted(g for g, rid in m.reserved_now(free_only=False).items() if rid == r.id)
    return out
