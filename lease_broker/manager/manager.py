"""LeaseManager: the one owner of lease state.

It holds the live leases (:class:`~lease_broker.manager.state.LiveState`) and changes them through one path,
:meth:`LeaseManager.commit`, which updates the GPU table, writes the store in one transaction and publishes the
events together. The parts it is composed of (enforcement, reservations, preemption, quotas, usage, policy
administration, views) read the live state and ask for changes through :class:`~lease_broker.manager.ports.LeaseOps`;
the inventory is told of grants and ends and answers with changes (``inventory.changes``) that the manager
applies. Pure of network code: the API calls into it.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import secrets
import time
from typing import Any

from ..core.clock import Clock
from ..core.errors import BadRequest, Forbidden, InvalidTransition, NotFound
from ..core.gpu import GPU, GpuSample
from ..core.identity import Identity, hash_secret
from ..core.lease import (
    HOLDING,
    Change,
    Lease,
    LeaseState,
    check_transition,
    describe_request,
    parse_duration,
    parse_request,
    reason_slug,
)
from ..core.scheduler import Pending, schedule
from ..inventory import Inventory
from ..inventory.changes import GpusChanged, GpusClosed, InventoryChange, LeaseFailed, LeasePlaced
from ..policy.lease_policy import LeasePolicy
from ..store.admin_store import AdminStore
from ..store.lease_store import Store
from .enforcer import Enforcer
from .events import EventBus
from .planning import Planning
from .policy_admin import PolicyAdmin
from .preemption import Preemption
from .quotas import Quotas
from .reservations import Reservations
from .restore import load_live
from .state import LiveState
from .usage import Usage
from .views import Views, may_see

log = logging.getLogger("lease_broker")

#: The GPU summary (one entry per GPU) is published at most this often: at once after a quiet spell, then
#: on the trailing edge. A busy broker would otherwise rebuild it twice per grant and release.
GPU_EVENT_INTERVAL = 0.1


class LeaseManager:
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
        self.state = LiveState(inventory.discover(), lambda: policy.priority_classes)
        self.admin_store = AdminStore(store)
        now = self.clock.now()
        # the parts, each given what it reads and the narrow LeaseOps (this object) for what it may ask
        self.enforcer = Enforcer(self.state, self, policy, inventory, store, self.events, self.clock)
        self.reservations = Reservations(self.state, self, policy, self.admin_store, self.events, self.enforcer, now)
        self.preemption = Preemption(self.state, self, policy, self.admin_store, self.events, self.enforcer,
                                     self.reservations)
        self.quotas = Quotas(self.state, policy, self.admin_store, self.reservations, self.enforcer)
        self.usage = Usage(self.state, policy, self.admin_store)
        self.planning = Planning(self.state, policy, inventory, self.quotas, self.usage, self.reservations)
        self.policy_admin = PolicyAdmin(policy, self.admin_store, self.events, self, self.clock)
        self.views = Views(self.state, policy, inventory, self.enforcer, self.reservations, self.preemption)
        self.transitions_total: dict[tuple[str, str], int] = {}
        self._seq = store.next_seq()
        self._waiters: dict[str, list[asyncio.Future[Lease]]] = {}
        self._gpus_dirty, self._gpus_sent = False, -1e9
        self._pass_queued = False
        self._arrived: list[str] = []  # queued since the last pass: the next event pass looks at them
        self._last_full = -1e18  # when the last full pass ran
        self._full_due = True  # the policy, the reservations or the GPUs changed: the next pass is a full one
        self._loop: asyncio.AbstractEventLoop | None = None
        inventory.wake = self._wake_inventory

    # ------------------------------------------------------------------ what parts and the API read
    @property
    def leases(self) -> dict[str, Lease]:
        return self.state.leases

    @property
    def gpus(self) -> list[GPU]:
        return self.state.gpus

    @property
    def gpu_by_id(self) -> dict[str, GPU]:
        return self.state.gpu_by_id

    @property
    def samples(self) -> dict[str, GpuSample]:
        return self.state.samples

    @samples.setter
    def samples(self, samples: dict[str, GpuSample]) -> None:
        self.state.samples = samples

    @property
    def order(self) -> list[str]:
        """Queued lease ids in scheduling order."""
        return self.state.order

    @property
    def planned(self) -> dict[str, float]:
        return self.state.planned

    def held_by_user(self) -> dict[str, float]:
        return self.state.held_by_user()

    def view(self, lease: Lease, who: Identity | None = None) -> dict[str, Any]:
        """The one lease view every answer and event uses (``who`` None: the owner's, as events carry)."""
        return self.views.lease(lease, who, self.clock.now())

    def summary(self) -> dict[str, Any]:
        return self.views.summary(self.clock.now())

    def gpu_views(self, who: Identity) -> list[dict[str, Any]]:
        return self.views.gpus(who, self.clock.now())

    # ------------------------------------------------------------------ requests
    def request(self, who: Identity, body: Any) -> tuple[Lease, str]:
        req = parse_request(body)
        req, duration, idle = self.policy.apply(who.user, req, len(self.gpus))
        self.quotas.check_placeable(req)
        largest = self.state.table.largest_memory
        if req.mem_bytes and largest and req.mem_bytes > largest:
            raise BadRequest(f"Request for mem={req.mem_bytes / 2**30:.4g}G can never be granted: the largest GPU has "
                             f"{largest / 2**30:.4g}G", reason="too_large")
        now = self.clock.now()
        secret = secrets.token_urlsafe(24)
        lease = Lease(id="l-" + secrets.token_hex(6), user=who.user, uid=who.uid, request=req,
                      state=LeaseState.QUEUED, created_at=now, seq=self._seq, reason="requested",
                      duration_seconds=duration, idle_timeout_seconds=idle, last_heartbeat=now, last_activity=now,
                      secret_hash=hash_secret(secret))
        self._seq += 1
        queue_was_empty = not len(self.state.queue) and not self._pass_queued
        self.commit(lease, Change(state=LeaseState.QUEUED))
        log.info("Lease %s requested by %s: gpus=%s", lease.id, who.user, describe_request(req))
        self._arrived.append(lease.id)
        if queue_was_empty:
            self.schedule()  # answered granted at once when it fits
        else:
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
            raise InvalidTransition(f"Lease {lease_id} already ended ({lease.state.value}: {lease.reason})",
                                    extra={"state": lease.state.value})
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
            self.commit(lease, Change(duration_seconds=seconds))
            return lease
        assert lease.granted_at is not None
        new_expiry = now + seconds
        self.quotas.check_renewal(lease, new_expiry, now)  # max_duration_seconds, reservations, daily quota
        expires = max(lease.expires_at or 0.0, new_expiry)
        self.enforcer.clear_warning(lease.id, "expiry")
        self.commit(lease, Change(expires_at=expires, duration_seconds=expires - lease.granted_at, event="renewed"))
        self.inventory.on_renew(lease, now)
        return lease

    def heartbeat(self, lease_id: str, who: Identity, active: bool = False) -> Lease:
        lease = self._own_live(lease_id, who)
        now = self.clock.now()
        self.commit(lease, Change(last_heartbeat=now))
        if active and lease.state in HOLDING:
            self.activity(lease, now)
        return lease

    def attach(self, lease_id: str, who: Identity, pid: Any) -> Lease:
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 1:
            raise BadRequest(f"Invalid pid {pid!r}: give the process id of a process you own")
        lease = self._own_live(lease_id, who)
        info = self.enforcer.check_attach(pid, who)
        self.enforcer.remember(lease.id, {pid: info.start_ticks})
        self.commit(lease, Change(attach=(pid, info.start_ticks)))
        return lease

    def _own_live(self, lease_id: str, who: Identity) -> Lease:
        lease = self.lookup(lease_id, who)
        if lease.user != who.user and not who.admin:
            raise Forbidden(f"Lease {lease_id!r} belongs to another user")
        if lease.state.terminal:
            raise InvalidTransition(f"Lease {lease_id} has ended ({lease.state.value}: {lease.reason})",
                                    extra={"state": lease.state.value})
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

    # ------------------------------------------------------------------ the one mutation path
    def commit(self, lease: Lease, change: Change) -> None:
        """Apply one change of a lease: check the transition, write the store (one transaction; the lease is
        left as it was if that fails), update the GPU table, publish the event, wake waiters."""
        now = self.clock.now()
        new = lease.id not in self.state.leases and change.state == LeaseState.QUEUED and not lease.ended_at
        before = None if new else lease.state
        if before is not None and change.state is not None:
            check_transition(lease.id, before, change.state)
        saved = copy.copy(lease)
        change.apply(lease, now)
        try:
            if new:
                self.store.insert(lease, now)
            elif change.state is not None:
                self.store.transition(lease, before, now)
            elif change.stored:
                self.store.update(lease)
            if change.attach is not None:
                self.store.attach(lease.id, *change.attach)
        except Exception:
            lease.__dict__.update(saved.__dict__)
            raise
        if new:
            self.state.leases[lease.id] = lease
            self._enqueue(lease, self.planning.scores(now, {lease.user})[lease.user])
        elif lease.state.terminal:
            self.state.leases.pop(lease.id, None)
        if before == LeaseState.QUEUED and change.state is not None:
            self.state.queue.remove(lease.id)
            self.state.planned.pop(lease.id, None)
        if change.moves:
            self.state.table.sync(lease)
        if change.state is not None and before is not None:
            self._log_transition(lease, before)
        if change.state is not None or change.event:
            self.events.publish("lease", lease=self.view(lease), user=lease.user,
                                change=change.event or lease.state.value,
                                previous=before.value if before is not None else None)
        if before == LeaseState.QUEUED and change.state is not None:
            for fut in self._waiters.pop(lease.id, []):
                if not fut.done():
                    fut.set_result(lease)
        if change.devices is not None or (before in HOLDING) != (lease.state in HOLDING):
            self.gpus_changed()

    def _enqueue(self, lease: Lease, score: float) -> None:
        self.state.queue.add(Pending(lease.id, lease.user, lease.request, lease.seq, lease.duration_seconds), score)

    def _log_transition(self, lease: Lease, before: LeaseState) -> None:
        key = (before.value, lease.state.value)
        self.transitions_total[key] = self.transitions_total.get(key, 0) + 1
        level = logging.DEBUG if {before, lease.state} <= {LeaseState.ACTIVE, LeaseState.IDLE} else logging.INFO
        log.log(level, "Lease %s %s -> %s (%s), user %s", lease.id, before.value, lease.state.value, lease.reason,
                lease.user)

    # ------------------------------------------------------------------ LeaseOps: what parts may ask
    def end(self, lease: Lease, target: LeaseState, reason: str) -> None:
        """End a lease: persist, stop its processes, drain its GPUs, hand them on."""
        held = lease.state in HOLDING
        self.commit(lease, Change(state=target, reason=reason))
        if held:
            self.enforcer.stop(lease)
        self.inventory.on_end(lease)
        if held:
            self.schedule_soon()

    def mark_idle(self, lease: Lease) -> None:
        self.commit(lease, Change(state=LeaseState.IDLE, reason="no_activity"))

    def activity(self, lease: Lease, now: float) -> None:
        self.enforcer.clear_warning(lease.id, "idle")
        if lease.state in (LeaseState.GRANTED, LeaseState.IDLE):
            self.commit(lease, Change(state=LeaseState.ACTIVE, reason="activity", last_activity=now))
        else:
            self.commit(lease, Change(last_activity=now))

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

    def replan(self) -> None:
        """The policy, the reservations or the GPUs changed: the next pass (soon) is a full one."""
        self._full_due = True
        self.schedule_soon()

    def gpus_changed(self) -> None:
        """Publish the GPU summary: at once, or at most every GPU_EVENT_INTERVAL (the latest state wins)."""
        if self._gpus_dirty:
            return  # already scheduled: it will carry this change too
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (tests with a virtual clock): at once
            self._flush_gpus()
            return
        self._gpus_dirty = True
        loop.call_later(max(0.0, self._gpus_sent + GPU_EVENT_INTERVAL - time.monotonic()), self._flush_gpus)

    def _flush_gpus(self) -> None:
        self._gpus_dirty, self._gpus_sent = False, time.monotonic()
        self.events.publish("gpus", summary=self.summary())

    # ------------------------------------------------------------------ the inventory
    def set_gpus(self, gpus: list[GPU]) -> None:
        """The inventory changed (an engine's node joined or left); leases on GPUs that left are the caller's."""
        self.state.set_gpus(gpus)
        self._full_due = True

    def reconcile_inventory(self) -> None:
        """Ask the inventory what changed in its engine and apply it."""
        self.apply_inventory(self.inventory.reconcile(self.state.leases, self.clock.now()))

    def apply_inventory(self, changes: list[InventoryChange]) -> None:
        if not changes:
            return
        for change in changes:
            if isinstance(change, GpusChanged):
                self.set_gpus(list(change.gpus))
            elif isinstance(change, GpusClosed):
                self.enforcer.set_closed(dict(change.reasons))
            elif isinstance(change, LeaseFailed):
                lease = self.leases.get(change.lease_id)
                if lease is not None and lease.state in HOLDING:
                    log.error("Lease %s: %s", lease.id, change.reason)
                    self.end(lease, LeaseState.FAILED, change.reason)
            elif isinstance(change, LeasePlaced):
                lease = self.leases.get(change.lease_id)
                if lease is not None and lease.state in HOLDING:
                    self.commit(lease, Change(devices=change.devices, event="placed"))
        self.schedule_soon()
        self.gpus_changed()

    def _wake_inventory(self) -> None:
        """The inventory has news (from any thread): reconcile on the event loop soon."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self.reconcile_inventory)
            except RuntimeError:
                pass

    # ------------------------------------------------------------------ scheduling
    def _queued_pass(self) -> None:
        self._pass_queued = False
        try:
            self.schedule()
        except Exception:  # e.g. the store cannot be written: the next request, release or tick tries again
            log.exception("Scheduling pass failed")

    def schedule(self) -> int:
        """One scheduling pass; returns the number of grants.

        The event pass (a request, a release, a tick) looks at the head of the queue (``queue_depth``), the first
        request of each shape further back and the requests that arrived since the last pass: its cost does not
        grow with the queue. The full pass looks at every request with fresh fair-share scores and estimates
        every start; it runs every ``full_pass_seconds`` and after ``replan()``.
        """
        now = self.clock.now()
        q = self.state.queue
        full = self._full_due or now - self._last_full >= self.policy.full_pass_seconds
        growable = self.planning.growable(now)
        arrived, self._arrived = self._arrived, []
        if not len(q) and not self.preemption.warnings and not growable:
            self.state.planned = {}
            if full:
                self._last_full, self._full_due = now, False
            return 0
        if full:
            scores = self.planning.scores(now, {p.user for p in q})
            q.rescore(scores.__getitem__)
            pending = list(q)
        else:
            depth = self.policy.queue_depth
            pending = q.head(depth)
            if len(q) > depth:
                late = [p for lid in arrived if (p := q.get(lid)) is not None and (q.position(lid) or 0) > depth]
                pending += q.in_order(q.shape_heads(depth) + late)
        decision = schedule(pending, self.enforcer.slot_index(now), self.state.table.held_by_user, now=now,
                            **self.planning.options(now, pending, growable))
        if full:
            self.state.planned = dict(decision.planned_start)
            self._last_full, self._full_due = now, False
        else:
            self.state.planned.update(decision.planned_start)
        for grant in decision.grants:
            lease = self.leases[grant.lease_id]
            self.commit(lease, Change(state=LeaseState.GRANTED, reason="granted", devices=grant.gpu_ids,
                                      node=grant.node, granted_at=now, expires_at=now + lease.duration_seconds,
                                      last_activity=now, last_heartbeat=max(lease.last_heartbeat, now)))
            self.inventory.on_grant(lease, now)
        for grant in decision.grown:
            lease = self.leases[grant.lease_id]
            devices = (*lease.devices, *grant.gpu_ids)
            nodes = sorted({self.gpu_by_id[d].node for d in devices})
            self.commit(lease, Change(devices=devices, node=nodes[0] if len(nodes) == 1 else ",".join(nodes),
                                      event="grown"))
            log.info("Lease %s of %s grew to %d GPUs (of %d): +%s", lease.id, lease.user, len(devices),
                     lease.request.max_gpus, ",".join(grant.gpu_ids))
        self.preemption.run(now)
        return len(decision.grants)

    # ------------------------------------------------------------------ time
    def tick(self) -> None:
        """Enforce time: expiry, heartbeats, idleness, warnings, kills, drains. Then schedule."""
        if self._loop is None:
            try:
                self._loop = asyncio.get_running_loop()
            except RuntimeError:
                pass
        self.reconcile_inventory()
        self.enforcer.tick(self.clock.now())
        self.schedule()

    def restore(self) -> dict[str, int]:
        """Reload every non-terminal lease and reconcile it with what is running now."""
        now = self.clock.now()
        live = load_live(self.store, now)
        for lease, alive in live:
            self.state.leases[lease.id] = lease
            self.enforcer.remember(lease.id, alive)
        self.state.table.rebuild(self.leases.values())
        counts = {"queued": 0, "holding": 0, "failed": 0}
        for lease, _ in live:
            if lease.state not in HOLDING:
                self._enqueue(lease, 0.0)  # scored by the full pass below
                counts["queued"] += 1
            elif any(d not in self.gpu_by_id for d in lease.devices):
                self.end(lease, LeaseState.FAILED, "device_gone")
                counts["failed"] += 1
            else:
                counts["holding"] += 1
        self.enforcer.restore_drains(self.store.drains())
        owner: dict[str, str] = {}
        for lease in list(self.state.holding()):
            if not lease.request.shared:
                twice = next((d for d in lease.devices if d in owner), None)
                if twice is not None:
                    log.error("GPU %s is held by leases %s and %s: revoking the later one", twice, owner[twice],
                              lease.id)
                    self.end(lease, LeaseState.FAILED, "double_grant")
                    continue
                owner.update((d, lease.id) for d in lease.devices)
        self.reconcile_inventory()  # an engine's inventory (Ray) finds its placements first
        self._full_due = True
        self.schedule()
        return counts
