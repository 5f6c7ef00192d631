"""Which broker events a person is told about, and what the message says (pure: an event in, messages out).

Kinds a user can choose (``gpulease notify``):

- ``granted``: a request that waited in the queue got its GPUs, or a suspended lease got GPUs again (resumed);
- ``warning``: a lease will be revoked for idleness, will expire, or is about to be preempted;
- ``ended``: a lease was revoked, expired, preempted or failed (not released by its holder), or suspended (its GPUs
  went to others; its processes keep their state in host memory);
- ``bg``: a ``%%gpu --bg`` cell's lease ended (the background cell finished).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from gpulease_protocol.words import clock_text, duration_text, gpus_text

KINDS = ("granted", "warning", "ended", "bg")
#: Endings its holder chose: no news, but for a background cell that finished.
OWN_ENDINGS = ("released", "cancelled")


@dataclass(frozen=True)
class Message:
    key: str  # unique per event: the outbox never sends one twice
    kind: str
    user: str
    lease_id: str
    subject: str
    text: str

    def body(self) -> dict[str, Any]:
        """The webhook body: Slack's and Mattermost's incoming webhooks read ``text``; the rest is for others."""
        return {"text": self.text, "subject": self.subject, "kind": self.kind, "user": self.user,
                "lease_id": self.lease_id, "source": "gpulease"}


def _where(lease: dict[str, Any]) -> str:
    labels = lease.get("labels") or {}
    parts = [f"notebook {labels['notebook']}" if labels.get("notebook") else "",
             f"cell {labels['cell']}" if labels.get("cell") else ""]
    where = ", ".join(p for p in parts if p)
    return f" ({where})" if where else ""


def _gpus(lease: dict[str, Any]) -> str:
    devices = lease.get("devices") or []
    names = ", ".join(f"{d.get('node', '')}/{d.get('index', '')}".lstrip("/") for d in devices)
    return gpus_text(len(devices)) + (f": {names}" if names else "")


def message(event: dict[str, Any], now: float | None = None) -> Message | None:
    """The message an event gives its lease's owner, or None when it is nothing to tell."""
    now = time.time() if now is None else now

    def _clock(t: float | None) -> str:
        return clock_text(t, now) if t else "?"

    etype, user = event.get("type"), event.get("user")
    if not user:
        return None
    if etype == "lease":
        lease, change = event.get("lease") or {}, event.get("change")
        lid = lease.get("id", "")
        if change == "granted" and event.get("previous") == "queued" and lease.get("granted_at") and \
                lease["granted_at"] - lease.get("created_at", lease["granted_at"]) >= 1.0:
            waited = lease["granted_at"] - lease["created_at"]
            return Message(f"{lid}:granted", "granted", user, lid, f"GPU lease {lid} granted",
                           f"Your GPU request {lid}{_where(lease)} was granted after {duration_text(waited)} in the queue: "
                           f"{_gpus(lease)}, until {_clock(lease.get('expires_at'))}.")
        suspended = lease.get("suspended")
        if change == "suspended" and suspended:
            return Message(f"{lid}:suspended:{suspended.get('since')}", "ended", user, lid, f"GPU lease {lid} suspended",
                           f"Your GPU lease {lid}{_where(lease)} is {suspended.get('text') or 'suspended'}. Its GPUs "
                           "went to others; its processes keep their state in host memory.")
        if change == "granted" and event.get("previous") == "suspended":
            return Message(f"{lid}:resumed:{lease.get('granted_at')}", "granted", user, lid, f"GPU lease {lid} resumed",
                           f"Your GPU lease {lid}{_where(lease)} resumed on {_gpus(lease)} after "
                           f"{duration_text(lease.get('suspended_seconds') or 0.0)} suspended, until "
                           f"{_clock(lease.get('expires_at'))}.")
        if lease.get("phase") != "ended" or change != lease.get("state"):
            return None
        if change not in OWN_ENDINGS:
            return Message(f"{lid}:ended", "ended", user, lid, f"GPU lease {lid} {change}",
                           f"Your GPU lease {lid}{_where(lease)} ended: {lease.get('reason_text') or change}.")
        if (lease.get("labels") or {}).get("bg"):
            name = lease["labels"]["bg"]
            return Message(f"{lid}:bg", "bg", user, lid, f"Background cell {name} finished",
                           f"Your background cell {name}{_where(lease)} finished and ended lease {lid}: "
                           f"{lease.get('reason_text') or change}.")
        return None
    if etype == "warning":
        lid, deadline = event.get("lease_id", ""), event.get("deadline")
        return Message(f"{lid}:warning:{event.get('kind')}:{deadline}", "warning", user, lid,
                       f"GPU lease {lid}: {event.get('kind')} warning",
                       f"{event.get('message', '')} (at {_clock(deadline)}). Use the GPU, or renew the lease, "
                       "to keep it.")
    if etype == "lease.preempting":
        lid, deadline = event.get("lease_id", ""), event.get("deadline")
        return Message(f"{lid}:preempting:{deadline}", "warning", user, lid, f"GPU lease {lid} will be preempted",
                       f"Your GPU lease {lid} will be preempted for a {event.get('by_class', '')} request at "
                       f"{_clock(deadline)}: save your work.")
    return None
