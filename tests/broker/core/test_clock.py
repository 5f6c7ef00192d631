"""The broker's clock: monotonic time anchored on the wall clock, re-anchored (and the step reported) at resync."""

from __future__ import annotations

import time

import pytest

from lease_broker.core.clock import STEP_TOLERANCE, TEST_CLOCK_FILE, Clock, VirtualClock


@pytest.mark.parametrize("step", [2000.0, -600.0])
def test_a_wall_clock_step_moves_the_brokers_time_only_at_resync_which_reports_it(step):
    clock = VirtualClock(start=1_000_000.0)
    clock.step_wall(step)
    assert clock.now() == 1_000_000.0  # deadlines compared with now() do not jump
    clock.advance(5)
    assert clock.now() == 1_000_005.0
    assert clock.resync() == step
    assert clock.now() == clock.wall() == 1_000_005.0 + step  # what people read is the wall clock again
    clock.advance(1)
    assert clock.now() == 1_000_006.0 + step
    assert clock.resync() == 0.0  # reported once


def test_a_difference_within_the_tolerance_is_followed_quietly():
    clock = VirtualClock(start=500.0)
    clock.step_wall(STEP_TOLERANCE / 2)
    assert clock.resync() == 0.0
    assert clock.now() == clock.wall() == 500.0 + STEP_TOLERANCE / 2


def test_without_a_step_the_virtual_clock_is_exact_and_set_never_goes_back():
    clock = VirtualClock(start=1_700_000_000.0)
    for _ in range(1000):
        clock.advance(0.1)
        assert clock.resync() == 0.0
    want = 1_700_000_000.0
    for _ in range(1000):
        want += 0.1
    assert clock.now() == want  # the same sums as before the clock had an anchor: replays stay deterministic
    clock.set(1_700_000_500.25)
    assert clock.now() == 1_700_000_500.25
    clock.set(1_700_000_000.0)
    assert clock.now() == 1_700_000_500.25
    with pytest.raises(ValueError, match="-1"):
        clock.advance(-1)


def test_set_after_a_step_lands_on_the_time_asked_for():
    clock = VirtualClock(start=1000.0)
    clock.step_wall(-600)
    clock.resync()
    clock.set(900.0)
    assert clock.now() == pytest.approx(900.0)


def test_the_real_clock_starts_on_the_wall_clock_and_runs_on_the_monotonic_one():
    clock = Clock()
    assert abs(clock.now() - time.time()) < 0.5
    a, b = clock.now(), clock.monotonic()
    assert clock.now() - a == pytest.approx(clock.monotonic() - b, abs=1e-3)
    assert clock.resync() == 0.0


def test_the_test_hook_steps_one_clocks_wall_reading(tmp_path, monkeypatch):
    offset = tmp_path / "offset"
    offset.write_text("0")
    monkeypatch.setenv(TEST_CLOCK_FILE, str(offset))
    clock = Clock()
    offset.write_text("2000")
    assert abs(clock.now() - time.time()) < 0.5  # not until resync
    assert clock.wall() == pytest.approx(time.time() + 2000, abs=0.5)
    assert clock.resync() == pytest.approx(2000, abs=0.5)
    assert clock.now() == pytest.approx(time.time() + 2000, abs=0.5)
    offset.write_text("not a number")  # (being written): the last value holds
    assert clock.resync() == 0.0
    offset.write_text("-600")
    assert clock.resync() == pytest.approx(-2600, abs=0.5)
    assert clock.now() == pytest.approx(time.time() - 600, abs=0.5)
