"""The start estimator (core/estimate.py), table by table: holders' likely ends, the walk, the range."""

from __future__ import annotations

import math

import pytest

from lease_broker.core.estimate import (
    WIDEN,
    History,
    Need,
    Span,
    calibrated,
    holder_end,
    likely_wait,
    remaining,
    start_text,
    starts,
    wait_words,
)

NOW = 1000.0
INF = math.inf


# ---------------------------------------------------------------- a holder's likely end
@pytest.mark.parametrize("case, kwargs, expected", [
    ("idle: its idle deadline, whatever history says",
     {"granted_at": 0.0, "expires_at": 5000.0, "idle_deadline": 1300.0, "remaining_time": (10.0, 20.0)}, (1300.0,)),
    ("active: now plus the history's remaining times",
     {"granted_at": 400.0, "expires_at": 5000.0, "idle_deadline": None, "remaining_time": (60.0, 120.0, 600.0)},
     (1060.0, 1120.0, 1600.0)),
    ("the time limit caps every end",
     {"granted_at": 400.0, "expires_at": 1100.0, "idle_deadline": None, "remaining_time": (60.0, 120.0, 600.0)},
     (1060.0, 1100.0, 1100.0)),
    ("an idle deadline past the time limit: the limit",
     {"granted_at": 0.0, "expires_at": 1200.0, "idle_deadline": 1500.0, "remaining_time": None}, (1200.0,)),
    ("no history: Lindy, as long again as it ran (half to twice)",
     {"granted_at": 400.0, "expires_at": None, "idle_deadline": None, "remaining_time": None},
     (1300.0, 1600.0, 2200.0)),
    ("no history, just granted: at least a minute",
     {"granted_at": NOW, "expires_at": None, "idle_deadline": None, "remaining_time": None},
     (1030.0, 1060.0, 1120.0)),
    ("an expired limit (not yet enforced): now, never before",
     {"granted_at": 0.0, "expires_at": 900.0, "idle_deadline": None, "remaining_time": (50.0,)}, (NOW,)),
])
def test_holder_end(case, kwargs, expected):
    assert holder_end(NOW, **kwargs) == expected, case


@pytest.mark.parametrize("durations, elapsed, min_samples, expected", [
    ([100, 200, 300, 400], 0, 4, (100, 200, 300, 400)),
    ([100, 200, 300, 400, 900], 250, 3, (50, 150, 650)),  # only those that ran longer, less what has run
    ([100, 200, 300, 400, 900], 250, 4, None),  # too few ran that long
    ([], 0, 1, None),
])
def test_remaining_is_conditional_on_the_time_already_run(durations, elapsed, min_samples, expected):
    assert remaining(durations, elapsed, min_samples) == expected


def test_history_falls_back_from_the_specific_key_and_counts_running_leases():
    h = History()
    for d in (100, 110, 120, 130):
        h.add([("nb", "alice"), ("alice",), ("all",)], d)
    for d in (1000, 2000, 3000, 4000):
        h.add([("nb", "bob"), ("bob",), ("all",)], d)
    keys = [("nb", "alice"), ("alice",), ("all",)]
    assert h.remaining(keys, 0) == (100, 110, 120, 130)  # alice's own
    assert h.remaining(keys, 500) == (500, 1500, 2500, 3500)  # alice never ran this long: everyone's
    # four of alice's leases still run, for 200 s so far: they count as at least that long
    assert h.remaining(keys, 150, running={("nb", "alice"): [200, 200, 200, 200]}) == (50, 50, 50, 50)


def test_history_is_bounded():
    h = History(per_key=3, max_keys=2)
    for d in range(10):
        h.add([("a",)], d)
    assert list(h.get(("a",))) == [7, 8, 9]
    h.add([("b",)], 1)
    h.add([("c",)], 1)  # the least recently fed key goes
    assert len(h) == 2 and list(h.get(("a",))) == []


# ---------------------------------------------------------------- the walk
NODES = {"n0": ["g0", "g1"], "n1": ["g2", "g3"]}


