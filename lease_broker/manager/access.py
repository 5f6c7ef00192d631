"""Finding a caller's leases (what they may see and act on) and waiting for a queued one to be granted."""

from __future__ import annotations

import asyncio
from typing import Protocol

from ..core.errors import Forbidden, InvalidTransition, NotFound
from ..core.identity import Identity
from ..core.lease import Lease, LeaseState
from .state import LiveState
from .views import may_see


class EndedLeases(Protocol):
    """What the store answers about leases that ended (the live ones are in memory)."""

    def get(self, lease_id: str) -> Lease | None: ...

    def recent(self, user: str | None, limit: int = 50) -> list[Lease]: ...


class LeaseAccess:
    def __init__(self, *, state: LiveState, store: EndedLeases) -> None:
        self.state, self.store = state, store

    def lookup(self, lease_id: str, who: Identity) -> Lease:
        lease = self.state.leases.get(lease_id) or self.store.get(lease_id)
        if lease is None:
            raise NotFound(f"No lease {lease_id!r}")
        if not may_see(lease, who):
            raise Forbidden(f"Lease {lease_id!r} belongs to another user")
        return lease

    def own_live(self, lease_id: str, who: Identity) -> Lease:
        """A live lease the caller may act on: their own, or any for an admin."""
        lease = self.lookup(lease_id, who)
        if lease.user != who.user and not who.admin:
            raise Forbidden(f"Lease {lease_id!r} belongs to another user")
        if lease.state.terminal:
            raise InvalidTransition(f"Lease {lease_id} has ended ({lease.state.value}: {lease.reason})",
                                    extra={"state": lease.state.value})
        return lease

    def list(self, who: Identity, everyone: bool = False, include_ended: int = 0) -> list[Lease]:
        if everyone and not who.admin:
            raise Forbidden("Only admins can list every user's leases")
        out = [lease for lease in self.state.leases.values() if (everyone or lease.user == who.user)]
        if include_ended:
            live = {lease.id for lease in out}
            for lease in self.store.recent(None if everyone else who.user, include_ended):
                if lease.id not in live and lease.state.terminal:
                    out.append(lease)
        return sorted(out, key=lambda lease: lease.seq)


class Waiters:
    """Requests waiting (``wait_seconds``, ``GET ?wait=``) for a queued lease to be granted or to end."""

    def __init__(self) -> None:
        self._futures: dict[str, list[asyncio.Future[Lease]]] = {}

    async def wait(self, lease: Lease, timeout: float) -> Lease:
        """Wait until a queued (or suspended) lease is granted or ends, at most ``timeout`` seconds."""
        if lease.state not in (LeaseState.QUEUED, LeaseState.SUSPENDED) or timeout <= 0:
            return lease
        fut: asyncio.Future[Lease] = asyncio.get_running_loop().create_future()
        self._futures.setdefault(lease.id, []).append(fut)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:
            return lease
        finally:
            futures = self._futures.get(lease.id)
            if futures and fut in futures:
                futures.remove(fut)
                if not futures:
                    self._futures.pop(lease.id, None)

    def left_queue(self, lease: Lease) -> None:
        for fut in self._futures.pop(lease.id, []):
            if not fut.done():
                fut.set_result(lease)
