"""The load test's record and its two independent double-grant checks (see ``benchmarks.load``).

* :class:`Witness`: what the clients hold right now; a grant of a GPU that another client still holds
  (exclusively, or shares over 1) is a double grant the broker made;
* :func:`check_store`: the store's transitions replayed in the order they were written, after the broker
  stopped; and every lease a client was answered for is in the store, in the end state the client saw.
"""

from __future__ import annotations

import json
import sqlite3
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from lease_broker.core.lease import LeaseState

from .report import stats


@dataclass
class LoadResult:
    config: dict[str, Any]
    elapsed: float = 0.0
    requests: int = 0
    granted: int = 0
    granted_at_once: int = 0
    released: int = 0
    cancelled: int = 0
    heartbeats: int = 0
    errors: list[str] = field(default_factory=list)
    client_double_grants: list[str] = field(default_factory=list)
    store_double_grants: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    store_leases: int = 0
    store_transitions: int = 0
    max_held_gpus: float = 0.0
    max_queued: int = 0
    grant_ms: list[float] = field(default_factory=list)  # request sent -> granted (queueing included)
    grant_ms_by_size: dict[str, list[float]] = field(default_factory=dict)
    answer_ms: list[float] = field(default_factory=list)  # POST /leases answered (granted or queued)
    release_ms: list[float] = field(default_factory=list)
    info_ms: list[float] = field(default_factory=list)  # GET /info by a monitor, the same load around it
    grants_per_s: list[float] = field(default_factory=list)  # one sample per second of the run
    broker_log_errors: list[str] = field(default_factory=list)
    broker_cpu_s: float = 0.0
    driver_cpu_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if not isinstance(v, (list, dict))}
        out["config"] = self.config
        out["grant_ms_by_size"] = {k: stats(v) for k, v in sorted(self.grant_ms_by_size.items())}
        for k in ("errors", "client_double_grants", "store_double_grants", "lost", "broker_log_errors"):
            out[k] = len(getattr(self, k))
            out[k + "_examples"] = getattr(self, k)[:5]
        for k in ("grant_ms", "answer_ms", "release_ms", "info_ms", "grants_per_s"):
            out[k] = stats(getattr(self, k))
        return out

    @property
    def ok(self) -> bool:
        return not (self.errors or self.client_double_grants or self.store_double_grants or self.lost
                    or self.broker_log_errors) and self.granted > 0


# ---------------------------------------------------------------------------------------------- the witness
class Witness:
    """What the clients hold right now; a grant that conflicts with it is a double grant."""

    def __init__(self, result: LoadResult) -> None:
        self.r = result
        self.holders: dict[str, dict[str, float]] = defaultdict(dict)  # gpu -> {lease: fraction}
        self.held = 0.0

    def take(self, lease: dict[str, Any]) -> None:
        frac = float(lease.get("fraction") or 1.0)
        shared = frac < 1.0 or bool(lease.get("mem_bytes"))
        for d in lease["devices"]:
            gid = d["id"] if isinstance(d, dict) else str(d)
            others = self.holders[gid]
            if others and (not shared or sum(others.values()) + frac > 1.0 + 1e-9 or 1.0 in others.values()):
                self.r.client_double_grants.append(f"{gid}: {lease['id']} granted while held by {sorted(others)}")
            others[lease["id"]] = frac if shared else 1.0
            self.held += frac if shared else 1.0
        self.r.max_held_gpus = max(self.r.max_held_gpus, self.held)

    def give(self, lease: dict[str, Any]) -> None:
        for d in lease["devices"]:
            gid = d["id"] if isinstance(d, dict) else str(d)
            self.held -= self.holders[gid].pop(lease["id"], 0.0)



# ---------------------------------------------------------------------------------------------- the store
def check_store(db: str, r: LoadResult, seen: dict[str, str]) -> None:
    """Replay the store's transitions in order: no GPU in two leases at once; every lease kept."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    leases = {lid: (json.loads(devices), json.loads(request))
              for lid, devices, request in con.execute("SELECT id, devices, request FROM leases")}
    states = dict(con.execute("SELECT id, state FROM leases").fetchall())
    holders: dict[str, dict[str, float]] = defaultdict(dict)
    count = 0
    for lid, to_state in con.execute("SELECT lease_id, to_state FROM transitions ORDER BY id"):
        count += 1
        devices, req = leases[lid]
        frac = float(req.get("fraction", 1.0))
        shared = frac < 1.0 or bool(req.get("mem_bytes"))
        ids = [d["id"] if isinstance(d, dict) else str(d) for d in devices]
        if to_state == "granted":
            for gid in ids:
                others = holders[gid]
                if others and (not shared or 1.0 in others.values() or sum(others.values()) + frac > 1.0 + 1e-9):
                    r.store_double_grants.append(f"{gid}: {lid} granted while held by {sorted(others)}")
                others[lid] = frac if shared else 1.0
        elif not LeaseState(to_state).holding:  # ended or suspended: it holds no GPU
            for gid in ids:
                holders[gid].pop(lid, None)
    con.close()
    r.store_leases, r.store_transitions = len(leases), count
    for lid, state in seen.items():
        if lid not in states:
            r.lost.append(f"{lid}: answered to a client, not in the store")
        elif states[lid] != state:
            r.lost.append(f"{lid}: the client saw {state}, the store says {states[lid]}")
    ended_badly = Counter(s for s in states.values() if s not in ("released", "cancelled"))
    if ended_badly:
        r.lost.append(f"leases not released or cancelled at the end: {dict(ended_badly)}")
