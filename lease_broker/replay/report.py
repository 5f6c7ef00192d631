"""Tables of replay figures, the idle-timeout sweep, and its plot."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from .accuracy import describe as estimates_line


def _pct(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}%"


def _sec(x: float | None) -> str:
    if x is None or math.isnan(x):
        return "-"
    if x < 120:
        return f"{x:.0f}s"
    if x < 7200:
        return f"{x / 60:.1f}m"
    return f"{x / 3600:.1f}h"


def _num(x: float | None, spec: str = ".0f") -> str:
    return "-" if x is None or math.isnan(x) else format(x, spec)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells)


def _label(s: dict[str, Any]) -> str:
    return "session (baseline)" if s["mode"] == "session" else f"lease idle={_sec(s['idle_timeout_s'])}"


def runs_table(summaries: Sequence[dict[str, Any]], baseline: dict[str, Any] | None = None) -> str:
    """One row per run: the figures the issue asks for."""
    sizes = sorted({k for s in summaries for k in s["time_to_gpu_s"] if k != "all"}, key=int)
    headers = ["RUN", "RESERVED IDLE", "RECLAIMED", "COLD RE-GRANT", "ALLOCATION", "GANG BLOCK", "JAIN"]
    headers += [f"TTG {k}GPU p50/p95/p99" for k in sizes]
    rows = []
    for s in summaries:
        reclaimed = None
        if baseline is not None and baseline["reserved_gpu_s"] > 0:
            reclaimed = 1.0 - s["reserved_gpu_s"] / baseline["reserved_gpu_s"]
        row = [_label(s), _pct(s["reserved_idle_fraction"]), _pct(reclaimed),
               _pct(s["cold_regrant_rate"]) if s["mode"] == "lease" else "-", _pct(s["allocation"]),
               f"{s['gang_block_gpu_s'] / 3600:.1f} GPU-h", f"{s['fairness_jain']:.3f}"]
        for k in sizes:
            t = s["time_to_gpu_s"].get(k)
            row.append("/".join(_sec(t[p]) for p in ("p50", "p95", "p99")) if t else "-")
        rows.append(row)
    return table(headers, rows)


def describe(summaries: Sequence[dict[str, Any]], baseline: dict[str, Any] | None) -> str:
    first = summaries[0] if summaries else baseline
    assert first is not None
    lines = [f"Replay on a {first['cluster']} cluster ({first['gpus']} GPUs): {first['gpu_bursts']} GPU bursts, "
             f"{first['cpu_bursts']} CPU-only cells, {first['owners']} users/sessions"]
    every = ([baseline] if baseline else []) + list(summaries)
    lines.append(runs_table(every, baseline))
    seen: set[str] = set()
    for s in every:
        for note in s["notes"]:
            generic = note.split(" raised from ")[0]  # the same adjustment in every run of a sweep: once
            if generic not in seen:
                seen.add(generic)
                lines.append(f"note ({_label(s)}): {note}")
    for s in every:
        q, c = s["queue_depth"], s["pass_ms_per_event"]
        lines.append(f"{_label(s)}: queue depth max {q['max']}, p95 {_num(q['p95'])} (over time); scheduling "
                     f"cost per event p50 {_num(c['p50'], '.2f')} ms, p99 {_num(c['p99'], '.2f')} ms "
                     f"({c['n']:,} events with a pass of {s['events']:,}); replayed in {s['wall_s']:.1f} s")
    for s in summaries:
        if s.get("suspension"):
            lines.append(suspension_line(_label(s), s["suspension"]))
    for s in summaries:
        if s.get("estimates"):
            lines.append(estimates_line(f"{_label(s)}, limits {s['limits']}", s["estimates"]))
    lines.append("RESERVED IDLE = held GPU-time outside bursts; RECLAIMED = GPU-time not held vs the baseline; "
                 "TTG = time to GPU; GANG BLOCK = free GPU-time while a multi-GPU request waits.")
    wall = sum(s["wall_s"] for s in every)
    lines.append(f"replayed in {wall:.2f} s")
    return "\n".join(lines)


def suspension_line(label: str, s: dict[str, Any]) -> str:
    """What the suspensions of one run cost and gave (``metrics.suspension``), in a line."""
    sizes = ", ".join(f"{k} GPU: {v}" for k, v in s["by_size"].items()) or "none"
    done = (f"every suspended burst completed ({s['bursts_suspended']})" if s["all_completed"]
            else f"{s['bursts_suspended'] - s['bursts_suspended_completed']} suspended burst(s) did NOT complete")
    return (f"suspension ({label}): {s['suspensions']} suspensions ({sizes}; {s['of_running_bursts']} of running "
            f"bursts), suspended {s['suspended_gpu_s'] / 3600:.1f} GPU-h in all, running bursts "
            f"{s['running_suspended_gpu_s'] / 3600:.1f} GPU-h ({_pct(s['running_suspended_share'])} of their GPU-time), "
            f"delay of a suspended burst p50 {_sec(s['delay_s']['p50'])}, max {_sec(s['delay_s']['max'])}; costs paid: "
            f"suspend {_sec(s['suspend_cost_s'])}, resume {_sec(s['resume_cost_s'])} ({s['suspend_s_per_gib']:g} s and "
            f"{s['resume_s_per_gib']:g} s per GiB, {s['source']}; {s['gib_per_gpu']:g} GiB per GPU unless the trace "
            f"says); {done}; {s['resumed_cells']} cells resumed their session's suspended lease")


def _pyplot() -> Any:
    """matplotlib's pyplot drawing to files, or None if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _save(plt: Any, fig: Any, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot(summaries: Sequence[dict[str, Any]], baseline: dict[str, Any], path: str) -> str | None:
    """Reclaimed GPU-time against cold re-grant rate over the sweep; None if matplotlib is missing."""
    plt = _pyplot()
    if plt is None:
        return None
    xs = [100 * s["cold_regrant_rate"] for s in summaries]
    ys = [100 * (1 - s["reserved_gpu_s"] / baseline["reserved_gpu_s"]) for s in summaries]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, ys, marker="o")
    for s, x, y in zip(summaries, xs, ys, strict=True):
        ax.annotate(f"idle {_sec(s['idle_timeout_s'])}", (x, y), textcoords="offset points", xytext=(5, 5))
    ax.set_xlabel("cold re-grants (% of later GPU cells)")
    ax.set_ylabel("GPU-time reclaimed vs session baseline (%)")
    ax.set_title(f"Idle timeout trade-off, {summaries[0]['cluster']} cluster")
    ax.grid(True, alpha=0.3)
    return _save(plt, fig, path)


