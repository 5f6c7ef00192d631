"""Benchmarks of jupyter-gpulease: ``python -m benchmarks [--quick] [--only NAME]`` rewrites BENCHMARKS.md.

Each benchmark module (listed in ``MODULES``) defines ``run(opts) -> list[Figure]``; a figure is a dict
made by :func:`benchmarks.report.figure`: name, unit, the statistics of its samples (median, p99, min, max,
n), a baseline measured in the same run (name + the same statistics) and the bar it is checked against.
To add a module: create ``benchmarks/NAME.py`` with ``TITLE`` and ``run(opts)``, and list it here.
"""

from __future__ import annotations

#: Benchmark modules, in the order their sections appear in BENCHMARKS.md.
MODULES: list[str] = ["broker", "notify", "queue", "enforcement", "holders", "cell", "suspend", "replay", "replay_scale", "replay_month", "backends", "reply_to_free", "remote_values", "warm_ray", "demo", "load", "reliability"]

#: Run by ``make soak`` (``--only load --only reliability``), not by a plain ``python -m benchmarks``: they
#: re-run the fault, security and fuzz suites and hold 1,000 clients for a minute (about 10 minutes).
SOAK: list[str] = ["load", "reliability"]
