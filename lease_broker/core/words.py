"""What the broker says to people: times, durations, GPU counts, and why a lease ended, in words.

The broker's views carry these strings so that every client (the cell, the CLI, the sidebar, notifications) shows
the same words and none re-derives them; the slugs stay beside them for scripts. Pure: the time is passed in.
"""

from __future__ import annotations

import time

DAY = 86400.0


def gpus_text(n: float) -> str:
    """'1 GPU', '2 GPUs', '0.5 GPU'."""
    return f"{n:g} GPU" + ("s" if n > 1 else "")


def duration_text(seconds: float) -> str:
    """'45 s', '12 min', '2 h', '1 h 30 min', '3 days': rounded to what a person reads."""
    s = max(0.0, float(seconds))
    if s < 90:
        return f"{s:.0f} s"
    minutes = round(s / 60)
    if minutes < 60:
        return f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours} h" + (f" {minutes} min" if minutes else "")
    return f"{round(s / DAY)} days"


def clock_text(t: float, now: float) -> str:
    """A wall-clock time as people read it: '14:05' within the next or last 12 hours, else '27 Nov 14:05'."""
    local = time.localtime(t)
    if abs(t - now) < DAY / 2:
        return time.strftime("%H:%M", local)
    return f"{local.tm_mday} {time.strftime('%b %H:%M', local)}"


def hours_text(gpu_seconds: float) -> str:
    """GPU-seconds as GPU-hours: '7.5 GPU-hours', '1 GPU-hour'."""
    h = round(max(0.0, gpu_seconds) / 3600.0, 2)
    return f"{h:g} GPU-hour" + ("" if h == 1 else "s")


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
