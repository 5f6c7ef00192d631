"""The broker's own sentences: why a lease ended, in words (times, durations and GPU counts are
``gpulease_protocol.words``, shared with every client).

The broker's views carry these strings so that every client (the cell, the CLI, the sidebar, notifications) shows
the same words and none re-derives them; the slugs stay beside them for scripts.
"""

from __future__ import annotations

from gpulease_protocol.words import clock_text, duration_text, gpus_text

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
    "suspended_too_long": "revoked: it stayed suspended longer than the broker keeps a suspended lease ({suspended})",
}

#: Why a lease was asked to suspend, or is suspended (``Suspension.why``), as the words after its time.
SUSPEND_WHY = {
    "idle": "idle",
    "pressure": "idle while others waited",
    "expired": "its time limit ran out",
    "user": "by its holder",
    "admin": "by an admin",
}


def _why_text(why: str, by_user: str) -> str:
    if why == "preempted":
        return f"for a request of {by_user}" if by_user else "for a waiting request"
    return f"({SUSPEND_WHY.get(why, why)})"


def suspend_asked_text(why: str, by_user: str, deadline: float, now: float) -> str:
    """A pending ask: 'asked to suspend by 14:06 (idle)', 'asked to suspend by 14:06 for a request of bob'."""
    return f"asked to suspend by {clock_text(deadline, now)} {_why_text(why, by_user)}"


def suspended_text(why: str, by_user: str, since: float, resume: bool, gpus: int, model: str, now: float) -> str:
    """A suspended lease: 'suspended since 14:05 (idle); resumes with its next cell', 'suspended since 14:05 for a
    request of bob; resumes when 4 GPUs of its model are free'."""
    if resume:
        then = f"resumes when {gpus_text(gpus)} of its model{f' ({model})' if model else ''} are free"
    else:
        then = "resumes with its next cell"
    return f"suspended since {clock_text(since, now)} {_why_text(why, by_user)}; {then}"



def ended_text(state: str, reason: str, *, idle_seconds: float = 0.0, held_seconds: float = 0.0,
               silent_seconds: float = 0.0, suspended_seconds: float = 0.0) -> str:
    """Why a lease ended, as a sentence ('revoked: idle for 10 min while others waited'), from its state and reason
    slug; an admin's revocation and a caller's own reason are quoted. A reason with a note after ';' (the words of
    a holder that could not suspend: ``SUSPEND_FAILED``) ends with it."""
    reason, _, note = reason.partition(";")
    text = _ended_text(state, reason, idle_seconds, held_seconds, silent_seconds, suspended_seconds)
    return f"{text} ({note.strip()})" if note.strip() else text


#: The note a lease revoked after its holder could not suspend carries in its reason ('idle;...').
SUSPEND_FAILED = "it could not be suspended: "


def _ended_text(state: str, reason: str, idle_seconds: float, held_seconds: float, silent_seconds: float,
                suspended_seconds: float) -> str:
    known = ENDED.get(reason)
    if known is not None:
        return known.format(idle=duration_text(idle_seconds), held=duration_text(held_seconds),
                            silent=duration_text(silent_seconds), suspended=duration_text(suspended_seconds))
    if reason.startswith("admin:"):
        why = reason[len("admin:"):]
        return "revoked by an admin" + (f": {why}" if why and why not in ("revoked", "admin") else "")
    if reason.startswith(state):  # a caller's own words that say it ("released with gpulease release")
        return reason
    if state == "failed":
        return f"failed: {reason}" if reason else "failed"
    return f"{state}: {reason}" if reason and reason != state else state
