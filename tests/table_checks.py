"""Checks of the broker's GPU table for the tests (not the broker's: it trusts its one mutation path)."""

from __future__ import annotations

from collections.abc import Iterable

from lease_broker.core.gpu import GPU
from lease_broker.core.gputable import GpuTable, _rounded
from lease_broker.core.lease import Lease


def table_diffs(table: GpuTable, leases: Iterable[Lease], gpus: Iterable[GPU]) -> list[str]:
    """What differs between ``table`` and a table made from these GPUs and live leases (empty when it agrees)."""
    fresh = GpuTable(gpus, leases)
    if set(fresh._static) != set(table._static):
        return [f"GPUs: {sorted(table._static)} != {sorted(fresh._static)} (inventory changed without set_gpus)"]
    diffs = []
    for gid, s in fresh.base.by_id.items():
        if _rounded(s) != _rounded(table.base.by_id[gid]):
            diffs.append(f"slot {gid}: {table.base.by_id[gid]} != {s}")
    def users(t: GpuTable) -> dict[str, set[str]]:
        return {u: set(d) for u, d in t.holding_by_user.items() if d}

    for name, mine, theirs in (("queued", set(table.queued), set(fresh.queued)),
                               ("holding", users(table), users(fresh)),
                               ("growable", set(table.growable), set(fresh.growable)),
                               ("busy", table.busy, fresh.busy),
                               ("busy counts", table.n_busy, fresh.n_busy),
                               ("idle", table.base.idle_total, fresh.base.idle_total)):
        if mine != theirs:
            diffs.append(f"{name}: {mine} != {theirs}")
    if {k: v for k, v in table.base.idle.items() if v} != {k: v for k, v in fresh.base.idle.items() if v}:
        diffs.append("idle per node differs")
    for user in {*table.held_by_user, *fresh.held_by_user}:
        if abs(table.held_by_user.get(user, 0.0) - fresh.held_by_user.get(user, 0.0)) > 1e-6:
            diffs.append(f"held_by_user[{user}]: {table.held_by_user.get(user)} != {fresh.held_by_user.get(user)}")
    return diffs
