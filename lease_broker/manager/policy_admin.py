"""The LeaseManager's admin side (mixed into it): fair share, daily quotas, reservations, preemption,
hot policy reload with an audit trail, and the usage report.

The scheduler stays pure: this mixin computes its inputs (usage, budgets, reservation windows) from the store
and the live leases, and acts on what a pass leaves blocked (preemption).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from typing import TYPE_CHECKING, Any, cast

from traitlets import TraitError

from ..core.errors import BadRequest, Forbidden, LeaseError
from ..core.fairshare import FairShare
from ..core.fractional import mps_running
from ..core.identity import Identity
from ..core.lease import HOLDING, Lease, LeaseRequest
from ..core.reservation_windows import window_shortfall, window_slots
from ..core.scheduler import Decision, Growing, Pending
from ..policy.limits import DAY
from ..store.admin_store import AdminStore, Reservation
from . import preemption, reservations

if TYPE_CHECKING:
    from .manager import LeaseManager

log = logging.getLogger("lease_broker")


def policy_values(policy: Any) -> dict[str, Any]:
    return {name: getattr(policy, name) for name in sorted(policy.trait_names(config=True))}


class PolicyMixin:
    """Admin policies for LeaseManager. State is created lazily (the manager's __init__ stays as it is)."""

    @property
    def _m(self) -> LeaseManager:
        return cast("LeaseManager", self)

    @functools.cached_property
    def admin_store(self) -> AdminStore:
        m = self._m
        return AdminStore(m.store)

    @functools.cached_property
    def preempting(self) -> dict[str, preemption.Warning_]:
        return {}

    @functools.cached_property
    def _fairshare(self) -> FairShare:
        m = self._m
        return FairShare(m.policy.fairshare_half_life_seconds)

    @functools.cached_property
    def _reservations(self) -> list[Reservation]:
        m = self._m
        return m.admin_store.reservations(since=m.clock.now())

    def reservation_list(self, now: float) -> list[Reservation]:
        """Reservations not cancelled and not ended before the broker started (the live list)."""
        m = self._m
        return m._reservations

    # ------------------------------------------------------------------ scheduler inputs
    def fairshare_usage(self, now: float, users: set[str] | None = None) -> dict[str, float]:
        """Decayed past GPU-seconds per user (ended leases from the store, plus running leases); only of
        ``users`` when given (a pass needs those of the waiting requests only)."""
        m = self._m
        fs = m._fairshare
        if fs.half_life != m.policy.fairshare_half_life_seconds:
            fs = self.__dict__["_fairshare"] = FairShare(m.policy.fairshare_half_life_seconds)
        table = m.table
        left = table.take_left()  # leases that stopped holding since the last call
        if not fs.loaded:
            holding = {lid for by_user in table.holding_by_user.values() for lid in by_user}
            ended = [(u, g, a, e) for lid, u, g, a, e, _ in m.admin_store.held_intervals(0.0)
                     if e is not None and lid not in holding]
            fs.load(ended, now)
        else:
            fs.decay_to(now)
            for user, gpus, granted_at, ended_at in left:  # ended since the last call: to the ended total
                if granted_at is not None and ended_at is not None:
                    fs.add(user, gpus, granted_at, ended_at, now=now)
        fs.decay_to(now)
        usage = dict(fs.ended) if users is None else {u: fs.ended[u] for u in users if u in fs.ended}
        for user, running in table.running_usage(table.holding_by_user if users is None else users, now,
                                                 fs.half_life).items():
            usage[user] = usage.get(user, 0.0) + running
        return usage

    def day_budget(self, now: float, users: set[str]) -> dict[str, float] | None:
        """GPU-seconds each user (and "@group") may still be granted in the rolling 24 h, or None (no quotas)."""
        m = self._m
        pol = m.policy
        if not pol.quotas_configured():
            return None
        cutoff = now - DAY
        charged: dict[str, float] = {}
        for lid, user, gpus, start, ended, expires in m.admin_store.held_intervals(cutoff):
            live = m.leases.get(lid)
            if live is not None and live.state in HOLDING:
                end = max(live.expires_at or now, now)  # running: its whole time limit is committed
            else:  # ended: the time it held, up to its time limit (stopping it late is not the user's use)
                end = min(e for e in (ended, expires, now) if e is not None)
            secs = gpus * max(0.0, end - max(start, cutoff))
            for key in (user, *("@" + g for g in pol.groups_of(user))):
                charged[key] = charged.get(key, 0.0) + secs
        budget: dict[str, float] = {}
        for user in users:
            for key, seconds in pol.day_quotas(user).items():
                budget[key] = seconds - charged.get(key, 0.0)
        return budget

    def check_placeable(self, req: LeaseRequest) -> None:
        """Refuse a gang that no node can ever hold (it would wait forever)."""
        m = self._m
        if req.shared or req.locality != "node":
            return
        biggest = m.table.biggest_node
        if req.min_gpus > biggest:
            raise BadRequest(
                f"Request for {req.min_gpus} GPUs on one node can never be granted: the largest node has {biggest}; "
                "ask for fewer, or let the GPUs span nodes (locality 'any', `gpulease request --spread`)",
                reason="too_large",
            )

    def check_renewal(self, lease: Lease, new_expiry: float) -> None:
        """Refuse a renewal past max_duration_seconds from the grant (reason ``max_duration``), into GPUs a
        reservation needs (``reserved``), or over the holder's (or a group's) daily GPU-hours (``quota``)."""
        m = self._m
        now = m.clock.now()
        max_duration = float(m.policy.limit(lease.user, "max_duration_seconds"))
        limit = (lease.granted_at or now) + max_duration
        if new_expiry > limit + 1e-6:
            raise Forbidden(
                f"Renewal refused: lease {lease.id} may not hold GPUs past {max_duration:g} s from its grant "
                f"(max_duration_seconds); at most {max(0.0, limit - now):.0f} s more",
                reason="max_duration", extra={"max_expires_at": limit},
            )
        wins = reservations.windows(m, now) if m.reservation_list(now) else []
        if wins:  # not into a reservation that would then lack GPUs at its start (unless a member holds it)
            ix = m.slot_index()  # a fork: the renewal is tried on its own copies of the lease's slots
            before = window_shortfall(ix.all(), wins, now)
            for d in lease.devices:
                if d in ix.by_id:
                    s = ix.edit(d)
                    s.free_at = max(s.free_at, new_expiry)
            after = window_shortfall(ix.all(), wins, now)
            w = next((w for w in sorted(wins, key=lambda w: w.start) if after[w.id] > before[w.id]), None)
            if w is not None:
                raise Forbidden(
                    f"Renewal refused: {w.gpus} GPU(s) are reserved from "
                    f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(w.start))} (reservation {w.id}) and this "
                    f"lease's GPUs are needed for it; renew until then at most ({max(0.0, w.start - now):.0f} s "
                    "from now)",
                    reason="reserved", extra={"max_expires_at": w.start},
                )
        extra = lease.gpu_count * max(0.0, new_expiry - max(lease.expires_at or now, now))
        for key, left in (m.day_budget(now, {lease.user}) or {}).items():
            if extra > left + 1e-6:
                raise Forbidden(
                    f"Renewal refused: {extra / 3600:.2f} more GPU-hours exceed what is left today of the daily "
                    f"quota of {key.lstrip('@')} ({max(0.0, left) / 3600:.2f} GPU-hours; gpu_hours_per_day)",
                    reason="quota",
                )

    def growable(self) -> list[Lease]:
        """Holding incremental leases below their max_gpus (placed by the broker itself, not by an engine)."""
        m = self._m
        now = m.clock.now()
        return [lease for lease in m.table.growable.values()
                if (lease.expires_at or 0.0) > now and m.inventory.placement(lease) is None]

    def schedule_options(self, now: float, pending: list[Pending]) -> dict[str, Any]:
        """Keyword arguments of scheduler.schedule() beyond pending, slots and held: the policy and its inputs."""
        m = self._m
        weights = m.policy.weight
        cutoff = now - DAY
        growing = [  # an added GPU is charged (daily quota) as the store counts it: from the grant to the end
            Growing(Pending(lease.id, lease.user, lease.request, lease.seq,
                            (lease.expires_at or now) - max(lease.granted_at or now, cutoff)),
                    tuple(lease.devices), lease.expires_at or now)
            for lease in m.growable()]
        users = {p.user for p in pending} | {g.pending.user for g in growing}
        usage = {u: v / weights(u) for u, v in m.fairshare_usage(now, users).items()}
        return {"policy": m.policy.scheduler_policy(), "usage": usage, "budget": m.day_budget(now, users),
                "reservations": reservations.windows(m, now), "growing": growing}

    def after_schedule(self, decision: Decision) -> None:
        """After a pass: grow incremental leases, publish GPU changes, track grants for fair share, preempt for
        blocked requests."""
        m = self._m
        for grant in decision.grown:
            lease = m.leases[grant.lease_id]
            lease.devices = [*lease.devices, *grant.gpu_ids]
            nodes = sorted({m.gpu_by_id[d].node for d in lease.devices})
            lease.node = nodes[0] if len(nodes) == 1 else ",".join(nodes)
            m.table.sync(lease)
            m.store.update(lease)
            log.info("Lease %s of %s grew to %d GPUs (of %d): +%s", lease.id, lease.user, len(lease.devices),
                     lease.request.max_gpus, ",".join(grant.gpu_ids))
            m.events.publish("lease", lease=m.view(lease), change="grown", previous=lease.state.value, user=lease.user)
        if decision.grants or decision.grown:
            m._emit_gpus()
        if self.__dict__.get("_preempt_busy"):
            return
        self.__dict__["_preempt_busy"] = True
        try:
            preemption.run(m, m.clock.now())
        finally:
            self.__dict__["_preempt_busy"] = False

    # ------------------------------------------------------------------ views
    def mps_enabled(self) -> bool:
        mode = self._m.policy.shared_mps
        return mode == "on" or (mode == "auto" and mps_running())

    def reserved_now(self, free_only: bool = True) -> dict[str, str]:
        """GPUs held for a reservation whose window is open now (GPU id -> reservation id): those no lease
        holds (shown as 'reserved'), or with ``free_only=False`` also those its members hold."""
        m = self._m
        now = m.clock.now()
        if not any(r.start <= now < r.end for r in m.reservation_list(now)):
            return {}
        wins = [w for w in reservations.windows(m, now) if w.start <= now]
        out = {gpu_id: ws[0].id for gpu_id, ws in window_slots(m.slots(), wins, now).items()}
        if free_only:
            held = {d for lease in m.leases.values() if lease.state in HOLDING for d in lease.devices}
            out = {g: rid for g, rid in out.items() if g not in held}
        return out

    def publish_reservation(self, r: Reservation, change: str) -> None:
        """An event for the sidebar and `gpulease status`: a reservation was created or cancelled."""
        m = self._m
        m.events.publish("reservation", change=change, reservation=reservations.view(m, r, m.clock.now()), user=None)
        m._emit_gpus()

    def gpu_states(self) -> dict[str, tuple[str, list[Lease]]]:
        m = self._m
        states = super().gpu_states()  # type: ignore[misc]
        reserved = m.reserved_now()
        return {g: ("reserved", hs) if st == "free" and g in reserved else (st, hs) for g, (st, hs) in states.items()}

    def gpu_views(self, who: Identity) -> list[dict[str, Any]]:
        """GPU views; a reserved GPU says for whom (``reservation``: id, user or group, end)."""
        m = self._m
        views: list[dict[str, Any]] = super().gpu_views(who)  # type: ignore[misc]
        reserved = m.reserved_now() if m._reservations else {}
        if reserved:
            by_id = {r.id: r for r in m.reservation_list(m.clock.now())}
            for v in views:
                r = by_id.get(reserved.get(v["id"], ""))
                if r is not None:
                    v["reservation"] = {"id": r.id, "user": r.user, "group": r.group, "end": r.end}
        return views

    def summary(self) -> dict[str, Any]:
        m = self._m
        out: dict[str, Any] = super().summary()  # type: ignore[misc]
        n = sum(1 for g, (st, _) in m.gpu_states().items() if st == "reserved") if m._reservations else 0
        if n:
            out["states"]["free"] = out["states"].get("free", 0) - n
            out["states"]["reserved"] = n
            out["free"] -= n
        return out

    def view(self, lease: Lease, who: Identity | None = None) -> dict[str, Any]:
        """The lease view, with its preemption: the class that preempts it (and, for admins, by whom)."""
        m = self._m
        out: dict[str, Any] = super().view(lease)  # type: ignore[misc]
        w = m.preempting.get(lease.id)
        if w is not None:
            out["preempting"] = {"by_class": w.by_class, "deadline": w.deadline}
        elif lease.reason == preemption.REASON:
            info = m.admin_store.preemption(lease.id)
            out["preempted_by"] = {"priority": info["by_class"] if info else None}
            if info and who is not None and who.admin:
                out["preempted_by"].update(user=info["by_user"], lease_id=info["by_lease"])
        return out

    # ------------------------------------------------------------------ hot reload
    def update_policy(self, who: str, changes: dict[str, Any], source: str = "api") -> dict[str, Any]:
        """Apply policy changes without dropping leases; refuse an invalid one naming the field; audit it."""
        m = self._m
        pol = m.policy
        current = policy_values(pol)
        for key in changes:
            if key not in current:
                raise BadRequest(f"Unknown policy field {key!r}", extra={"field": key})
        candidate = type(pol)(**{k: v for k, v in current.items()})
        for key, value in changes.items():
            try:
                setattr(candidate, key, value)
            except (TraitError, ValueError, TypeError) as e:
                raise BadRequest(f"Invalid policy field {key}={value!r}: {e}", extra={"field": key}) from None
        diff = {k: [current[k], getattr(candidate, k)] for k in changes if getattr(candidate, k) != current[k]}
        if not diff:
            return {}
        with pol.hold_trait_notifications():
            for key, (_, new) in diff.items():
                setattr(pol, key, new)
        now = m.clock.now()
        m.admin_store.audit(now, who, source, diff)
        log.info("Policy changed by %s via %s: %s", who, source, ", ".join(sorted(diff)))
        m.events.publish("policy", change="updated", fields=sorted(diff), by=who if source != "api" else None)
        m.schedule()
        return diff

    # ------------------------------------------------------------------ reports
    def usage_report(self, who: Identity, since: float) -> list[dict[str, Any]]:
        """Per user since ``since``: GPU-hours held, GPU-hours busy (active), leases, revocations."""
        m = self._m
        now = m.clock.now()
        out: dict[str, dict[str, Any]] = {}
        for row in m.admin_store.usage_rows(since):
            if not who.admin and row["user"] != who.user:
                continue
            u = out.setdefault(row["user"], {"user": row["user"], "gpu_hours_held": 0.0, "gpu_hours_busy": 0.0,
                                             "leases": 0, "revocations": 0, "preempted": 0})
            end = row["ended_at"] if row["ended_at"] is not None else now
            u["gpu_hours_held"] += row["gpus"] * max(0.0, end - max(row["granted_at"], since)) / 3600
            trans = row["transitions"] + [("", end)]
            for (state, at), (_, nxt) in zip(trans, trans[1:], strict=False):
                if state == "active":
                    u["gpu_hours_busy"] += row["gpus"] * max(0.0, min(nxt, end) - max(at, since)) / 3600
            u["leases"] += 1
            u["revocations"] += row["state"] == "revoked"
            u["preempted"] += row["reason"] == preemption.REASON
        return sorted(out.values(), key=lambda u: -u["gpu_hours_held"])

    def require_admin(self, who: Identity, what: str) -> None:
        if not who.admin:
            raise Forbidden(f"Only admins can {what}")


def reload_policy_file(m: LeaseManager, config_file: str, cli_config: Any) -> dict[str, Any]:
    """SIGHUP: re-read the config file (command-line options still win) and apply its LeasePolicy, audited."""
    from traitlets.config import Config
    from traitlets.config.loader import PyFileConfigLoader

    cfg = Config()
    try:
        if config_file and os.path.exists(config_file):
            path = os.path.abspath(config_file)
            cfg.merge(PyFileConfigLoader(os.path.basename(path), path=os.path.dirname(path)).load_config())
        cfg.merge(cli_config)
        fresh = type(m.policy)(config=cfg)
    except Exception as e:  # a broken file must not take the broker down: keep the running policy
        log.error("Policy reload from %s refused, keeping the current policy: %s", config_file, e)
        return {}
    new, old = policy_values(fresh), policy_values(m.policy)
    changes = {k: v for k, v in new.items() if v != old[k]}
    try:
        diff = m.update_policy("sighup", changes, source="sighup:" + config_file)
    except LeaseError as e:
        log.error("Policy reload from %s refused: %s", config_file, e.message)
        return {}
    log.info("Policy reloaded from %s: %d field(s) changed", config_file, len(diff))
    return diff