def start_of(holders, ends, queue, nodes=NODES):
    return starts(NOW, nodes, holders, ends, queue)[-1]


def test_free_gpu_starts_now_without_reading_any_end():
    class Untouchable(dict):
        def __getitem__(self, key):
            raise AssertionError(f"read the end of {key}")

    assert start_of({"g0": ["a"]}, Untouchable(), [Need(1)]) == Span.exactly(NOW)


def test_one_gpu_waits_for_the_first_holder_to_end():
    holders = {g: [g] for g in ("g0", "g1", "g2", "g3")}
    ends = {"g0": (1500.0,), "g1": (1200.0,), "g2": (1900.0,), "g3": (1400.0,)}
    assert start_of(holders, ends, [Need(1)]) == Span.exactly(1200.0)


def test_a_gang_waits_for_enough_gpus_on_one_node():
    holders = {g: [g] for g in ("g0", "g1", "g2", "g3")}
    ends = {"g0": (1100.0,), "g1": (1900.0,), "g2": (1300.0,), "g3": (1400.0,)}
    assert start_of(holders, ends, [Need(2, "node")]) == Span.exactly(1400.0)  # n1: both free at 1400
    assert start_of(holders, ends, [Need(2, "any")]) == Span.exactly(1300.0)  # g0 and g2, across nodes
    assert start_of(holders, ends, [Need(3, "node")]) is None  # no node has 3 GPUs


def test_a_gang_waits_for_the_last_of_one_lease_ending_on_all_its_gpus():
    holders = {"g0": ["big"], "g1": ["big"], "g2": ["x"], "g3": ["y"]}
    ends = {"big": (1500.0,), "x": (1200.0,), "y": (2000.0,)}
    assert start_of(holders, ends, [Need(2)]) == Span.exactly(1500.0)


def test_requests_ahead_take_the_gpus_that_free_first_for_their_duration():
    nodes = {"n0": ["g0"]}
    holders = {"g0": ["a"]}
    ends = {"a": (1100.0,)}
    queue = [Need(1, durations=(300.0,), key="ahead"), Need(1, durations=(60.0,), key="me")]
    assert starts(NOW, nodes, holders, ends, queue) == [Span.exactly(1100.0), Span.exactly(1400.0)]


def test_a_short_request_goes_before_a_gang_that_waits_if_it_ends_first():
    holders = {"g1": ["a"], "g2": ["b"], "g3": ["b"]}
    ends = {"a": (1600.0,), "b": (3000.0,)}
    queue = [Need(2, durations=(600.0,), key="gang"), Need(1, durations=(300.0,), key="short"),
             Need(1, durations=(900.0,), key="long")]
    gang, short, long = starts(NOW, NODES, holders, ends, queue)
    assert gang == Span.exactly(1600.0)  # n0 once a ends
    assert short == Span.exactly(NOW)  # g0 is free until the gang starts: 300 s fit
    assert long == Span.exactly(2200.0)  # 900 s do not: after the gang (n1 frees at 3000)


def test_uncertain_holders_give_a_range_that_holds_the_likely_start():
    nodes = {"n0": ["g0"]}
    holders = {"g0": ["a"]}
    ends = {"a": tuple(NOW + s for s in (60.0, 120.0, 180.0, 240.0, 3000.0))}
    span = start_of(holders, ends, [Need(1)], nodes)
    assert span is not None
    assert NOW + 60 <= span.low <= span.likely <= span.high <= NOW + 3000
    assert span.high - span.low > 1000  # unsure: a wide range
    assert span.likely - NOW <= 480  # within 2x of most samples: minutes, not the long outlier


def test_a_gpu_that_never_frees_gives_no_estimate():
    assert start_of({g: ["down"] for g in ("g0", "g1", "g2", "g3")}, {"down": (INF,)}, [Need(1)]) is None


