"""The words every client shows for durations, wall-clock times, GPU counts and GPU-hours: one definition each.

The broker's views, the CLI, the kernel's messages and notifications use these; the sidebar's ``format.ts``
writes the same (both are tested against ``text_cases.json``). Pure: the time is passed in; month names are
English, never the locale's.
"""

from __future__ import annotations

import datetime
import math
import time

DAY = 86400.0
MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")


def duration_text(seconds: float) -> str:
    """'0.3 s', '45 s', '12 min', '2 h', '1 h 30 min', '3 days': rounded (half up) to what a person reads; tenths
    of a second under 10 s, so that a quick cell does not read '0 s'."""
    s = max(0.0, float(seconds))
    tenths = _half_up(s * 10)
    if tenths < 100:
        return f"{tenths // 10}.{tenths % 10} s" if tenths % 10 else f"{tenths // 10} s"
    n = _half_up(s)
    if n < 90:
        return f"{n} s"
    minutes = _half_up(n / 60)
    if minutes < 60:
        return f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours} h" + (f" {minutes} min" if minutes else "")
    return f"{_half_up(n / DAY)} days"


def _half_up(x: float) -> int:
    """Rounding as the sidebar's ``Math.round`` does (Python's ``round`` rounds halves to even)."""
    return math.floor(x + 0.5)


def clock_text(t: float, now: float) -> str:
    """A local wall-clock time: '12:00' on the same calendar day, 'tomorrow 00:30', 'yesterday 23:00',
    '29 Nov 12:00' otherwise in the same year, '2 Jan 2027 09:05' in another year."""
    at, today = time.localtime(t), time.localtime(now)
    hm = f"{at.tm_hour:02d}:{at.tm_min:02d}"
    days = _day(at) - _day(today)
    if days == 0:
        return hm
    if days in (1, -1):
        return f"{'tomorrow' if days == 1 else 'yesterday'} {hm}"
    year = "" if at.tm_year == today.tm_year else f" {at.tm_year}"
    return f"{at.tm_mday} {MONTHS[at.tm_mon - 1]}{year} {hm}"


def _day(t: time.struct_time) -> int:
    """The calendar day's number, so that days are counted across daylight-saving changes too."""
    return datetime.date(t.tm_year, t.tm_mon, t.tm_mday).toordinal()


def gpus_text(n: float) -> str:
    """A number of GPUs with its noun: '1 GPU', '2 GPUs', '0.5 GPU' (a share of one), '0 GPUs'."""
    return f"{n:g} GPU" + ("" if 0 < n <= 1 else "s")


def hours_text(gpu_seconds: float) -> str:
    """GPU-seconds as GPU-hours: '7.5 GPU-hours', '1 GPU-hour'."""
    h = round(max(0.0, gpu_seconds) / 3600.0, 2)
    return f"{h:g} GPU-hour" + ("" if h == 1 else "s")
