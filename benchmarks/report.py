"""Figures, their statistics, and the BENCHMARKS.md report (one section per benchmark module)."""

from __future__ import annotations

import datetime
import math
import os
import platform
import re
import statistics
from pathlib import Path
from typing import Any

Figure = dict[str, Any]


def stats(samples: list[float]) -> dict[str, Any]:
    """median, p99 (nearest rank), min, max and n of some samples."""
    if not samples:
        return {"median": None, "p99": None, "min": None, "max": None, "n": 0}
    ordered = sorted(samples)
    rank = max(0, math.ceil(0.99 * len(ordered)) - 1)
    return {
        "median": statistics.median(ordered),
        "p99": ordered[rank],
        "min": ordered[0],
        "max": ordered[-1],
        "n": len(ordered),
    }


def figure(
    name: str,
    unit: str,
    samples: list[float],
    baseline_name: str,
    baseline_samples: list[float],
    *,
    bar: tuple[str, str, float] | None = None,
    note: str = "",
) -> Figure:
    """A figure: ``bar`` is (statistic, "<=" or ">=", goal), e.g. ("p99", "<=", 10.0); None = no bar."""
    out: Figure = {"name": name, "unit": unit, **stats(samples),
                   "baseline": {"name": baseline_name, "unit": unit, **stats(baseline_samples)}, "note": note}
    if bar is None:
        out["bar"], out["result"] = None, "no bar"
    else:
        stat, op, goal = bar
        value = out[stat]
        ok = value is not None and (value <= goal if op == "<=" else value >= goal)
        out["bar"] = {"stat": stat, "op": op, "goal": goal}
        out["result"] = "PASS" if ok else "FAIL"
    return out


def machine() -> dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"platform": platform.platform(), "python": platform.python_version(),
            "cores": os.cpu_count() or 0, "cpu": model or platform.processor() or "unknown"}


def fmt(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        if value == 0 or abs(value) >= 100:
            return f"{value:,.0f}"
        if abs(value) >= 1:
            return f"{value:.2f}"
        return f"{value:.3g}"
    return str(value)


def bar_text(f: Figure) -> str:
    if not f.get("bar"):
        return "no bar"
    b = f["bar"]
    return f"{b['stat']} {'≤' if b['op'] == '<=' else '≥'} {fmt(b['goal'])} {f['unit']}: **{f['result']}**"


def table(figures: list[Figure]) -> str:
    """A plain-text table for the terminal."""
    rows = [("figure", "unit", "median", "p99", "min", "max", "n", "baseline median", "bar")]
    for f in figures:
        rows.append((f["name"], f["unit"], fmt(f["median"]), fmt(f["p99"]), fmt(f["min"]), fmt(f["max"]),
                     str(f["n"]), f"{fmt(f['baseline']['median'])} ({f['baseline']['name']})", bar_text(f)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def section(module: str, title: str, figures: list[Figure], command: str, when: str, mach: dict[str, Any],
            quick: bool) -> str:
    lines = [
        f"<!-- bench:{module} -->",
        f"## {title}",
        "",
        f"- Command: `{command}`" + (" (**quick mode: tiny sizes, not the real figures**)" if quick else ""),
        f"- Machine: {mach['platform']}, Python {mach['python']}, {mach['cores']} cores, {mach['cpu']}",
        f"- Date: {when}",
        "",
        "| Figure | Unit | median | p99 | min | max | n | Baseline (same run) | base median | base p99 | Bar |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for f in figures:
        b = f["baseline"]
        lines.append(
            f"| {f['name']} | {f['unit']} | {fmt(f['median'])} | {fmt(f['p99'])} | {fmt(f['min'])} | "
            f"{fmt(f['max'])} | {f['n']} | {b['name']} | {fmt(b['median'])} | {fmt(b['p99'])} | {bar_text(f)} |"
        )
    notes = [f"- **{f['name']}**: {f['note']}" for f in figures if f.get("note")]
    if notes:
        lines += ["", *notes]
    lines += [f"<!-- /bench:{module} -->", ""]
    return "\n".join(lines)


HEADER = """# Benchmarks

Written by `make bench` (`python -m benchmarks`); do not edit by hand. Every figure has a baseline measured
in the same run on the same machine, because the machine may be shared and absolute numbers are noisy.
A section is rewritten only when its module runs (`python -m benchmarks --only NAME`). The project's
modules are compiled to bytecode before a run, as `pip install` does (see `benchmarks/__main__.py`).

"""

_SECTION = re.compile(r"<!-- bench:(?P<name>[\w.-]+) -->\n.*?<!-- /bench:(?P=name) -->\n?", re.S)


def sections(text: str) -> dict[str, str]:
    return {m.group("name"): m.group(0).rstrip("\n") + "\n" for m in _SECTION.finditer(text)}


def rewrite(path: Path, new: dict[str, str], order: list[str]) -> str:
    """Replace the sections in ``new``, keep every other section of the file, in registry order."""
    old = sections(path.read_text()) if path.exists() else {}
    merged = {**old, **new}
    names = [n for n in order if n in merged] + sorted(n for n in merged if n not in order)
    text = HEADER + "\n".join(merged[n] for n in names)
    path.write_text(text)
    return text


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
