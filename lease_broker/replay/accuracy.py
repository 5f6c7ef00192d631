"""How good the start estimates were: for every request that queued, the estimate it was told at once against
the wait it had.

Both are seconds from the request, each floored at ``FLOOR`` seconds (a 5 s estimate for a 20 s wait is as
good as exact to a user), so a ratio is always defined. An estimate is *within 2×* when
``max(est, real) / min(est, real) <= 2``; the *median ratio* is the median of ``est / real`` (below 1: too
optimistic). A request told no estimate counts as not within 2× and has no ratio.

The range is judged as users read it: the words the broker shows for it (``core.estimate.wait_words``, rounded
outward) hold the real wait (``in_words``), and its width is the ratio of the words' upper to lower end, each
floored like the waits (``words_width``: the median; a range that says "any time" is no estimate).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from ..core.estimate import wait_words
from .model import Told

FLOOR = 30.0  # seconds: estimates and waits shorter than this count as this long


def score(pairs: Iterable[tuple[float | None, float]]) -> dict[str, Any]:
    """``pairs``: (estimated wait or None, real wait) in seconds. Count, how many had an estimate, the share
    within 2× (of all), the median ratio est/real, and the share that was too optimistic by more than 2×."""
    pairs = list(pairs)
    ratios = [max(est, FLOOR) / max(real, FLOOR) for est, real in pairs if est is not None]
    n, nan = len(pairs), float("nan")
    within, early = sum(1 for r in ratios if 0.5 <= r <= 2.0), sum(1 for r in ratios if r < 0.5)
    return {"n": n, "with_estimate": len(ratios), "within_2x": within / n if n else nan,
            "median_ratio": statistics.median(ratios) if ratios else nan, "under_half": early / n if n else nan}


def _wait(t: Told) -> float | None:
    lease = t.lease
    return None if lease.granted_at is None else lease.granted_at - lease.created_at


def accuracy(told: Sequence[Told]) -> dict[str, Any]:
    """The figures for the estimate users see (``estimate``), the time-limit plan of the same run
    (``time_limit``), and how often the real start fell inside the range told (``in_range``: of those with one;
    the range's ends floored like the estimates)."""
    done = [(t, w) for t in told if (w := _wait(t)) is not None]

    def rel(at: float | None, t: Told) -> float | None:
        return None if at is None else max(0.0, at - t.lease.created_at)

    ranged = [(t, w) for t, w in done if t.low is not None and t.high is not None]
    inside = sum(1 for t, w in ranged
                 if max(rel(t.low, t) or 0.0, FLOOR) <= max(w, FLOOR) <= max(rel(t.high, t) or 0.0, FLOOR))
    words = [(wait_words(rel(t.low, t) or 0.0, rel(t.high, t) or 0.0), w) for t, w in ranged]
    in_words = sum(1 for said, w in words if max(said.low, FLOOR) <= max(w, FLOOR) <= max(said.high, FLOOR))
    widths = [max(said.high, FLOOR) / max(said.low, FLOOR) for said, _ in words]
    return {
        "queued": len(told),
        "granted": len(done),
        "estimate": score((rel(t.shown, t), w) for t, w in done),
        "time_limit": score((rel(t.planned, t), w) for t, w in done),
        "with_range": len(ranged),
        "in_range": inside / len(ranged) if ranged else float("nan"),
        "in_words": in_words / len(ranged) if ranged else float("nan"),
        "words_width": statistics.median(widths) if widths else float("nan"),
        "floor_s": FLOOR,
    }


def describe(run_label: str, a: dict[str, Any]) -> str:
    """One line of the figures of ``accuracy``."""
    e, t = a["estimate"], a["time_limit"]

    def pct(x: float) -> str:
        return "-" if x != x else f"{100 * x:.0f}%"

    def ratio(x: float) -> str:
        return "-" if x != x else f"{x:.2f}"

    return (f"{run_label}: start estimates of the {a['queued']} requests that queued: {pct(e['within_2x'])} within 2x "
            f"of the real wait (median ratio est/real {ratio(e['median_ratio'])}, real start inside the range told "
            f"{pct(a['in_words'])}, median width {ratio(a['words_width'])}x); the time-limit plan of the same run: {pct(t['within_2x'])} within 2x (median "
            f"{ratio(t['median_ratio'])}, {t['with_estimate']} of {t['n']} had one)")
