"""Local clock times in what the CLI and the ``%gpu`` magic print: the one rule of ``gpulease_protocol.words``
(today the time alone, then "tomorrow" or "yesterday", the date beyond), in the machine's own time zone."""

from __future__ import annotations

import time

import pytest

from gpulease_protocol.words import clock_text
from jupyter_gpulease.tables import gpus_table


def local(*fields: int) -> float:
    """The epoch seconds of a local wall-clock time (year, month, day, hour, minute)."""
    return time.mktime((*fields, 0, 0, 0, -1))


@pytest.fixture
def berlin(monkeypatch):
    monkeypatch.setenv("TZ", "Europe/Berlin")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


NOW = (2026, 11, 25, 23, 57)  # a Wednesday


@pytest.mark.parametrize("at, text", [
    ((2026, 11, 25, 23, 59), "23:59"),
    ((2026, 11, 26, 0, 7), "tomorrow 00:07"),
    ((2026, 11, 28, 9, 15), "28 Nov 09:15"),
    ((2026, 12, 2, 9, 15), "2 Dec 09:15"),
    ((2026, 11, 24, 9, 15), "yesterday 09:15"),
    ((2026, 11, 23, 9, 15), "23 Nov 09:15"),
])
def test_a_clock_time_names_its_day_when_it_is_not_today(berlin, at, text):
    assert clock_text(local(*at), local(*NOW)) == text


def test_days_are_calendar_days_across_a_daylight_saving_change(berlin):
    # Berlin enters summer time on Sunday 29 March 2026: Saturday 23:30 to Monday 00:15 is 23.75 hours, two days
    assert clock_text(local(2026, 3, 30, 0, 15), local(2026, 3, 28, 23, 30)) == "30 Mar 00:15"
    assert clock_text(local(2026, 3, 29, 23, 45), local(2026, 3, 28, 23, 30)) == "tomorrow 23:45"


def test_a_reserved_gpu_says_until_when_with_its_day(berlin):
    gpu = {"node": "n1", "index": 0, "name": "A100", "simulated": False, "memory_used": 0, "memory_total": 2**30,
           "utilization": 0, "holders": [], "state": "reserved",
           "reservation": {"user": "alice", "group": None, "end": local(2026, 11, 27, 17, 0)}}
    assert "reserved (alice until 27 Nov 17:00)" in gpus_table([gpu], now=local(*NOW))


# One unit style for the same data: sizes in binary units from one function (the CLI's tables, the kernel's notes
# and the worker's), GPU counts with their noun in the singular for one GPU or a share of one.

def test_sizes_are_binary_units_from_one_function():
    from gpulease_protocol.requests import format_size, parse_size
    from jupyter_gpulease.tables import fmt_bytes

    assert fmt_bytes is format_size
    assert [format_size(n) for n in (0, 512, 1536, 300 << 20, 40 << 30, 3 << 40)] == [
        "0 B", "512 B", "1.5 KiB", "300.0 MiB", "40.0 GiB", "3.0 TiB"]
    assert parse_size(format_size(40 << 30).replace(" ", "")) == 40 << 30


def test_an_auto_input_too_large_is_named_in_the_same_units():
    from jupyter_gpulease.kernel.cellcode import select_inputs

    sel = select_inputs("y = x + 1", {"x": b"\0" * (3 << 20)}, None, 1 << 20)
    assert "x" in sel.skipped and "3.0 MiB" in sel.skipped["x"], sel.skipped


def test_gpu_counts_say_gpu_for_one_and_gpus_for_more():
    from gpulease_protocol.words import gpus_text
    from jupyter_gpulease.tables import quota_table

    assert [gpus_text(n) for n in (0, 0.5, 1, 2)] == ["0 GPUs", "0.5 GPU", "1 GPU", "2 GPUs"]
    text = quota_table({"user": "ann", "limits": [
        {"text": "at once", "unit": "gpus", "used": 1, "limit": 2},
        {"text": "daily", "unit": "gpu_hours", "used": 1.0, "limit": 8.0},
        {"text": "daily", "unit": "gpu_hours", "used": 0.5, "limit": None}]})
    assert "1 GPU " in text and "1 GPU-hour " in text and "7 GPU-hours" in text and "0.5 GPU-hours" in text, text
    assert "1.00" not in text and "1 GPUs" not in text, text