def test_the_same_inputs_give_the_same_estimate():
    holders = {g: [g] for g in ("g0", "g1", "g2", "g3")}
    ends = {g: tuple(NOW + 100.0 * i for i in range(1, 9)) for g in holders}
    queue = [Need(2, durations=(100.0, 500.0, 900.0), key=str(i)) for i in range(4)]
    first = starts(NOW, NODES, holders, ends, queue)
    assert len(first) == 4 and all(span is not None for span in first)
    # the samples are stratified from the ids, not drawn: the same inputs in another dict order, as fresh objects,
    # give the same spans
    again = starts(NOW, NODES, dict(reversed(list(holders.items()))), dict(reversed(list(ends.items()))),
                   [Need(2, durations=(100.0, 500.0, 900.0), key=str(i)) for i in range(4)])
    assert again == first


@pytest.mark.parametrize("waits, expected", [
    ([0.0, 5.0, 10.0, 20.0], 0.0),  # all under the tiny wait: now
    ([100.0, 110.0, 120.0, 5000.0], 120.0),  # the cluster (its latest sample), not the outlier
    ([100.0] * 3 + [1000.0, 1100.0, 1200.0, 1300.0], 1300.0),  # the bigger cluster
    ([100.0, 150.0, 390.0], 200.0),  # a spread window: the latest wait within 2x of all of it
    ([500.0] * 5, 500.0),  # known: exactly
])
def test_likely_wait_is_within_2x_of_most_samples(waits, expected):
    assert likely_wait(waits) == expected


def test_a_request_for_some_gpus_only_waits_for_those():
    holders = {g: [g] for g in ("g0", "g1", "g2", "g3")}
    ends = {"g0": (1100.0,), "g1": (1200.0,), "g2": (1300.0,), "g3": (1400.0,)}
    assert start_of(holders, ends, [Need(1, only=frozenset({"g2", "g3"}))]) == Span.exactly(1300.0)
    assert start_of({}, {}, [Need(1, only=frozenset())]) is None  # no GPU of its kind


# ---------------------------------------------------------------- the range shown, in words
@pytest.mark.parametrize("low, high, text, said", [
    (70.0, 170.0, "in 1–3 min", (60.0, 180.0)),  # rounded outward: the words hold the whole range
    (0.0, 250.0, "within 5 min", (0.0, 300.0)),  # from now
    (10.0, 50.0, "in under a minute", (0.0, 60.0)),
    (2400.0, 9000.0, "in 30 min–3 h", (1800.0, 10800.0)),
    (4000.0, 7000.0, "in 1–2 h", (3600.0, 7200.0)),
    (3 * 86400.0, 5 * 86400.0, "in 3–5 days", (3 * 86400.0, 5 * 86400.0)),
    (1200.0, 1200.0, "in about 20 min", (1200.0, 1200.0)),  # a point: a known time (the scheduler's plan)
    (1210.0, 1220.0, "in 20–30 min", (1200.0, 1800.0)),  # a narrow range still spans its rungs
    (0.0, 0.0, "now", (0.0, 0.0)),
    (5000.0, 90 * 86400.0, "in over 1 h", (3600.0, math.inf)),  # beyond the last rung: open-ended
    (0.0, 90 * 86400.0, "unknown", (0.0, math.inf)),  # "any time" is no estimate
])
def test_a_wait_in_words_holds_its_range(low, high, text, said):
    words = wait_words(low, high)
    assert words.text == text
    assert (words.low, words.high) == said
    if low < high:
        assert words.low <= low and high <= words.high


def test_the_shown_range_widens_the_walk_and_says_it_in_words():
    walk = Span(NOW + 60.0, NOW + 120.0, NOW + 300.0)
    shown = calibrated(walk, NOW)
    assert shown == Span(NOW + 60.0 / WIDEN[0], NOW + 120.0, NOW + 300.0 * WIDEN[1])
    assert shown.low <= walk.low and walk.high <= shown.high and shown.likely == walk.likely
    assert calibrated(Span.exactly(NOW - 5.0), NOW) == Span(NOW, NOW - 5.0, NOW)  # past ends: now
    assert start_text(shown, None, NOW) == wait_words(shown.low - NOW, shown.high - NOW).text
    assert start_text(None, NOW + 1200.0, NOW) == "in about 20 min"  # deep in the queue: the plan, a point
    assert start_text(None, None, NOW) == "unknown"
