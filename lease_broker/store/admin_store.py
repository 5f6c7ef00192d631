"""SQL of the admin features, on the lease store's connection: reservations, the policy audit,
and the history queries behind fair share, daily quotas and the usage report.

Additive tables (``CREATE TABLE IF NOT EXISTS``), so an older store opens unchanged.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from ..core.lease import HOLDING, LeaseRequest, Suspension
from ..core.lease_use import LeaseUse
from .lease_store import Store

_SCHEMA = """
CREATE TABLE IF NOT EXISTS reservations (
    id TEXT PRIMARY KEY,
    user TEXT NOT NULL DEFAULT '',
    grp TEXT NOT NULL DEFAULT '',
    gpus INTEGER NOT NULL,
    start REAL NOT NULL,
    end REAL NOT NULL,
    created_by TEXT NOT NULL,
    created_at REAL NOT NULL,
    note TEXT NOT NULL DEFAULT '',
    cancelled_at REAL
);
CREATE TABLE IF NOT EXISTS policy_audit (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    who TEXT NOT NULL,
    source TEXT NOT NULL,
    diff TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS learned_groups (user TEXT PRIMARY KEY, groups TEXT NOT NULL, at REAL NOT NULL);
"""


@dataclasses.dataclass
class Reservation:
    id: str
    user: str
    group: str
    gpus: int
    start: float
    end: float
    created_by: str
    created_at: float
    note: str = ""
    cancelled_at: float | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _gpus(request_json: str, devices_json: str) -> float:
    req = LeaseRequest(**json.loads(request_json))
    if req.shared:
        return min(req.fraction, 1.0)
    return float(len(json.loads(devices_json)) or req.min_gpus)


class AdminStore:
    """The admin tables, sharing the lease store's SQLite connection (and its transactions)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.db = store.db
        store.add_tables(_SCHEMA)

    # --- reservations --------------------------------------------------------------------------
    def add_reservation(self, r: Reservation) -> None:
        with self.store.batched() as db:
            db.execute(
                "INSERT INTO reservations VALUES (?,?,?,?,?,?,?,?,?,?)",
                (r.id, r.user, r.group, r.gpus, r.start, r.end, r.created_by, r.created_at, r.note, r.cancelled_at),
            )

    def cancel_reservation(self, rid: str, at: float) -> None:
        with self.store.batched() as db:
            db.execute("UPDATE reservations SET cancelled_at=? WHERE id=?", (at, rid))

    def reservations(self, since: float = 0.0, include_cancelled: bool = False) -> list[Reservation]:
        q = "SELECT * FROM reservations WHERE end > ?" + ("" if include_cancelled else " AND cancelled_at IS NULL")
        return [Reservation(*r) for r in self.db.execute(q + " ORDER BY start, id", (since,))]

    def reservation(self, rid: str) -> Reservation | None:
        r = self.db.execute("SELECT * FROM reservations WHERE id=?", (rid,)).fetchone()
        return Reservation(*r) if r else None

    # --- policy audit --------------------------------------------------------------------------
    def audit(self, at: float, who: str, source: str, diff: dict[str, Any]) -> None:
        with self.store.batched() as db:
            db.execute(
                "INSERT INTO policy_audit (at, who, source, diff) VALUES (?,?,?,?)",
                (at, who, source, json.dumps(diff, sort_keys=True, default=str)),
            )

    def audit_log(self, limit: int = 100) -> list[dict[str, Any]]:
        rows = self.db.execute("SELECT id, at, who, source, diff FROM policy_audit ORDER BY id DESC LIMIT ?", (limit,))
        return [{"id": r[0], "at": r[1], "who": r[2], "source": r[3], "diff": json.loads(r[4])} for r in rows]

    def held_intervals(self, ended_after: float) -> list[tuple[str, str, float, float, float | None, float | None]]:
        """(lease id, user, gpus, start, end, expires_at) of every stretch in which a lease held GPUs, not ended
        before ``ended_after``: one per lease, or one per grant and resume of a lease that was suspended (the ones
        that ended under ids ``<lease id>~<n>``: time held before a suspension stays charged)."""
        rows = self.store.reading().execute(
            "SELECT id, user, request, devices, granted_at, ended_at, expires_at, state, suspension, suspensions "
            "FROM leases WHERE granted_at IS NOT NULL AND (ended_at IS NULL OR ended_at > ?)",
            (ended_after,),
        ).fetchall()
        out = []
        for r in rows:
            gpus = _gpus(r[2], _left(r[3], r[8]))
            if not r[9]:
                out.append((r[0], r[1], gpus, r[4], _held_until(r[5], r[7], r[8]), r[6]))
                continue
            # suspended at least once: granted_at is its last resume; each held stretch is read from its transitions
            trans = self.db.execute("SELECT to_state, at FROM transitions WHERE lease_id=? ORDER BY id", (r[0],))
            start: float | None = None
            k = 0
            for state, at in trans:
                if state in _HELD and start is None:
                    start = at
                elif state not in _HELD and start is not None:
                    k += 1  # a stretch that ended: its own id, so that a lease holding now keeps its earlier ones
                    if at > ended_after:
                        out.append((f"{r[0]}~{k}", r[1], gpus, start, at, at))
                    start = None
            if start is not None:
                out.append((r[0], r[1], gpus, start, None, r[6]))
        return out

    def usage_rows(self, since: float) -> list[dict[str, Any]]:
        """Every lease that held GPUs after ``since``, with its transitions, labels and usage figures (for the usage
        report)."""
        rows = self.store.reading().execute(
            "SELECT id, user, request, devices, granted_at, ended_at, state, reason, usage FROM leases "
            "WHERE granted_at IS NOT NULL AND (ended_at IS NULL OR ended_at > ?)",
            (since,),
        ).fetchall()
        out = []
        for r in rows:
            trans = self.db.execute(
                "SELECT to_state, at FROM transitions WHERE lease_id=? ORDER BY id", (r[0],)
            ).fetchall()
            out.append(
                {"id": r[0], "user": r[1], "gpus": _gpus(r[2], r[3]), "granted_at": r[4], "ended_at": r[5],
                 "state": r[6], "reason": r[7], "transitions": [(t[0], t[1]) for t in trans],
                 "labels": json.loads(r[2]).get("labels") or {}, "use": LeaseUse.parse(r[8])}
            )
        return out

    # --- groups an identity provider reported ---------------------------------------------------
    def remember_groups(self, user: str, groups: tuple[str, ...], at: float) -> None:
        """The groups JupyterHub reported for ``user`` (so a restarted broker knows them before the user calls)."""
        with self.store.batched() as db:
            db.execute("REPLACE INTO learned_groups VALUES (?,?,?)", (user, json.dumps(list(groups)), at))

    def learned_groups(self) -> dict[str, tuple[str, ...]]:
        return {u: tuple(json.loads(g)) for u, g in self.db.execute("SELECT user, groups FROM learned_groups")}


_HELD = frozenset(state.value for state in HOLDING)


def _left(devices: str, suspension: str) -> str:
    """A suspended lease's devices column is empty: the GPUs it left count."""
    s = Suspension.parse(suspension) if devices == "[]" and suspension else None
    return json.dumps(list(s.devices)) if s is not None and s.devices else devices


def _held_until(ended_at: float | None, state: str, suspension: str) -> float | None:
    """Until when a lease held its GPUs: its end, or when it was suspended (a lease suspended now, or that ended
    while suspended: it held none since)."""
    s = Suspension.parse(suspension) if suspension else None
    if s is not None and s.suspended and (ended_at is not None or state == "suspended"):
        return s.since
    return ended_at
