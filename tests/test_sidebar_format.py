"""The sidebar's wall-clock format (labextension/src/format.ts), run by Node on the built sidebar (``make test``
builds it) with a fixed "now", a time zone and a locale: the browser tests cannot choose the hour they run at, and a
lease that ends after midnight once read "until 11/26/2026 12:01 AM" for a 10-minute lease."""

from __future__ import annotations

import json
import os
import re
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


# ---------------------------------------------------------------- the sidebar's words, from the broker's (issue 35)

def run_sidebar(tmp_path: Path, script: str) -> object:
    """Run ``script`` (an ES module that prints JSON) by Node against a copy of the built sidebar's pure modules:
    the build writes imports without the ".js" Node wants, the copy adds it."""
    if shutil.which("node") is None:
        pytest.fail("these checks run the built sidebar with Node.js (binder/environment.yml); this machine has none")
    if not FORMAT_JS.exists():
        pytest.fail(f"{FORMAT_JS} is not built: run `make test` (or `cd labextension && jlpm build`)")
    lib = tmp_path / "lib"
    lib.mkdir()
    for name in ("format.js", "messages.js"):
        text = (FORMAT_JS.parent / name).read_text()
        (lib / name).write_text(re.sub(r"""(from\s+['"]\./[\w-]+)(['"])""", r"\1.js\2", text))
    out = subprocess.run(["node", "--input-type=module", "-e", script.replace("LIB", lib.as_uri())],
                         env={**os.environ, "TZ": "Europe/Berlin", "LC_ALL": "en-GB", "NODE_NO_WARNINGS": "1"},
                         capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)


def test_gpu_counts_say_gpu_or_gpus(tmp_path: Path) -> None:
    sizes = [(1, 1, 1), (1, 2, 2), (1, 1, 4), (0.25, 1, 1)]
    said = run_sidebar(tmp_path, f"""
import {{ gpusWanted, plural }} from 'LIB/format.js';
const sizes = {json.dumps(sizes)};
console.log(JSON.stringify([...sizes.map(([f, lo, hi]) => gpusWanted({{ fraction: f, min_gpus: lo, max_gpus: hi }})),
                            plural(1, 'share'), plural(3, 'share')]));
""")
    assert said == ["1 GPU", "2 GPUs", "1–4 GPUs", "0.25 GPU", "1 share", "3 shares"]


def test_a_queued_request_shows_the_brokers_estimate_and_reason_as_they_come(tmp_path: Path) -> None:
    entries = [
        {"estimate_text": "in 1–3 min", "wait": {"reason": "gpus_busy", "text": "GPUs busy: bob's lease ends in 2 min"}},
        {"estimate_text": "unknown", "wait": {"reason": "quota", "text": "your limit of 2 GPUs at once is used"}},
        {"estimated_start": 1e10, "estimated_start_range": [1e10, 2e10]},  # a broker without the words: nothing made up
    ]
    said = run_sidebar(tmp_path, f"""
import * as format from 'LIB/format.js';
console.log(JSON.stringify({{ words: {json.dumps(entries)}.map(format.waitWords),
                             ownEstimate: 'formatEta' in format || 'etaCounter' in format }}));
""")
    assert said["words"] == [["start: in 1–3 min", "GPUs busy: bob's lease ends in 2 min"],
                             ["start: unknown", "your limit of 2 GPUs at once is used"], []]
    assert said["ownEstimate"] is False  # one estimate: the sidebar no longer formats its own


def test_an_ended_lease_is_told_in_the_brokers_sentence_not_its_code(tmp_path: Path) -> None:
    def event(change: str, reason: str, reason_text: str | None, bg: str = "") -> dict:
        labels = {"cell": "gpu In[3]", "notebook": "/home/u/second.ipynb", **({"bg": bg} if bg else {})}
        return {"type": "lease", "change": change, "previous": "active",
                "lease": {"id": "L1", "state": change, "reason": reason, "reason_text": reason_text,
                          "labels": labels, "devices": []}}

    events = [
        event("revoked", "idle_pressure", "revoked: idle for 10 min while others waited"),
        event("expired", "expired", "expired: its time limit ran out after 30 min"),
        event("revoked", "holder_gone", None),  # an older broker: the code is not shown
        event("released", "cell finished", "released: cell finished", bg="train"),
        event("revoked", "holder_exited", "ended: the process that held it exited"),
    ]
    said = run_sidebar(tmp_path, f"""
import {{ noticeFor }} from 'LIB/messages.js';
console.log(JSON.stringify({json.dumps(events)}.map(e => noticeFor(e).text)))
""")
    assert said[0] == "Your GPU lease L1 (second.ipynb, cell In[3]) was revoked: idle for 10 min while others waited."
    assert said[1].endswith("was expired: its time limit ran out after 30 min.")
    assert said[2] == "Your GPU lease L1 (second.ipynb, cell In[3]) was revoked."
    assert said[3] == "Background cell train in second.ipynb finished: lease L1 was released: cell finished."
    assert said[4].endswith("(second.ipynb, cell In[3]) ended: the process that held it exited.")
    for text in said:
        assert not re.search(r"idle_pressure|holder_gone|holder_exited|\((expired|released)\)", text)
