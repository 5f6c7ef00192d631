"""A lease as a row of the store's ``leases`` table, and the statements that write one (``lease_store``)."""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from ..core.lease import Lease, LeaseRequest, LeaseState, Preempting, Suspension
from ..core.lease_use import LeaseUse

COLUMNS = (
    "id, seq, user, uid, state, reason, request, devices, node, created_at, granted_at, expires_at, "
    "ended_at, duration_seconds, idle_timeout_seconds, last_heartbeat, last_activity, pids, secret_hash, usage, holder, "
    "preempting, suspension, suspended_seconds, suspensions"
)


def to_row(lease: Lease) -> tuple[Any, ...]:
    return (
        lease.id,
        lease.seq,
        lease.user,
        lease.uid,
        lease.state.value,
        lease.reason,
        lease.request.json_text(),
        json.dumps(lease.devices),
        lease.node,
        lease.created_at,
        lease.granted_at,
        lease.expires_at,
        lease.ended_at,
        lease.duration_seconds,
        lease.idle_timeout_seconds,
        lease.last_heartbeat,
        lease.last_activity,
        json.dumps(list(lease.processes.items())),
        lease.secret_hash,
        lease.use.text(),
        f"{lease.holder[0]} {lease.holder[1]}" if lease.holder is not None else "",
        lease.preempting.text() if lease.preempting is not None else "",
        lease.suspension.text() if lease.suspension is not None else "",
        lease.suspended_seconds,
        lease.suspensions,
    )


def from_row(r: sqlite3.Row | tuple[Any, ...], decoded: list[Any] | None = None,
           requests: dict[str, LeaseRequest] | None = None) -> Lease:
    """A lease from its row; ``decoded``: its JSON columns devices and pids, already parsed; ``requests``: the
    requests made so far from the same JSON text (one frozen LeaseRequest serves every lease that asked alike)."""
    devices, pids = decoded if decoded is not None else (json.loads(r[7]), json.loads(r[17]))
    request = requests.get(r[6]) if requests is not None else None
    if request is None:
        request = LeaseRequest(**json.loads(r[6]))
        if requests is not None:
            requests[r[6]] = request
    return Lease(
        id=r[0],
        seq=r[1],
        user=r[2],
        uid=r[3],
        state=LeaseState(r[4]),
        reason=r[5],
        request=request,
        devices=devices,
        node=r[8],
        created_at=r[9],
        granted_at=r[10],
        expires_at=r[11],
        ended_at=r[12],
        duration_seconds=r[13],
        idle_timeout_seconds=r[14],
        last_heartbeat=r[15],
        last_activity=r[16],
        processes=_processes(pids),
        secret_hash=r[18],
        use=LeaseUse.parse(r[19]),
        holder=_holder(r[20]),
        preempting=Preempting.parse(r[21]),
        suspension=Suspension.parse(r[22]),
        suspended_seconds=r[23],
        suspensions=r[24],
    )


def _processes(pids: list[Any]) -> dict[int, int]:
    """The pids column: [[pid, start ticks], ...] (a store before schema 4 kept bare pids: start ticks unknown, 0)."""
    return dict((int(p[0]), int(p[1])) if isinstance(p, list) else (int(p), 0) for p in pids)


def _holder(text: str) -> tuple[int, int] | None:
    """The holder column: 'pid start_ticks', or '' for none."""
    if not text:
        return None
    pid, start = text.split()
    return int(pid), int(start)


MARKS = ",".join("?" * (COLUMNS.count(",") + 1))
INSERT = f"INSERT INTO leases ({COLUMNS}) VALUES ({MARKS})"
REPLACE = f"REPLACE INTO leases ({COLUMNS}) VALUES ({MARKS})"
HISTORY = "INSERT INTO transitions (lease_id, from_state, to_state, reason, at) VALUES (?,?,?,?,?)"
