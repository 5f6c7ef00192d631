"""The LeaseManager's start (mixed into it): reload every live lease from the store and reconcile it
with what runs now — processes still alive (checked by start time), devices still present, drains in
progress, an engine's placements — and make sure no GPU is held twice before scheduling again.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, cast

from ..core.lease import HOLDING, LeaseState
from ..host.procs import same_process

if TYPE_CHECKING:
    from .manager import LeaseManager

log = logging.getLogger("lease_broker")


class RestoreMixin:
    def restore(self) -> dict[str, int]:
        """Reload every non-terminal lease and reconcile it with what is running now."""
        m = cast("LeaseManager", self)
        now = m.clock.now()
        counts = {"queued": 0, "holding": 0, "failed": 0}
        procs = m.store.processes()
        for lease in m.store.live():
            m.leases[lease.id] = lease
            lease.last_heartbeat = now  # holders could not heartbeat while we were down
            lease.last_activity = max(lease.last_activity, now)
            alive = {p: t for p, t in procs.get(lease.id, {}).items() if same_process(p, t)}
            lease.pids = sorted(alive)
            m.enforcer.remember(lease.id, alive)
            if lease.state in HOLDING:
                missing = [d for d in lease.devices if d not in m.gpu_by_id]
                if missing:
                    m.end(lease, LeaseState.FAILED, "device_gone")
                    counts["failed"] += 1
                    continue
                counts["holding"] += 1
            else:
                counts["queued"] += 1
        m.table.rebuild(m.leases.values())
        m.enforcer.restore_drains(m.store.drains())
        m._check_no_double_grant()
        m.inventory.reconcile(m)  # an engine's inventory (Ray) hooks in and finds its placements first
        m.schedule()
        return counts

    def _check_no_double_grant(self) -> None:
        m = cast("LeaseManager", self)
        owner: dict[str, str] = {}
        for lease in m.leases.values():
            if lease.state in HOLDING and not lease.request.shared:
                for d in lease.devices:
                    if d in owner:
                        log.error("GPU %s is held by leases %s and %s: revoking the later one", d, owner[d], lease.id)
                        m.end(lease, LeaseState.FAILED, "double_grant")
                        break
                    owner[d] = lease.id
