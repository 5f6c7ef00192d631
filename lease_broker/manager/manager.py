"""LeaseManager: the one owner of lease state (docs/architecture.md).

It holds the live leases (``LiveState``) and changes them through one path, :meth:`LeaseManager.commit`: the
GPU table, one store transaction and the events together. Its parts read the live state and ask for changes
through ``LeaseOps``; the inventory's changes come back through the ``EngineLink``. The API calls into it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any

from ..core.clock import Clock
from ..core.driver import Driver
from ..core.errors import BadRequest, Forbidden, InvalidTransition
from ..core.gpu import GPU, GpuSample
from ..core.identity import Identity, hash_secret, new_lease_keys
from ..core.lease import (
    HOLDING,
    Change,
    Lease,
    LeaseState,
    Suspension,
    check_transition,
    describe_request,
    parse_request,
    reason_slug,
    renewal_seconds,
)
from ..core.lease_use import LeaseUse
from ..core.scheduler import Grant, Pending, schedule
from ..host.procs import same_process
from ..inventory import Inventory
from ..policy.lease_policy import LeasePolicy
from ..store.admin_store import AdminStore
from ..store.group_commit import GroupCommit
from ..store.lease_store import Store
from .access import LeaseAccess, Waiters
from .accounting import Accounting, Metering
from .enforcer import Enforcer
from .engine import EngineLink
from .estimates import Estimates
from .events import EventBus
from .gpu_summary import GpuSummary
from .holders import Holders
from .holds import Holds
from .planning import Planning, WarmRegrants, resumed
from .policy_admin import PolicyAdmin
from .preemption import Preemption
from .quotas import Quotas
from .reservations import Reservations
from .state import LiveState
from .views import Views, Waits

log = logging.getLogger("lease_broker")

class LeaseManager:
    def __init__(self, store: Store, inventory: Inventory, policy: LeasePolicy, clock: Clock | None = None,
                 events: EventBus | None = None, driver: Driver | None = None) -> None:
        """``driver``: what ends an event-loop iteration (the service attaches its loop at start); without a loop
        each write commits and each pass runs at once (unit tests); the replay's ``SyncDriver`` ends them itself."""
        self.store = store
        self.inventory = inventory
        self.policy = policy
        self.clock = clock or Clock()
        self.events = events or EventBus(clock=self.clock.now)
        self.driver = driver or Driver()
        self.state = state = LiveState(inventory.discover(), lambda: policy.priority_classes)
        self.admin_store = admin = AdminStore(store)
        now = self.clock.now()
        # the parts, each given what it reads and the narrow LeaseOps (``ops``: this object) for what it may ask;
        # none holds the store's writer or the event bus: changes go through commit, events through publish
        self.iteration = Iteration(store=store, driver=self.driver, run_pass=lambda: self.schedule(),
                                   on_failed=self._group_failed)
        self.group = self.iteration.group
        self.holders = Holders(state=state, ops=self, driver=self.driver)  # a lease ends with its holder process
        self.enforcer = Enforcer(state=state, ops=self, policy=policy, probe=inventory, store=store,
                                 clock=self.clock, holders=self.holders)
        self.reservations = Reservations(state=state, ops=self, policy=policy, store=admin, enforcer=self.enforcer,
                                         now=now)
        self.preemption = Preemption(state=state, ops=self, policy=policy, enforcer=self.enforcer,
                                     reservations=self.reservations, plan=lambda: self.planning.plan,
                                     kept=lambda: self.holds.kept())
        self.holds = Holds(state=state, ops=self, policy=policy, may_suspend=self.preemption.may_suspend)  # kept GPUs
        self.quotas = Quotas(state=state, policy=policy, store=admin, reservations=self.reservations,
                             enforcer=self.enforcer)
        self.accounting = Accounting(state=state, policy=policy, store=admin)  # past use: fair share, reports
        self.planning = Planning(state=state, policy=policy, placements=inventory, quotas=self.quotas,
                                 accounting=self.accounting, reservations=self.reservations)
        self.policy_admin = PolicyAdmin(policy=policy, store=admin, ops=self, clock=self.clock)
        self.estimates = Estimates(state=state, policy=policy, holders=self.enforcer)  # queued requests' starts
        self.warm = WarmRegrants(policy=policy)  # a notebook's next request gets the GPUs its last lease gave back
        waits = Waits(state=state, policy=policy, quotas=self.quotas, reservations=self.reservations,
                      estimates=self.estimates)
        self.views = Views(state=state, policy=policy, inventory=inventory, enforcer=self.enforcer,
                           reservations=self.reservations, preemption=self.preemption, estimates=self.estimates,
                           holders=self.holders, waits=waits)
        self.engine = EngineLink(state=state, ops=self, inventory=inventory, enforcer=self.enforcer,
                                 clock=self.clock, driver=self.driver)
        self.metering = Metering(state=state, ops=self)  # what each lease used, from the samples
        self.transitions_total: dict[tuple[str, str], int] = {}
        self.passes = 0  # scheduling passes run so far (``_ended``)
        self._seq = store.next_seq()
        self.access, self.waiters = LeaseAccess(state=state, store=store), Waiters()
        self.gpu_summary = GpuSummary(publish=self.publish, summary=self.summary, driver=self.driver)

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
        self.gpu_summary.sampled(samples, self.state.gpu_by_id)
        self.metering.sampled(samples)

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
        self.policy.check_queued(who.user, self.state.queue.queued_by(who.user))  # max_queued_per_user
        self.quotas.check_placeable(req, who.user)
        now = self.clock.now()
        lease_id, secret = new_lease_keys()
        # the calling process (SO_PEERCRED, never a pid the client names) when it asks to be the holder
        holder = self.holders.holder_of(who.pid) if req.ends_with_caller else None
        lease = Lease(id=lease_id, user=who.user, uid=who.uid, request=req,
                      state=LeaseState.QUEUED, created_at=now, seq=self._seq, reason="requested",
                      duration_seconds=duration, idle_timeout_seconds=idle, last_heartbeat=now, last_activity=now,
                      secret_hash=hash_secret(secret))
        self._seq += 1
        self.commit(lease, Change(state=LeaseState.QUEUED, holder=holder))
        if holder is not None:
            self.group.after(lambda: self.holders.track(lease))  # once stored: its end would find it
        log.info("Lease %s requested by %s: gpus=%s%s", lease.id, who.user, describe_request(req),
                 f", holder process {holder[0]}" if holder is not None else "")
        self.planning.arrived.append(lease.id)
        self.schedule_soon()  # one pass for every request of this loop iteration: the answer waits for it
        return lease, secret

    async def settled(self) -> None:
        """Return once this iteration's pass has run and its writes are stored (answers wait for this)."""
        await self.iteration.settled()

    def lookup(self, lease_id: str, who: Identity) -> Lease:
        return self.access.lookup(lease_id, who)

    def list_leases(self, who: Identity, everyone: bool = False, include_ended: int = 0) -> list[Lease]:
        return self.access.list(who, everyone, include_ended)

    def release(self, lease_id: str, who: Identity, reason: str = "released") -> Lease:
        lease = self.lookup(lease_id, who)
        if lease.state.terminal:
            raise InvalidTransition(f"Lease {lease_id} already ended ({lease.state.value}: {lease.reason})",
                                    extra={"state": lease.state.value})
        if lease.user != who.user and who.admin:
            return self.revoke(lease_id, who, reason or "admin")
        target = LeaseState.CANCELLED if lease.state == LeaseState.QUEUED else LeaseState.RELEASED
        self.end(lease, target, "cancelled" if target == LeaseState.CANCELLED else reason_slug(reason, "released"))
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

    def renew(self, lease_id: str, who: Identity, duration: Any, extend: Any = None) -> Lease:
        lease = self.access.own_live(lease_id, who)
        now = self.clock.now()
        seconds = renewal_seconds(lease, duration, extend, now)  # from now; ``extend``: past the current end
        if seconds <= 0:
            raise BadRequest(f"Invalid duration_seconds {duration!r}: must be > 0")
        if lease.state == LeaseState.QUEUED:
            seconds = min(seconds, float(self.policy.limit(lease.user, "max_duration_seconds")))
            self.policy.check_day_quota(lease.user, lease.gpu_count, seconds)
            self.commit(lease, Change(duration_seconds=seconds))
            return lease
        assert lease.granted_at is not None
        new_expiry = now + seconds
        self.quotas.check_renewal(lease, new_expiry, now)  # max_duration_seconds, reservations, daily quota
        expires = max(lease.expires_at or 0.0, new_expiry)
        self.enforcer.clear_warning(lease, "expiry")
        self.commit(lease, Change(expires_at=expires, duration_seconds=expires - lease.granted_at, event="renewed"))
        self.group.after(lambda: self.inventory.on_renew(lease, now))
        return lease

    def heartbeat(self, lease_id: str, who: Identity, active: bool = False) -> Lease:
        lease = self.access.own_live(lease_id, who)
        now = self.clock.now()
        self.commit(lease, Change(last_heartbeat=now))
        if active and lease.state in HOLDING:
            self.activity(lease, now)
        return lease

    def attach(self, lease_id: str, who: Identity, pid: Any) -> Lease:
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 1:
            raise BadRequest(f"Invalid pid {pid!r}: give the process id of a process you own")
        lease = self.access.own_live(lease_id, who)
        info = self.enforcer.check_attach(pid, who)
        self.commit(lease, Change(attach=(pid, info.start_ticks)))
        return lease

    def history(self, lease_id: str, who: Identity) -> tuple[Lease, list[dict[str, Any]]]:
        """A lease and its transitions, for its owner and admins."""
        return self.lookup(lease_id, who), self.store.history(lease_id)

    # ------------------------------------------------------------------ what else the API asks
    def queue_view(self, who: Identity) -> list[dict[str, Any]]:
        return self.views.queue(who, self.clock.now())

    def quota(self, user: str) -> dict[str, Any]:
        return self.quotas.view(user, self.clock.now())

    def usage_report(self, who: Identity, since: float, by: str = "user", label: str = "") -> list[dict[str, Any]]:
        now = self.clock.now()
        return self.accounting.report(who, now - since, now, by, label)

    def update_policy(self, who: Identity, changes: dict[str, Any]) -> dict[str, Any]:
        return self.policy_admin.update(who.user, changes, source="api")

    def policy_audit(self, limit: int) -> list[dict[str, Any]]:
        return self.admin_store.audit_log(limit)

    def reservation_views(self, ended_within: float, include_cancelled: bool) -> list[dict[str, Any]]:
        now = self.clock.now()
        rs = self.admin_store.reservations(since=now - ended_within, include_cancelled=include_cancelled)
        return [self.reservations.view(r, now) for r in rs]

    def reservation_view(self, rid: str) -> dict[str, Any]:
        return self.reservations.view(self.reservations.get(rid), self.clock.now())

    def reserve(self, who: Identity, body: Any) -> dict[str, Any]:
        """Book an advance reservation; the next pass (soon) honours it."""
        now = self.clock.now()
        return self.reservations.changed(self.reservations.create(who, body, now), "created", now)

    def cancel_reservation(self, who: Identity, rid: str) -> dict[str, Any]:
        now = self.clock.now()
        return self.reservations.changed(self.reservations.cancel(who, rid, now), "cancelled", now)

    async def wait(self, lease: Lease, timeout: float) -> Lease:
        """Wait until a queued (or suspended) lease is granted or ends, at most ``timeout`` seconds."""
        return await self.waiters.wait(lease, timeout)

    # ------------------------------------------------------------------ suspension (docs/architecture.md)
    def suspended(self, lease_id: str, who: Identity, body: Any) -> Lease:
        """The holder's report (``POST .../suspended``): ``{"ok": true, "how", "host_bytes"}``: its processes are
        suspended, the lease becomes SUSPENDED and its GPUs go to others; ``{"ok": false, "why"}``: it could not, and
        a pending ask falls back at once to what the broker would have done without suspension."""
        lease = self.access.own_live(lease_id, who)
        if not isinstance(body, dict):
            raise BadRequest("Give a JSON object: {\"ok\": true, \"how\": \"checkpoint\"} or {\"ok\": false, \"why\": ...}")
        ok = body.get("ok", True)
        if not isinstance(ok, bool):
            raise BadRequest(f"Invalid ok {ok!r}: must be true or false")
        ask = lease.suspension if lease.suspension is not None and not lease.suspension.suspended else None
        if not ok:
            why = body.get("why", "")
            text = " ".join(str(why).split())[:300] if why else "its holder could not suspend it"
            if ask is not None and lease.state in HOLDING:
                log.info("Lease %s of %s could not be suspended (%s): %s", lease.id, lease.user, ask.why, text)
                self.enforcer.fall_back(lease, text)
            return lease
        how = body.get("how") or "checkpoint"
        if how not in ("checkpoint", "stop"):
            raise BadRequest(f"Invalid how {how!r}: use 'checkpoint' or 'stop'")
        host_bytes = body.get("host_bytes", 0)
        if isinstance(host_bytes, bool) or not isinstance(host_bytes, int) or host_bytes < 0:
            raise BadRequest(f"Invalid host_bytes {host_bytes!r}: give a number of bytes")
        if not lease.request.suspendable:
            raise BadRequest(f"Lease {lease_id} was not requested suspendable: its GPUs cannot be given back this way")
        if lease.state not in HOLDING:
            raise InvalidTransition(f"Lease {lease_id} is {lease.state.value}: only a lease that holds GPUs is "
                                    "suspended", extra={"state": lease.state.value})
        now = self.clock.now()
        gpu = self.gpu_by_id.get(lease.devices[0]) if lease.devices else None
        remaining = max(0.0, lease.expires_at - now) if lease.expires_at is not None else lease.duration_seconds
        state = dataclasses.replace(ask or Suspension(why="user", asked_at=now),  # no ask: of its own accord
                                    since=now, devices=tuple(lease.devices), model=gpu.name if gpu is not None else "",
                                    remaining=remaining, how=how)
        why = state.why
        self.commit(lease, Change(state=LeaseState.SUSPENDED, reason=why, devices=(), suspension=state,
                                  suspensions=lease.suspensions + 1))
        log.info("Lease %s of %s suspended (%s, %s, %d bytes in host memory): %d GPU(s) free", lease.id, lease.user,
                 why, how, host_bytes, len(state.devices))
        self.group.after(self.schedule_soon)  # its GPUs go to the queue
        return lease

    def resume(self, lease_id: str, who: Identity) -> Lease:
        """A suspended lease wants its GPUs back (``POST .../resume``): ``suspension.resume``; the scheduler grants
        it GPUs of the model it left (``resumed``), before new requests of its class."""
        lease = self.access.own_live(lease_id, who)
        s = lease.suspension
        if lease.state != LeaseState.SUSPENDED or s is None:
            raise InvalidTransition(f"Lease {lease_id} is {lease.state.value}: only a suspended lease resumes",
                                    extra={"state": lease.state.value})
        if not s.resume:
            self.commit(lease, Change(suspension=dataclasses.replace(s, resume=True), event="resume_asked"))
        self.replan()  # (its GPUs may be free now)
        return lease

    def ask_suspend(self, lease: Lease, why: str, *, by: Lease | None = None, resume: bool = False,
                    deadline: float | None = None) -> bool:
        if not lease.request.suspendable or lease.state not in HOLDING or lease.suspension is not None:
            return False
        now = self.clock.now()
        report = now + float(self.policy.suspend_report_seconds)
        ask = Suspension(why=why, asked_at=now, deadline=min(report, deadline) if deadline is not None else report,
                         by_lease=by.id if by is not None else "", by_user=by.user if by is not None else "",
                         resume=resume)
        log.info("Lease %s of %s asked to suspend (%s%s) by %.0f", lease.id, lease.user, why,
                 f", for lease {ask.by_lease} of {ask.by_user}" if by is not None else "", ask.deadline)
        self.commit(lease, Change(suspension=ask, event="suspend_asked"))
        return True

    # ------------------------------------------------------------------ the one mutation path
    def commit(self, lease: Lease, change: Change) -> None:
        """Apply one change of a lease: check the transition, write the store (the iteration's group commit;
        the lease is left as it was if that fails), update the GPU table and wake waiters; the event goes out
        once the write is stored.

        A soft change (activity, heartbeat, usage, warnings: nothing stored, no event, a live lease that is not
        suspended) only changes the lease in memory: applied at once, without the checks below that could not apply
        to it. Activity reports are most commits (1.03 M of them on the overloaded month replay,
        benchmarks/replay_month.py): one cost 9.0 us of CPU, 4.4 us with this and ``Change``'s constructor
        (``core/lease.py: _change_init``), on that replay's state after 6,000 events of its 3,000-job version."""
        now = self.clock.now()
        if change.state is None and not (change.stored or change.attach is not None or change.event
                                         or lease.state == LeaseState.SUSPENDED or lease.state.terminal):
            change.apply(lease, now)  # (``soft``: what follows changes nothing for it)
            return
        new = lease.id not in self.state.leases and change.state == LeaseState.QUEUED and not lease.ended_at
        before = None if new else lease.state
        if before is not None and change.state is not None:
            check_transition(lease.id, before, change.state)
        writes = new or change.state is not None or change.stored or change.attach is not None
        saved = dict(lease.__dict__) if writes else {}  # (the undo of a write; activity alone writes nothing)
        change.apply(lease, now)
        if writes:
            try:
                self.group.lease_write(lease, lambda: self._undo(lease, saved, new), now, new=new,
                                       from_state=before if change.state is not None else None,
                                       row=change.state is not None or change.stored or change.attach is not None)
            except Exception:
                lease.__dict__.update(saved)
                raise
        if new:
            self.state.leases[lease.id] = lease
            self._enqueue(lease, self.planning.scores(now, {lease.user}).get(lease.user, 0.0))
        elif lease.state.terminal:
            self.state.leases.pop(lease.id, None)
        if before == LeaseState.QUEUED and change.state is not None:
            self.state.queue.remove(lease.id)
            self.state.planned.pop(lease.id, None)
            self.state.waiting.pop(lease.id, None)
        if LeaseState.SUSPENDED in (before, lease.state) or (  # queued for its GPUs while it wants them back
                before == LeaseState.QUEUED and change.state is not None and self.planning.held_back):
            self.planning.resuming(lease)
        if change.moves:
            self.state.table.sync(lease)
        if change.state is not None and before is not None:
            self._log_transition(lease, before)
        if change.state is not None or change.event:
            view = self.view(lease) if self.events.views else {"id": lease.id}  # (the replay's: ``EventBus``)
            event = {"lease": view, "user": lease.user, "change": change.event or lease.state.value,
                     "previous": before.value if before is not None else None}
            self.group.after(lambda: self.events.publish("lease", **event))
        if before in (LeaseState.QUEUED, LeaseState.SUSPENDED) and change.state is not None:
            self.waiters.left_queue(lease)
        if change.state is not None:  # the suspended leases, for the enforcer (never idle, expired or drained)
            if lease.state == LeaseState.SUSPENDED:
                self.state.suspended[lease.id] = lease
            else:
                self.state.suspended.pop(lease.id, None)
        if change.devices is not None or (before in HOLDING) != (lease.state in HOLDING):
            self.group.after(self.gpus_changed)

    def _undo(self, lease: Lease, saved: dict[str, Any], new: bool) -> None:
        """A group commit failed: this change of ``lease`` was not stored, so memory goes back to ``saved`` (its
        fields before the change)."""
        lease.__dict__.update(saved)
        if new:
            self.state.leases.pop(lease.id, None)
            self.state.queue.remove(lease.id)  # (a no-op when it is not queued)
            self.state.waiting.pop(lease.id, None)
        elif not lease.state.terminal:
            self.state.leases[lease.id] = lease
            if lease.state == LeaseState.SUSPENDED:
                self.state.suspended[lease.id] = lease
            else:
                self.state.suspended.pop(lease.id, None)
            if lease.state == LeaseState.QUEUED and lease.id not in self.state.queue:
                self._enqueue(lease, 0.0)  # re-scored by the full pass _group_failed asks for

    def _group_failed(self) -> None:
        self.state.table.rebuild(self.state.leases.values())
        self.planning.full_due = True
        self.gpus_changed()

    def _enqueue(self, lease: Lease, score: float) -> None:
        self.state.queue.add(Pending.of(lease, self.warm.prefer(lease)), score)

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
        s = lease.suspension if lease.state == LeaseState.SUSPENDED else None
        self.commit(lease, Change(state=target, reason=reason, suspended_seconds=None if s is None else
                                  lease.suspended_seconds + max(0.0, self.clock.now() - s.since)))
        if held:
            self.enforcer.drain(lease)  # before this iteration's pass can hand its GPUs on
        passes = self.passes
        self.group.after(lambda: self._ended(lease, held, passes, s is not None))

    def _ended(self, lease: Lease, held: bool, passes: int, suspended: bool = False) -> None:
        """Once a lease's end is stored: its processes stop (a suspended lease's are continued first, so that they
        can exit), the inventory hears, its GPUs go to the queue: a pass, unless one ran since the end (``passes``:
        how many had run then), which handed them on already (a tick's ends: its pass runs after them, in the same
        iteration). On the overloaded month replay (benchmarks/replay_month.py) shortened to 3,000 jobs, every idle
        revocation made a second pass of the same instant that granted nothing: 11,000 passes before, 8,035 after,
        with the same decisions."""
        if held or suspended:
            self.enforcer.stop(lease, cont=suspended)
        if held:
            self.warm.ended(lease)  # its notebook's next request may get these GPUs again
        self.estimates.ended(lease)  # how long it held its GPUs: the history of the start estimates
        self.holders.ended(lease)  # its holder's watch closes with the holder's last lease
        self.inventory.on_end(lease)
        requeued, self.planning.requeued = self.planning.requeued, False  # suspended leases it held back queued
        if (held or requeued or self.preemption.asked_for(lease.id)) and self.passes == passes:
            self.schedule_soon()

    def mark_idle(self, lease: Lease) -> None:
        self.commit(lease, Change(state=LeaseState.IDLE, reason="no_activity"))

    def activity(self, lease: Lease, now: float) -> None:
        pauses = self.enforcer.resumed(lease, now)  # the pause it came back from; its idle warning no longer holds
        if lease.state in (LeaseState.GRANTED, LeaseState.IDLE):
            self.commit(lease, Change(state=LeaseState.ACTIVE, reason="activity", last_activity=now, pauses=pauses))
        else:
            self.commit(lease, Change(last_activity=now, pauses=pauses))

    def used(self, lease: Lease, use: LeaseUse) -> None:
        self.commit(lease, Change(use=use))

    def schedule_soon(self) -> None:
        """A pass at the end of this event-loop iteration, one for every change of it (``Iteration``)."""
        self.iteration.pass_soon()

    def replan(self) -> None:
        """The policy, the reservations or the GPUs changed: the next pass (soon) is a full one."""
        self.planning.full_due = True
        self.schedule_soon()

    def gpus_changed(self) -> None:
        self.gpu_summary.changed()

    def publish(self, kind: str, /, **fields: Any) -> None:
        self.group.after(functools.partial(self.events.publish, kind, **fields))

    def placed(self, lease: Lease, devices: tuple[str, ...] | None) -> None:
        self.commit(lease, Change(devices=devices, event="placed"))

    def set_gpus(self, gpus: list[GPU]) -> None:
        """The inventory changed (an engine's node joined or left); leases on GPUs that left are the caller's."""
        self.state.set_gpus(gpus)
        self.planning.full_due = True

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> int:
        """One scheduling pass (an event or a full one: ``Planning.select``); returns how many grants it committed."""
        self.passes += 1
        now = self.clock.now()
        growable = self.planning.growable(now)
        if not len(self.state.queue) and not self.preemption.warned and not self.preemption.asked and not growable:
            self.planning.select(now)  # keeps the full passes' rhythm
            self.state.planned, self.state.waiting = {}, {}
            return 0
        granted = 0
        for kept_pending, kept_slots in self.holds.passes(lambda: self.enforcer.slot_index(now), now):
            # (a suspended lease's kept GPUs: its resume, then its borrowers, alone on them: holds.py)
            kept = schedule(kept_pending, kept_slots, self.state.table.held_by_user, now=now,
                            **{**self.planning.options(now, []), "plan": None, "all_exclusive": False})
            for grant in kept.grants:
                self._grant(self.leases[grant.lease_id], grant, now)
            granted += len(kept.grants)
        pending, full = self.planning.select(now)
        decision = self.planning.decide(self.holds.others(pending), full, self.holds.hide(self.enforcer.slot_index(now)),
                                        self.state.table.held_by_user, now, growable)
        self.planning.plan = decision.plan
        self.state.planned = dict(decision.planned_start) if full else {**self.state.planned, **decision.planned_start}
        self.state.waiting.update(decision.waiting)  # (a request leaves it as it leaves the queue: commit)
        for grant in decision.grants:
            self._grant(self.leases[grant.lease_id], grant, now)
        for grant in decision.grown:
            lease = self.leases[grant.lease_id]
            devices = (*lease.devices, *grant.gpu_ids)
            nodes = sorted({self.gpu_by_id[d].node for d in devices})
            self.commit(lease, Change(devices=devices, node=nodes[0] if len(nodes) == 1 else ",".join(nodes),
                                      event="grown"))
            log.info("Lease %s of %s grew to %d GPUs (of %d): +%s", lease.id, lease.user, len(devices),
                     lease.request.max_gpus, ",".join(grant.gpu_ids))
        self.holds.run(now)
        self.preemption.run(now)
        return granted + len(decision.grants)

    def _grant(self, lease: Lease, grant: Grant, now: float) -> None:
        """Commit a pass's grant: a queued request is granted, a suspended lease resumes (``resumed``)."""
        if lease.state == LeaseState.SUSPENDED:  # a suspended lease resumes (planning.resumed: the one change)
            self.commit(lease, resumed(lease, grant, now))
        else:
            self.commit(lease, Change(state=LeaseState.GRANTED, reason="granted", devices=grant.gpu_ids,
                                      node=grant.node, granted_at=now, expires_at=now + lease.duration_seconds,
                                      last_activity=now, last_heartbeat=max(lease.last_heartbeat, now)))
        self.group.after(functools.partial(self.inventory.on_grant, lease, now))

    # ------------------------------------------------------------------ time
    def tick(self) -> None:
        """Enforce time: expiry, heartbeats, idleness, warnings, kills, drains. Then schedule."""
        step = self.clock.resync()  # deadlines run on the monotonic clock; a wall-clock step moves them all
        if step:
            self.retime(step)
        self.holders.tick()  # holders restored before the loop ran are watched from now on
        self.engine.reconcile()
        self.enforcer.tick(self.clock.now())
        self.schedule()

    def retime(self, step: float) -> None:
        """The wall clock stepped ``step`` seconds (and the clock followed it): every time a live lease keeps moves
        by as much, through ``commit`` (stored, and a ``retimed`` event with the new times), and so do the parts'
        deadlines, so that no lease loses or gains time and the times people read are the wall clock's again."""
        leases = list(self.state.leases.values())
        log.warning("Wall clock stepped %+.3f s: moving the times of %d live lease(s) and their deadlines by as much "
                    "(each keeps its remaining time)", step, len(leases))
        for lease in leases:
            self.commit(lease, Change(shift=step, event="retimed"))
            queued = self.state.queue.get(lease.id)
            if queued is not None:  # its queue entry keeps when it was requested (small_first_timeout)
                self.state.queue.remove(lease.id)
                # back in its place (arrival order), its user re-scored by the full pass that replan asks for
                self.state.queue.add(dataclasses.replace(queued, queued_at=lease.created_at), 0.0)
        self.enforcer.retime(step)
        self.replan()

    def restore(self) -> dict[str, int]:
        """Reload every non-terminal lease and reconcile it with what is running now."""
        now = self.clock.now()
        live = reconciled(self.store.live(), now)
        for lease, _ in live:
            self.state.leases[lease.id] = lease
        for lease, change in live:
            self.commit(lease, change)  # (stored only when processes it had are gone)
        self.state.table.rebuild(self.leases.values())
        self.preemption.restored(list(self.leases.values()))
        counts = {"queued": 0, "holding": 0, "failed": 0, "holder_exited": 0, "suspended": 0}
        for lease, _ in live:
            if lease.state == LeaseState.SUSPENDED:  # holds no GPU: its holder resumes it, or it ends by time
                self.state.suspended[lease.id] = lease
                counts["suspended"] += 1
                continue  # (queued by commit when it wants its GPUs back: planning.resuming)
            if lease.state not in HOLDING:
                self._enqueue(lease, 0.0)  # scored by the full pass below
                counts["queued"] += 1
            elif any(d not in self.gpu_by_id for d in lease.devices):
                self.end(lease, LeaseState.FAILED, "device_gone")
                counts["failed"] += 1
            else:
                counts["holding"] += 1
        suspended = set(self.state.suspended)
        for lease in self.holders.restored([lease for lease, _ in live if not lease.state.terminal]):
            counts["holder_exited"] += 1  # its holder exited while the broker was down (or its pid is another's)
            counts["queued" if lease.state == LeaseState.CANCELLED else
                   "suspended" if lease.id in suspended else "holding"] -= 1
        self.enforcer.restore_drains(self.store.drains())
        for lease, gpu, other in double_grants(list(self.state.holding())):
            log.error("GPU %s is held by leases %s and %s: revoking the later one", gpu, other, lease.id)
            self.end(lease, LeaseState.FAILED, "double_grant")
        self.engine.reconcile()  # an engine's inventory (Ray) finds its placements first
        self.planning.full_due = True
        self.schedule()
        return counts


