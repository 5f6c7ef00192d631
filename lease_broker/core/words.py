"""The broker's own sentences: why a lease ended, in words (times, durations and GPU counts are
``gpulease_protocol.words``, shared with every client).

The broker's views carry these strings so that every client (the cell, the CLI, the sidebar, notifications) shows
the same words and none re-derives them; the slugs stay beside them for scripts.
"""

from __future__ import annotations

from gpulease_protocol.words import duration_text

#: Why a lease ended, by its reason slug: the sentence its view carries as ``reason_text`` (``ended_text``).
#: ``{idle}``: how long it was idle before it ended; ``{held}``: how long it held its GPUs.
ENDED = {
    "released": "released",
    "cancelled": "cancelled while it waited",
    "expired": "expired: its time limit ran out after {held}",
    "idle": "revoked: idle for {idle}",
    "idle_pressure": "revoked: idle for {idle} while others waited",
    "holder_gone": "revoked: no heartbeat came from its kernel for {silent}",
    "holder_exited": "ended: the process that held it exited",
    "preempted": "revoked: preempted for a request of a higher priority class",
    "over_memory_cap": "revoked: it used more GPU memory than its share of the GPU",
    "device_gone": "failed: its GPU is no longer there",
    "double_grant": "failed: its GPU was held by another lease too (found when the broker restarted)",
}


def ended_text(state: str, reason: str, *, idle_seconds: float = 0.0, held_seconds: float = 0.0,
               silent_seconds: float = 0.0) -> str:
    """Why a lease ended, as a sentence ('revoked: idle for 10 min while others waited'), from its state and reason
    slug; an admin's revocation and a caller's own reason are quoted."""
    known = ENDED.get(reason)
    if known is not None:
        return known.format(idle=duration_text(idle_seconds), held=duration_text(held_seconds),
                            silent=duration_text(silent_seconds))
    if reason.startswith("admin:"):
        why = reason[len("admin:"):]
        return "revoked by an admin" + (f": {why}" if why and why not in ("revoked", "admin") else "")
    if reason.startswith(state):  # a caller's own words that say it ("released with gpulease release")
        return reason
    if state == "failed":
        return f"failed: {reason}" if reason else "failed"
    return f"{state}: {reason}" if reason and reason != state else state
