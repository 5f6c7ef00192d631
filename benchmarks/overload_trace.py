"""An overloaded batch-cluster trace for the replay: ``python -m benchmarks.overload_trace OUT.csv``.

``generate(path, jobs=30000, days=30, gpus_total=64, load=3.0, seed=1)`` writes a bursts CSV that
``gpulease replay`` reads (``job_id,start_s,duration_s,num_gpus,user``; no ``session_id``, so each job is
replayed as its own session: a batch job holds its GPUs busy for its whole duration, one burst).
The same seed gives the same file, byte for byte. The distributions:

- **Arrivals**: a Poisson process over ``days`` with a daily cycle, conditioned on exactly ``jobs``
  arrivals (so its times are independent draws from the rate's shape, sorted). The rate is
  ``1 + 0.5 * sin(2 pi (hour - 9) / 24)``: its peak (1.5x the mean) at 15:00, its trough (0.5x) at 03:00.
- **Sizes**: 1, 4 or 8 GPUs with probabilities 1/2, 1/6 and 1/3 (about half 1-GPU, a third 8-GPU, the
  rest 4-GPU, as in real clusters).
- **Durations**: lognormal with sigma 1.8 (heavy-tailed: the mean is about 5x the median), clipped to
  [2 min, 3 days] and rounded to whole seconds. The median is solved for (bisection) so that the
  offered load ``sum(gpus x duration) / (gpus_total x days x 86,400 s)`` is ``load``; for the defaults
  the median is about 15 minutes and the mean about 1.2 hours.
- **Users**: ``users`` (60) submitters, the k-th with weight 1/k^1.1 (Zipf: the heaviest submits about a quarter of
  the jobs, two thirds submit fewer than 1 % each), so fair share orders the queue as on a shared cluster.
  ``users=0``: no user column, so every job is its own user (as in a real trace without user ids), all at the
  same fair-share score while they wait: ``--jobs 31000 --load 3.4 --users 0`` is the many-users month.
"""

from __future__ import annotations

import argparse
import csv
import math
import random
import sys
from pathlib import Path

DAY = 86_400.0
MIN_DURATION, MAX_DURATION = 120.0, 3 * DAY
SIGMA = 1.8
SIZES = ((1, 1 / 2), (4, 1 / 6), (8, 1 / 3))
USERS = 60  # who submits: a Zipf law over this many users (a few heavy users, a long tail), as in real clusters
ZIPF = 1.1
CYCLE = 0.5  # amplitude of the daily cycle, as a fraction of the mean rate
PEAK_HOUR = 15.0


def _rate(t: float) -> float:
    """The arrival rate's shape at ``t`` seconds from the start (midnight): mean 1."""
    hour = (t % DAY) / 3600.0
    return 1.0 + CYCLE * math.sin(2 * math.pi * (hour - PEAK_HOUR + 6.0) / 24.0)


def _arrivals(rng: random.Random, jobs: int, days: float) -> list[float]:
    """``jobs`` arrival times of the cycled Poisson process, conditioned on their count (by thinning)."""
    out: list[float] = []
    span, top = days * DAY, 1.0 + CYCLE
    while len(out) < jobs:
        t = rng.uniform(0.0, span)
        if rng.random() * top <= _rate(t):
            out.append(float(math.floor(t)))
    return sorted(out)


def _offered(gpus: list[int], shapes: list[float], median: float) -> float:
    return sum(g * _clip(median * s) for g, s in zip(gpus, shapes, strict=True))


def _clip(d: float) -> float:
    return float(round(min(MAX_DURATION, max(MIN_DURATION, d))))


def generate(path: str | Path, jobs: int = 30000, days: float = 30, gpus_total: int = 64, load: float = 3.0,
             seed: int = 1, users: int = USERS) -> Path:
    """Write the trace to ``path`` and return it; see the module's docstring for the distributions."""
    if jobs < 1 or days <= 0 or gpus_total < 8 or load <= 0 or users < 0:
        raise ValueError(f"Invalid trace: jobs={jobs!r} days={days!r} gpus_total={gpus_total!r} load={load!r} "
                         f"users={users!r} (need jobs >= 1, days > 0, gpus_total >= 8 for the 8-GPU jobs, load > 0, "
                         "users >= 0)")
    rng = random.Random(seed)
    starts = _arrivals(rng, jobs, days)
    sizes, weights = [s for s, _ in SIZES], [w for _, w in SIZES]
    gpus = rng.choices(sizes, weights, k=jobs)
    shapes = [rng.lognormvariate(0.0, SIGMA) for _ in range(jobs)]
    target = load * gpus_total * days * DAY
    lo, hi = MIN_DURATION / 1000, MAX_DURATION  # the offered load grows with the median
    if _offered(gpus, shapes, hi) < target:
        raise ValueError(f"load={load!r} is out of reach: even the longest jobs ({MAX_DURATION:g} s) offer less")
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if _offered(gpus, shapes, mid) < target else (lo, mid)
    median = math.sqrt(lo * hi)
    rank_weights = [1.0 / (k + 1) ** ZIPF for k in range(users)]
    owners = [f"user{k:03d}" for k in rng.choices(range(users), rank_weights, k=jobs)] if users else [""] * jobs
    # (drawn after the rest: the arrivals, sizes and durations are those of a trace without users)
    out = Path(path)
    with out.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["job_id", "start_s", "duration_s", "num_gpus", "user"])
        for i, (start, g, shape, user) in enumerate(zip(starts, gpus, shapes, owners, strict=True)):
            w.writerow([f"job-{i:05d}", int(start), int(_clip(median * shape)), g, user])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.overload_trace", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="the bursts CSV to write")
    p.add_argument("--jobs", type=int, default=30000, help="number of jobs (default 30000)")
    p.add_argument("--days", type=float, default=30, help="span of the arrivals in days (default 30)")
    p.add_argument("--gpus", type=int, default=64, help="GPUs of the cluster the load is relative to (default 64)")
    p.add_argument("--load", type=float, default=3.0, help="offered load, in cluster capacities (default 3)")
    p.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    p.add_argument("--users", type=int, default=USERS, help=f"users who submit (Zipf law; default {USERS}; 0: every job its own user)")
    a = p.parse_args(argv)
    try:
        generate(a.out, a.jobs, a.days, a.gpus, a.load, a.seed, a.users)
    except ValueError as e:
        print(f"python -m benchmarks.overload_trace: {e}", file=sys.stderr)
        return 2
    print(f"wrote {a.out}: {a.jobs} jobs over {a.days:g} days, offered load {a.load:g}x of {a.gpus} GPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
