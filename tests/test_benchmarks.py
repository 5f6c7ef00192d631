"""The benchmark harness runs and writes its report (tiny --quick sizes; timings are never asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIGURES = ["grant of a free GPU", "release, ", "grants/s", "grant+release pairs/s per GET /info", "no-op POST pairs/s per GET /info",
           "scheduler decisions/s", "broker RSS", "restart to serving"]


def test_quick_broker_benchmarks_write_every_figure_and_keep_other_sections(tmp_path: Path) -> None:
    out, data = tmp_path / "BENCHMARKS.md", tmp_path / "figures.json"
    other = "<!-- bench:cell -->\n## %%gpu cell\n\nkept as it was\n<!-- /bench:cell -->\n"
    out.write_text("# Benchmarks\n\n" + other)
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--only", "broker", "--output", str(out), "--json", str(data)],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    report = json.loads(data.read_text())
    assert report["quick"] is True and report["machine"]["cores"] >= 1 and report["machine"]["cpu"]
    figures = report["modules"]["broker"]["figures"]
    for prefix in FIGURES:
        assert any(f["name"].startswith(prefix) for f in figures), prefix
    for f in figures:
        assert f["unit"] and f["n"] >= 1, f
        for key in ("median", "p99", "min", "max"):
            assert isinstance(f[key], float) and f["min"] <= f[key] <= f["max"], (f["name"], key)
        base = f["baseline"]
        assert base["name"] and base["n"] >= 1 and isinstance(base["median"], float), f["name"]
        assert f["result"] in ("PASS", "FAIL", "no bar")
        assert (f["bar"] is None) == (f["result"] == "no bar")

    text = out.read_text()
    assert other in text  # --only broker keeps the other modules' sections
    assert "<!-- bench:broker -->" in text and "<!-- /bench:broker -->" in text
    assert "python -m benchmarks --quick --only broker" in text and "cores" in text
    for f in figures:
        assert f"| {f['name']} |" in text
        if f["bar"]:
            assert f"**{f['result']}**" in text


def test_quick_enforcement_benchmark_sees_every_lease_revoked_or_expired(tmp_path: Path) -> None:
    out, data = tmp_path / "BENCHMARKS.md", tmp_path / "figures.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--only", "enforcement", "--output", str(out),
         "--json", str(data)],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    # the module raises if a lease ended any other way than revoked (idle) / expired (time limit)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (fig,) = json.loads(data.read_text())["modules"]["enforcement"]["figures"]
    assert fig["name"].startswith("idle revocation") and fig["n"] == 5 and fig["baseline"]["n"] == 5
    assert fig["min"] >= 0 and fig["baseline"]["min"] >= 0  # never taken back before its deadline
    assert "<!-- bench:enforcement -->" in out.read_text()


def test_quick_notify_benchmark_grants_beside_a_hanging_webhook(tmp_path: Path) -> None:
    out, data = tmp_path / "BENCHMARKS.md", tmp_path / "figures.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--only", "notify", "--output", str(out), "--json", str(data)],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]  # every lease was granted at once
    grants, ratio = json.loads(data.read_text())["modules"]["notify"]["figures"]
    assert grants["n"] == grants["baseline"]["n"] == 40 and ratio["unit"] == "ratio" and ratio["bar"]
    assert "<!-- bench:notify -->" in out.read_text()


def test_backends_benchmark_measures_the_single_host_and_lists_engines(tmp_path: Path) -> None:
    """The single-host column of the backends module (the engines' columns run in `make bench`)."""
    from benchmarks.backends import BACKENDS, Backend, SingleHost, measure

    m = measure(SingleHost(), str(tmp_path), rounds=2, workers=1)
    assert len(m["grant"]) == len(m["release"]) == 2 and len(m["worker"]) == 1
    assert all(v > 0 for vs in m.values() for v in vs)
    assert BACKENDS and all(issubclass(b, Backend) and b.name != Backend.name for b in BACKENDS)


def test_quick_replay_scale_benchmark_has_both_modes_and_every_figure(tmp_path: Path) -> None:
    out, data = tmp_path / "BENCHMARKS.md", tmp_path / "figures.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--only", "replay_scale", "--output", str(out),
         "--json", str(data)],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads(data.read_text())["modules"]["replay_scale"]["figures"]
    names = [f["name"] for f in figures]
    assert names[0].startswith("replay wall time, 300 jobs") and "held-but-idle GPU-time" in names
    for expected in ("time to GPU, 1-GPU jobs, p95", "time to GPU, 8-GPU jobs, p50", "queue depth, max",
                     "queue depth, p95 over time", "scheduling cost per event, p99"):
        assert expected in names
    assert all(f["n"] == 1 and f["baseline"]["n"] == 1 for f in figures)
    assert "<!-- bench:replay_scale -->" in out.read_text()


def test_quick_holders_benchmark_measures_every_way_a_kernel_ends(tmp_path: Path) -> None:
    out, data = tmp_path / "BENCHMARKS.md", tmp_path / "figures.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--only", "holders", "--output", str(out), "--json", str(data)],
        cwd=ROOT, capture_output=True, text=True, timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = {f["name"]: f for f in json.loads(data.read_text())["modules"]["holders"]["figures"]}
    ends = [f for name, f in figures.items() if name.startswith(("Ctrl-C", "kernel restarted", "kill -9", "kernel exits"))]
    assert len(ends) == 4, list(figures)
    for f in ends:  # each kernel's leases ended by the broker (no figure without its tries), against the heartbeat
        assert f["n"] >= 1 and f["baseline"]["n"] >= 1 and f["bar"], f["name"]
    assert figures["false revocations (holder_gone) of this run's kernels"]["max"] == 0
    assert "<!-- bench:holders -->" in out.read_text()


def test_quick_queue_and_month_benchmarks_measure_many_users(tmp_path: Path) -> None:
    out, data = tmp_path / "BENCHMARKS.md", tmp_path / "figures.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--only", "queue", "--only", "replay_month", "--output",
         str(out), "--json", str(data)],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    modules = json.loads(data.read_text())["modules"]
    names = [f["name"] for f in modules["queue"]["figures"]]
    assert any(n.startswith("grant p99 with 500 users queued / with none") for n in names), names
    (month,) = modules["replay_month"]["figures"]
    assert month["n"] == 1 and "all 300 jobs granted" in month["note"]