def reconciled(stored: list[Lease], now: float) -> list[tuple[Lease, Change]]:
    """The live leases as stored (in arrival order), each with the change that reconciles it with now: its holders
    could not heartbeat while the broker was down, and only its processes still alive (by start time) stay
    attached."""
    out = []
    for lease in stored:
        alive = {p: t for p, t in lease.processes.items() if same_process(p, t)}
        out.append((lease, Change(last_heartbeat=now, last_activity=max(lease.last_activity, now),
                                  processes=alive if alive != lease.processes else None)))
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


log = logging.getLogger("lease_broker")


class Iteration:
    """The end of an event-loop iteration: one scheduling pass for every change of the iteration, then the group
    commit of every write it made (``store.group_commit``).

    Under load many requests and releases arrive in one iteration; the first change of an iteration queues one
    callback (``Driver.call_soon``) that runs the pass (which may add grants) and then commits the iteration's
    writes together. Answers wait for it (:meth:`settled`), so a client that releases and then asks again sees the
    GPU handed on, and no answer reports a change that is not stored yet. Without a deferring driver a pass runs at
    once and writes commit at once, through the same group commit.
    """

    def __init__(self, *, store: Store, driver: Driver, run_pass: Callable[[], object],
                 on_failed: Callable[[], None]) -> None:
        self._run_pass, self.driver = run_pass, driver
        self.group = GroupCommit(store, driver, on_open=self._queue, on_failed=on_failed)
        self._queued = False  # the end-of-iteration callback is queued
        self._pass_due = False
        self._waiting: list[asyncio.Future[None]] = []

    def pass_soon(self) -> None:
        """A scheduling pass at the end of this iteration (one for all its changes); at once without a loop."""
        if not self.driver.deferred:
            self._run_pass()
            return
        self._pass_due = True
        self._queue()

    async def settled(self) -> None:
        """Return once the pass queued so far has run and every write so far is stored (``StoreError`` if the
        writes could not be stored)."""
        if self._queued and not self.group.open:  # a pass is due: it may write
            fut = asyncio.get_running_loop().create_future()
            self._waiting.append(fut)
            await fut
        await self.group.durable()

    def _queue(self) -> None:
        if not self._queued:
            self._queued = True
            self.driver.call_soon(self._end)

    def _end(self) -> None:
        if self._pass_due:
            self._pass_due = False
            try:
                self._run_pass()
            except Exception:  # e.g. the store cannot be written: the next request, release or tick tries again
                log.exception("Scheduling pass failed")
        self._queued = False  # from here, a change (e.g. by an action after the commit) queues the next one
        self.group.flush()
        waiting, self._waiting = self._waiting, []
        for fut in waiting:
            if not fut.done():
                fut.set_result(None)
