"""The sidebar's wall-clock format (labextension/src/format.ts), run by Node on the built sidebar (``make test``
builds it) with a fixed "now", a time zone and a locale: the browser tests cannot choose the hour they run at, and a
lease that ends after midnight once read "until 11/26/2026 12:01 AM" for a 10-minute lease."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

FORMAT_JS = Path(__file__).resolve().parent.parent / "labextension" / "lib" / "format.js"

NOW = (2026, 11, 25, 23, 57)  # a Wednesday, local time

# each case: a local time and what the sidebar says of it at NOW
CASES = [
    ((2026, 11, 25, 23, 59), "23:59"),  # today: the time alone
    ((2026, 11, 26, 0, 7), "tomorrow 00:07"),  # ten minutes on, past midnight
    ((2026, 11, 28, 9, 15), "Sat 09:15"),  # within the week ahead: the weekday
    ((2026, 12, 5, 9, 15), "05/12/2026 09:15"),  # further on: the date
    ((2026, 11, 24, 9, 15), "24/11/2026 09:15"),  # in the past: the date
    ((2027, 3, 28, 12, 0), "28/03/2027 12:00"),
]


def format_clocks(times: list[tuple[int, ...]], tz: str, locale: str, now: tuple[int, ...] = NOW) -> list[str]:
    """What formatClock says of each local time when it is ``now``, in ``tz`` and ``locale``."""
    if shutil.which("node") is None:
        pytest.fail("these checks run the built sidebar with Node.js (binder/environment.yml); this machine has none")
    if not FORMAT_JS.exists():
        pytest.fail(f"{FORMAT_JS} is not built: run `make test` (or `cd labextension && jlpm build`)")
    script = f"""
import {{ formatClock }} from {json.dumps(FORMAT_JS.as_uri())};
const local = ([y, mo, d, h, mi]) => new Date(y, mo - 1, d, h, mi);
const now = local({json.dumps(now)});
console.log(JSON.stringify({json.dumps(times)}.map(t => formatClock(local(t).getTime() / 1000, now))));
"""
    env = {**os.environ, "TZ": tz, "LC_ALL": locale, "NODE_NO_WARNINGS": "1"}
    out = subprocess.run(["node", "--input-type=module", "-e", script], env=env, capture_output=True, text=True,
                         timeout=60, check=True)
    return json.loads(out.stdout)


def test_a_clock_time_says_tomorrow_or_the_weekday_before_it_needs_a_date() -> None:
    times = [t for t, _ in CASES]
    assert format_clocks(times, "Europe/Berlin", "en-GB") == [want for _, want in CASES]


def test_a_us_locale_writes_the_clock_its_own_way() -> None:
    assert format_clocks([(2026, 11, 26, 0, 7), (2026, 11, 25, 23, 59)], "America/New_York", "en-US") == \
        ["tomorrow 12:07 AM", "11:59 PM"]


def test_days_are_calendar_days_across_a_daylight_saving_change() -> None:
    # Berlin leaves summer time on Sunday 25 October 2026 (a 25-hour day) and enters it on Sunday 29 March (23 hours)
    autumn = (2026, 10, 24, 23, 30)
    times = [(2026, 10, 25, 23, 45), (2026, 10, 26, 0, 15), (2026, 10, 30, 23, 45), (2026, 10, 31, 0, 15)]
    assert format_clocks(times, "Europe/Berlin", "en-GB", autumn) == \
        ["tomorrow 23:45", "Mon 00:15", "Fri 23:45", "31/10/2026 00:15"]
    spring = (2026, 3, 28, 23, 30)
    assert format_clocks([(2026, 3, 29, 23, 45), (2026, 3, 30, 0, 15)], "Europe/Berlin", "en-GB", spring) == \
        ["tomorrow 23:45", "Mon 00:15"]
