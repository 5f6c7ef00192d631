"""Every case of ``gpulease_protocol/text_cases.json``, the one text contract that the sidebar's ``format.ts`` is
tested against too: durations read and written, wall-clock times (in UTC, as the cases are written)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpulease_protocol.requests import RequestSyntaxError, parse_duration
from gpulease_protocol.words import clock_text, duration_text

CASES: dict[str, Any] = json.loads((Path(__file__).resolve().parents[2] / "gpulease_protocol" /
                                    "text_cases.json").read_text())


@pytest.fixture
def utc() -> Iterator[None]:
    before = os.environ.get("TZ")
    os.environ["TZ"] = "UTC"
    time.tzset()
    yield
    if before is None:
        del os.environ["TZ"]
    else:
        os.environ["TZ"] = before
    time.tzset()


@pytest.mark.parametrize(("text", "seconds"), CASES["parse_duration"])
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", CASES["parse_duration_invalid"])
def test_parse_duration_refuses(text: str) -> None:
    with pytest.raises(RequestSyntaxError):
        parse_duration(text)


@pytest.mark.parametrize(("seconds", "text"), CASES["duration_text"])
def test_duration_text(seconds: float, text: str) -> None:
    assert duration_text(seconds) == text


@pytest.mark.parametrize(("t", "text"), CASES["clock_text"])
def test_clock_text(utc: None, t: float, text: str) -> None:
    assert clock_text(t, CASES["clock_text_now"]) == text


def test_every_kind_of_case_is_run() -> None:
    assert set(CASES) == {"_about", "parse_duration", "parse_duration_invalid", "duration_text", "clock_text_now",
                          "clock_text"}
