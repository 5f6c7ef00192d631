"""Loading the live leases at start: every non-terminal lease from the store, with the processes still alive
(checked by start time). The manager then reconciles them with what runs now (devices still present, drains in
progress, an engine's placements) and makes sure no GPU is held twice before scheduling again."""

from __future__ import annotations

from ..core.lease import Lease
from ..host.procs import same_process
from ..store.lease_store import Store


def load_live(store: Store, now: float) -> list[tuple[Lease, dict[int, int]]]:
    """The live leases in arrival order, each with its processes still alive (pid -> start ticks)."""
    procs = store.processes()
    out = []
    for lease in store.live():
        lease.last_heartbeat = now  # holders could not heartbeat while we were down
        lease.last_activity = max(lease.last_activity, now)
        alive = {p: t for p, t in procs.get(lease.id, {}).items() if same_process(p, t)}
        lease.pids = sorted(alive)
        out.append((lease, alive))
    return out


def double_grants(holding: list[Lease]) -> list[tuple[Lease, str, str]]:
    """Leases (in arrival order) holding an exclusive GPU that an earlier lease holds: (lease, GPU, earlier)."""
    owner: dict[str, str] = {}
    out = []
    for lease in holding:
        if lease.request.shared:
            continue
        twice = next((d for d in lease.devices if d in owner), None)
        if twice is not None:
            out.append((lease, twice, owner[twice]))
        else:
            owner.update((d, lease.id) for d in lease.devices)
    return out
