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
