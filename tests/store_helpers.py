"""Reading a broker's store directly, for the tests that check what was written (the broker itself never needs
these: it reads live leases, one lease, or a user's recent ones)."""

from __future__ import annotations

from collections.abc import Iterator

from lease_broker.core.lease import Lease
from lease_broker.store.lease_rows import COLUMNS, from_row
from lease_broker.store.lease_store import Store


def count(store: Store) -> int:
    """How many leases ``store`` holds, ended ones included."""
    return int(store.reading().execute("SELECT COUNT(*) FROM leases").fetchone()[0])


def iter_rows(store: Store) -> Iterator[Lease]:
    """Every lease ``store`` holds, in arrival order."""
    for r in store.reading().execute(f"SELECT {COLUMNS} FROM leases ORDER BY seq"):
        yield from_row(r)


def held_stretches(store: Store, lease: Lease) -> list[tuple[float, float | None]]:
    """(start, end) of each stretch in which ``lease`` held GPUs, from its stored transitions (end None: it holds
    now). A lease never suspended has one; each suspension ends one and its resume starts the next."""
    holding = {"granted", "active", "idle"}
    out: list[tuple[float, float | None]] = []
    start = None
    for state, at in store.reading().execute(
            "SELECT to_state, at FROM transitions WHERE lease_id=? ORDER BY id", (lease.id,)):
        if state in holding and start is None:
            start = at
        elif state not in holding and start is not None:
            out.append((start, at))
            start = None
    if start is not None:
        out.append((start, None))
    return out
