"""LeaseManager: the broker's state. Owns leases in memory, persists every change, and
drives the scheduler and the enforcer. Pure of network code: the API calls into it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from typing import Any

from ..core.clock import Clock
from ..core.errors import BadRequest, Forbidden, InvalidTransition, NotFound
from ..core.gputable import GpuTable
from ..core.identity import Identity, hash_secret
from ..core.lease import (
    HOLDING,
    Lease,
    LeaseState,
    check_transition,
    describe_request,
    parse_duration,
    parse_request,
    reason_slug,
)
from ..core.scheduler import Pending, Slot, SlotIndex, schedule
from ..host.procs import is_descendant, proc_info
from ..inventory import GPU, GpuSample, Inventory
from ..policy.lease_policy import LeasePolicy
from ..store.lease_store import Store
from .enforcer import Enforcer
from .events import EventBus
from .policy_admin import PolicyMixin
from .restore import RestoreMixin
from .views import ManagerViews, may_see

log = logging.getLogger("lease_broker")


class LeaseManager(RestoreMixin, PolicyMixin, ManagerViews):
    def __init__(
        self,
        store: Store,
        inventory: Inventory,
        policy: LeasePolicy,
        clock: Clock | None = None,
        events: EventBus | None = None,
    ) -> None:
        self.store = store
        self.inventory = inventory
        self.policy = policy
        self.clock = clock or Clock()
        self.events = events or EventBus(clock=self.clock.now)
        self.leases: dict[str, Lease] = {}  # every non-terminal lease
        self.gpus: list[GPU] = inventory.discover()
        self.gpu_by_id = {g.id: g for g in self.gpus}
        self.table = GpuTable(self.gpus)  # kept current by every change below (sync)
        self._verify_table = os.environ.get("GPULEASE_VERIFY_TABLE") == "1"  # the test suite checks it each pass
        self.samples: dict[str, GpuSample] = {}
        self.planned: dict[str, float] = {}
        self.order: list[str] = []
        self._waiters: dict[str, list[asyncio.Future[Lease]]] = {}
        self._seq = store.next_seq()
        self.enforcer = Enforcer(self)
        self.transitions_total: dict[tuple[str, str], int] = {}
        self._gpus_dirty, self._gpus_sent = False, -1e9  # see ManagerViews._emit_gpus
        self._pass_queued = False

    # ------------------------------------------------------------------ requests
    def request(self, who: Identity, body: Any) -> tuple[Lease, str]:
        req = parse_request(body)
        req, duration, idle = self.policy.apply(who.user, req, len(self.gpus))
        self.check_placeable(req)
        largest = self.table.largest_memory
        if req.mem_bytes and largest and req.mem_bytes > largest:
            raise BadRequest(f"Request for mem={req.mem_bytes / 2**30:.4g}G can never be granted: the largest GPU has "
                             f"{largest / 2**30:.4g}G", reason="too_large")
        now = self.clock.now()
        secret = secrets.token_urlsafe(24)
        lease = Lease(
            id="l-" + secrets.token_hex(6),
            user=who.user,
            uid=who.uid,
            request=req,
            state=LeaseState.QUEUED,
            created_at=now,
            seq=self._seq,
            reason="requested",
            duration_seconds=duration,
            idle_timeout_seconds=idle,
            last_heartbeat=now,
            last_activity=now,
            secret_hash=hash_secret(secret),
        )
        self._seq += 1
        queue_was_empty = not self.order and not self._pass_queued
        self.store.insert(lease, now)
        self.leases[lease.id] = lease
        self.table.sync(lease)
        log.info("Lease %s requested by %s: gpus=%s", lease.id, who.user, describe_request(req))
        self._emit(lease, None)
        if queue_was_empty:
            self.schedule()  # answered granted at once when it fits
        else:
            self.order.append(lease.id)  # its position until the pass (which orders by priority and fair share)
            self.schedule_soon()  # behind others: one pass for every request of this loop iteration
        return lease, secret

    def lookup(self, lease_id: str, who: Identity) -> Lease:
        lease = self.leases.get(lease_id) or self.store.get(lease_id)
        if lease is None:
            raise NotFound(f"No lease {lease_id!r}")
        if not may_see(lease, who):
            raise Forbidden(f"Lease {lease_id!r} belongs to another user")
        return lease

    def list_leases(self, who: Identity, everyone: bool = False, include_ended: int = 0) -> list[Lease]:
        if everyone and not who.admin:
            raise Forbidden("Only admins can list every user's leases")
        out = [lease for lease in self.leases.values() if (everyone or lease.user == who.user)]
        if include_ended:
            live = {lease.id for lease in out}
            for lease in self.store.recent(None if everyone else who.user, include_ended):
                if lease.id not in live and lease.state.terminal:
                    out.append(lease)
        return sorted(out, key=lambda lease: lease.seq)

    def release(self, lease_id: str, who: Identity, reason: str = "released") -> Lease:
        lease = self.lookup(lease_id, who)
        if lease.state.terminal:
            raise InvalidTransition(
                f"Lease {lease_id} already ended ({lease.state.value}: {lease.reason})",
                extra={"state": lease.state.value},
            )
        if lease.user != who.user and who.admin:
            return self.revoke(lease_id, who, reason or "admin")
        if lease.state == LeaseState.QUEUED:
            self.end(lease, LeaseState.CANCELLED, "cancelled")
        else:
            self.end(lease, LeaseState.RELEASED, reason_slug(reason, "released"))
        return lease

    def revoke(self, lease_id: str, who: Identity, reason: str = "admin") -> Lease:
        if not who.admin:
            raise Forbidden("Only admins can revoke leases; use release for your own")
        lease = self.lookup(lease_id, who)
        if lease.state.terminal:
            raise InvalidTransition(f"Lease {lease_id} already ended ({lease.state.value})")
        target = LeaseState.CANCELLED if lease.state == LeaseState.QUEUED else LeaseState.REVOKED
        self.end(lease, target, "admin:" + reason_slug(reason, "revoked"))
        return lease

    def renew(self, lease_id: str, who: Identity, duration: Any) -> Lease:
        lease = self._own_live(lease_id, who)
        seconds = parse_duration(duration, "duration_seconds") if duration is not None else lease.duration_seconds
        if seconds <= 0:
            raise BadRequest(f"Invalid duration_seconds {duration!r}: must be > 0")
        now = self.clock.now()
        if lease.state == LeaseState.QUEUED:
            seconds = min(seconds, float(self.policy.limit(lease.user, "max_duration_seconds")))
            self.policy.check_day_quota(lease.user, lease.gpu_count, seconds)
            lease.duration_seconds = seconds
            self.store.update(lease)
            return lease
        assert lease.granted_at is not None
        new_expiry = now + seconds
        self.check_renewal(lease, new_expiry)  # policy: max_duration_seconds, reservations, daily quota
        lease.expires_at = max(lease.expires_at or 0.0, new_expiry)
        lease.duration_seconds = lease.expires_at - lease.granted_at
        self.enforcer.clear_warning(lease.id, "expiry")
        self.table.sync(lease)
        self.store.update(lease)
        self.events.publish("lease", lease=self.view(lease), change="renewed", user=lease.user)
        return lease

    def heartbeat(self, lease_id: str, who: Identity, active: bool = False) -> Lease:
        lease = self._own_live(lease_id, who)
        now = self.clock.now()
        lease.last_heartbeat = now
        if active and lease.state in HOLDING:
            self.activity(lease, now)
        return lease

    def activity(self, lease: Lease, now: float) -> None:
        lease.last_activity = now
        self.enforcer.clear_warning(lease.id, "idle")
        if lease.state in (LeaseState.GRANTED, LeaseState.IDLE):
            self.transition(lease, LeaseState.ACTIVE, "activity")

    def attach(self, lease_id: str, who: Identity, pid: Any) -> Lease:
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 1:
            raise BadRequest(f"Invalid pid {pid!r}: give the process id of a process you own")
        lease = self._own_live(lease_id, who)
        if lease.state.terminal:
            raise InvalidTransition(f"Lease {lease_id} has ended")
        info = proc_info(pid)
        if info is None:
            raise BadRequest(f"No process {pid} is running on the broker's host")
        if who.uid < 0:
            raise Forbidden("Processes can be attached only over the broker's Unix socket")
        if info.uid != who.uid:
            raise Forbidden(f"Process {pid} does not belong to you")
        if who.pid and not is_descendant(pid, who.pid):
            raise Forbidden(f"Process {pid} is not the caller or one of its descendants")
        if pid not in lease.pids:
            lease.pids.append(pid)
        self.enforcer.remember(lease.id, {pid: info.start_ticks})
        self.store.attach(lease.id, pid, info.start_ticks)
        return lease

    def _own_live(self, lease_id: str, who: Identity) -> Lease:
        lease = self.lookup(lease_id, who)
        if lease.user != who.user and not who.admin:
            raise Forbidden(f"Lease {lease_id!r} belongs to another user")
        if lease.state.terminal:
            raise InvalidTransition(
                f"Lease {lease_id} has ended ({lease.state.value}: {lease.reason})", extra={"state": lease.state.value}
            )
        return lease

    async def wait(self, lease: Lease, timeout: float) -> Lease:
        """Wait until a queued lease is granted or ends, at most ``timeout`` seconds."""
        if lease.state != LeaseState.QUEUED or timeout <= 0:
            return lease
        fut: asyncio.Future[Lease] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(lease.id, []).append(fut)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:
            return lease
        finally:
            waiters = self._waiters.get(lease.id)
            if waiters and fut in waiters:
                waiters.remove(fut)
                if not waiters:
                    self._waiters.pop(lease.id, None)

    # ------------------------------------------------------------------ transitions
    def transition(self, lease: Lease, target: LeaseState, reason: str) -> None:
        check_transition(lease.id, lease.state, target)
        before = lease.state
        now = self.clock.now()
        lease.state = target
        lease.reason = reason
        if target.terminal:
            lease.ended_at = now
        try:
            self.store.transition(lease, before, now)
        except Exception:
            lease.state, lease.ended_at = before, None
            raise
        key = (before.value, target.value)
        self.transitions_total[key] = self.transitions_total.get(key, 0) + 1
        if target.terminal:
            self.leases.pop(lease.id, None)
        self.table.sync(lease)
        level = logging.DEBUG if {before, target} <= {LeaseState.ACTIVE, LeaseState.IDLE} else logging.INFO
        log.log(level, "Lease %s %s -> %s (%s), user %s", lease.id, before.value, target.value, reason, lease.user)
        self._emit(lease, before)
        if before == LeaseState.QUEUED:
            for fut in self._waiters.pop(lease.id, []):
                if not fut.done():
                    fut.set_result(lease)

    def end(self, lease: Lease, target: LeaseState, reason: str) -> None:
        """End a lease: persist, stop its processes, drain its GPUs, hand them on."""
        held = lease.state in HOLDING
        self.transition(lease, target, reason)
        if held:
            self.enforcer.stop(lease)
        self.inventory.forget(lease.id)
        self.planned.pop(lease.id, None)
        if held:
            self.schedule_soon()
            self._emit_gpus()

    def _emit(self, lease: Lease, before: LeaseState | None) -> None:
        self.events.publish(
            "lease",
            lease=self.view(lease),
            change=lease.state.value,
            previous=before.value if before else None,
            user=lease.user,
        )

    def set_gpus(self, gpus: list[GPU]) -> None:
        """The inventory changed (an engine's node joined or left); leases on GPUs that left are the caller's."""
        self.gpus, self.gpu_by_id = gpus, {g.id: g for g in gpus}
        self.table.set_gpus(gpus, self.leases.values())

    # ------------------------------------------------------------------ scheduling
    def slot_index(self) -> SlotIndex:
        """The GPUs for a pass: the table's index, with draining GPUs free after term_timeout, unhealthy never."""
        return self.table.slot_index(self.enforcer.draining, self.enforcer.unhealthy,
                                     self.clock.now() + self.policy.term_timeout)

    def slots(self) -> list[Slot]:
        """Every GPU as a pass sees it, to read (change them through ``slot_index().edit``)."""
        return self.slot_index().all()

    def held_by_user(self) -> dict[str, float]:
        return dict(self.table.held_by_user)

    def pending(self) -> list[Pending]:
        return [Pending(lease.id, lease.user, lease.request, lease.seq, lease.duration_seconds)
                for lease in self.table.queued.values()]

    def schedule_soon(self) -> None:
        """A pass at the next event-loop iteration, one for every change of this one; at once without a loop.

        Under load many requests and releases arrive in one iteration: each used to pay a pass over every
        GPU and every queued request. A pass queued by a request's answer runs before the broker reads the
        client's next request, so a client that releases and then asks again sees the GPU handed on.
        """
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.schedule()
            return
        if not self._pass_queued:
            self._pass_queued = True
            loop.call_soon(self._queued_pass)

    def _queued_pass(self) -> None:
        self._pass_queued = False
        try:
            self.schedule()
        except Exception:  # e.g. the store cannot be written: the next request, release or tick tries again
            log.exception("Scheduling pass failed")

    def schedule(self) -> int:
        if self._verify_table:
            diffs = self.table.verify(self.leases.values(), self.gpus)
            assert not diffs, "GPU table out of step with the leases: " + "; ".join(diffs[:5])
        pending = self.pending()
        if not pending and not self.preempting and not self.growable():
            self.order, self.planned = [], {}
            return 0
        now = self.clock.now()
        decision = schedule(pending, self.slot_index(), self.table.held_by_user, now=now,
                            **self.schedule_options(now, pending))
        granted = {g.lease_id for g in decision.grants}
        self.order = [lid for lid in decision.order if lid not in granted]
        self.planned = decision.planned_start
        for grant in decision.grants:
            lease = self.leases[grant.lease_id]
            lease.devices = list(grant.gpu_ids)
            lease.node = grant.node
            lease.granted_at = now
            lease.expires_at = now + lease.duration_seconds
            lease.last_activity = now
            lease.last_heartbeat = max(lease.last_heartbeat, now)
            self.transition(lease, LeaseState.GRANTED, "granted")
        self.after_schedule(decision)
        return len(decision.grants)

    # ------------------------------------------------------------------ time
    def tick(self) -> None:
        """Enforce time: expiry, heartbeats, idleness, warnings, kills, drains. Then schedule."""
        self.inventory.reconcile(self)
        self.enforcer.tick(self.clock.now())
        self.schedule()