def pressure_plot(runs: Sequence[tuple[str, dict[str, Any]]], path: str) -> str | None:
    """Held-but-idle GPU-time against cold re-grants and against the 1-GPU cells' p95 wait, one point per
    ``(label, summary)`` (the pressure idle timeouts of a sweep); None if matplotlib is missing."""
    plt = _pyplot()
    if plt is None:
        return None
    ys = [100 * s["reserved_idle_fraction"] for _, s in runs]
    panels = (("cold re-grants", [s["cold_regrants"] for _, s in runs]),
              ("time to GPU, 1-GPU cells, p95 (s)", [s["time_to_gpu_s"]["1"]["p95"] for _, s in runs]))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, (xlabel, xs) in zip(axes, panels, strict=True):
        ax.plot(xs, ys, marker="o", linestyle="none")
        for (label, _), x, y in zip(runs, xs, ys, strict=True):
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(5, 5))
        ax.set_xlabel(xlabel)
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("held-but-idle GPU-time (%)")
    fig.suptitle(f"Pressure idle timeout trade-off, {runs[0][1]['cluster']} cluster, idle timeout "
                 f"{_sec(runs[0][1]['idle_timeout_s'])}")
    return _save(plt, fig, path)


def suspend_plot(points: Sequence[tuple[str, float, float]], path: str, title: str) -> str | None:
    """The interactive-first trade-off: per policy design ``(label, 1-GPU p95 wait, 8-GPU p95 wait)`` in seconds, the
    short cells' wait against the big requests' (the first point is the default policy); None without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs, ys = [max(x, 1.0) for _, x, _ in points], [y / 3600 for _, _, y in points]
    ax.plot(xs, ys, marker="o", linestyle="none")
    for i, ((label, _, _), x, y) in enumerate(zip(points, xs, ys, strict=True)):
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(5, 4 if i % 2 else -11), fontsize=8)
    ax.axvline(60, color="grey", linestyle=":", linewidth=1)
    ax.axhline(ys[0], color="grey", linestyle="--", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlabel("time to GPU, 1-GPU cells, p95 (s, log; dotted: the 60 s goal)")
    ax.set_ylabel("time to GPU, 8-GPU requests, p95 (h; dashed: default)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    return _save(plt, fig, path)
