"""Why a queued request waits, in words: the ``wait`` of its view and of its queue entry.

The scheduling pass says why it left each request it looked at waiting (a slug of ``core.pass_types.WAIT_REASONS``,
kept in ``LiveState.waiting``); this part adds what a person needs to act on it: who holds the GPUs and when they
are expected to end, what is left of the limit that binds, the reservation that holds the free GPUs.
"""

from __future__ import annotations

from typing import Any

from ..core.lease import Lease
from ..core.words import clock_text, gpus_text, hours_text
from ..policy.lease_policy import LeasePolicy
from .estimates import Estimates
from .quotas import Quotas
from .reservations import Reservations
from .state import LiveState

#: Holders named in the words of ``gpus_busy`` (the rest are counted).
NAMED_HOLDERS = 3


class Waits:
    def __init__(self, state: LiveState, policy: LeasePolicy, quotas: Quotas, reservations: Reservations,
                 estimates: Estimates) -> None:
        self.state, self.policy, self.quotas = state, policy, quotas
        self.reservations, self.estimates = reservations, estimates

    def reason(self, lease: Lease, position: int | None) -> str:
        """The latest pass's reason; a request no pass has looked at yet waits behind the ones ahead of it (or,
        first in line, for the GPUs to free up)."""
        found = self.state.waiting.get(lease.id)
        if found is not None:
            return found
        return "queue" if position is not None and position > 1 else "gpus_busy"

    def view(self, lease: Lease, position: int | None, now: float, memo: dict[str, str] | None = None
             ) -> dict[str, str]:
        """``{"reason": slug, "text": words}``; ``memo``: words shared by the requests of one queue view."""
        slug = self.reason(lease, position)
        memo = {} if memo is None else memo
        if slug == "gpus_busy":
            if "busy" not in memo:
                memo["busy"] = self.busy_text(lease.user, now)
            text = memo["busy"]
        elif slug == "quota":
            text = self.quota_text(lease)
        elif slug == "budget":
            text = self.budget_text(lease, now)
        elif slug == "reservation":
            text = self.reservation_text(lease, now)
        elif slug == "whole_node":
            text = f"it needs {gpus_text(lease.request.min_gpus)} on one node, and no node has that many free now"
        elif slug == "no_gpu_type":
            req = lease.request
            what = " ".join(x for x in (req.gpu_type, f"with at least {req.gpu_mem / 2**30:g}G of memory"
                                        if req.gpu_mem else "") if x)
            text = f"no GPU {what} is free now"
        elif slug == "priority":
            text = "requests of a higher priority class wait ahead of it"
        elif slug == "fair_share":
            text = "requests of users who used fewer GPU-hours lately wait ahead of it (fair share)"
        else:
            ahead = (position or 1) - 1
            text = (f"{ahead} earlier request{'s' if ahead != 1 else ''} wait{'' if ahead != 1 else 's'} ahead of it"
                    if ahead else "earlier requests wait ahead of it")
        return {"reason": slug, "text": text}

    def busy_text(self, user: str, now: float) -> str:
        """Who holds the GPUs and when each is expected to end, soonest first: 'every GPU it could use is held:
        your 1 GPU expected to end around 14:05, bob's 2 GPUs around 14:20, and 3 more leases'."""
        ends = []
        for lease in self.state.holding():
            likely = self.estimates.lease_end(lease, now)
            end = likely[len(likely) // 2] if likely else (lease.expires_at or now)
            ends.append((end, lease))
        if not ends:
            return "every GPU it could use is held"
        ends.sort(key=lambda e: e[0])
        parts = []
        for i, (end, lease) in enumerate(ends[:NAMED_HOLDERS]):
            whose = "your" if lease.user == user else f"{lease.user}'s"
            parts.append(f"{whose} {gpus_text(lease.gpu_count)} " + ("expected to end around " if i == 0 else "around ")
                         + clock_text(max(end, now), now))
        more = len(ends) - NAMED_HOLDERS
        return "every GPU it could use is held: " + ", ".join(parts) + (
            f", and {more} more lease{'s' if more > 1 else ''}" if more > 0 else "")

    def quota_text(self, lease: Lease) -> str:
        """Which at-once limit binds: the user's own, else a group's."""
        pol, held = self.policy, self.state.table.held_by_user
        need = lease.request.fraction if lease.request.shared else lease.request.min_gpus
        cap = pol.user_cap(lease.user)
        mine = held.get(lease.user, 0.0)
        if cap > 0 and cap - mine + 1e-9 < need:
            return (f"you hold {mine:g} of your {gpus_text(cap)} at once; it starts when enough of your leases end "
                    f"to leave room for {gpus_text(need)}")
        for g in pol.groups_of(lease.user):
            gcap = pol.group_cap(g)
            theirs = sum(n for u, n in held.items() if g in pol.groups_of(u))
            if gcap > 0 and gcap - theirs + 1e-9 < need:
                return f"group {g} holds {theirs:g} of its {gpus_text(gcap)} at once"
        return "a limit of GPUs at once keeps it waiting"

    def budget_text(self, lease: Lease, now: float) -> str:
        """What the request needs of the daily GPU-hours, what is left, and when they start to refill."""
        charged, refills = self.quotas.charged(now)
        need = (lease.request.fraction if lease.request.shared else lease.request.min_gpus) * lease.duration_seconds
        for key, quota in self.policy.day_quotas(lease.user).items():
            left = quota - charged.get(key, 0.0)
            if left + 1e-6 < need:
                whose = f"group {key[1:]}'s" if key.startswith("@") else "your"
                text = (f"it needs {hours_text(need)} and {whose} daily {hours_text(quota)} have "
                        f"{hours_text(left)} left in the last 24 h")
                refill = refills.get(key)
                return text + (f"; they refill from {clock_text(refill, now)}" if refill is not None else "")
        return "the daily GPU-hours keep it waiting"

    def reservation_text(self, lease: Lease, now: float) -> str:
        """The reservation that holds the free GPUs over the request's time (the earliest one, if several)."""
        end = now + lease.duration_seconds
        rs = sorted((r for r in self.reservations.live if r.start < end and r.end > now), key=lambda r: r.start)
        if not rs:
            return "the free GPUs are held for a reservation"
        r = rs[0]
        who = r.user or f"group {r.group}"
        return (f"the free GPUs are reserved for {who} from {clock_text(r.start, now)} to {clock_text(r.end, now)} "
                f"({gpus_text(r.gpus)})")


def ended_facts(lease: Lease) -> dict[str, Any]:
    """What the sentence of an ended lease may say (``core.words.ended_text``'s keywords)."""
    end = lease.ended_at or lease.last_activity
    return {"idle_seconds": max(0.0, end - lease.last_activity),
            "held_seconds": max(0.0, end - lease.granted_at) if lease.granted_at is not None else 0.0,
            "silent_seconds": max(0.0, end - lease.last_heartbeat)}
