"""Trace replay through the real LeaseManager/scheduler on a virtual clock: known answers by hand."""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from traitlets.config import Config

from benchmarks.overload_trace import generate
from lease_broker.core.lease import Lease, LeaseRequest, LeaseState
from lease_broker.policy.lease_policy import LeasePolicy
from lease_broker.replay import (
    Cluster,
    TraceError,
    jain,
    jitter,
    load_policy,
    load_trace,
    percentile,
    replay,
    summarize,
    tile,
)
from lease_broker.replay.accuracy import accuracy, score
from lease_broker.replay.cli import main as replay_main
from lease_broker.replay.model import Told
from lease_broker.replay.report import describe
from lease_broker.replay.sim import OFFSET

ROOT = Path(__file__).resolve().parents[3]
TRACES = Path("/work/shared/traces")
NOTEBOOK_BURSTS = TRACES / "notebook_bursts.csv"
NOTEBOOK_SESSIONS = TRACES / "notebook_sessions.csv"


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


@pytest.fixture
def one_session(tmp_path):
    """One 1-GPU session: a burst, a short pause (warm), a long pause (cold)."""
    bursts = write(tmp_path, "b.csv", "session_id,start_s,duration_s,num_gpus,extra\n"
                   "s,0,100,1,x\ns,300,100,1,y\ns,450,0,0,cpu\ns,2000,100,1,z\n")
    sessions = write(tmp_path, "s.csv", "session_id,start_s,stop_s,max_gpus\ns,0,2100,1\n")
    return load_trace(bursts, sessions)


def test_warm_within_idle_window_and_cold_after_it(one_session):
    run = replay(one_session, Cluster(1, 1), mode="lease", idle=600)
    s = summarize(run)
    assert s["gpu_bursts"] == s["granted"] == 3 and s["cpu_bursts"] == 1
    assert [o.warm for o in run.outcomes] == [False, True, False]
    assert s["warm_grants"] == 1 and s["cold_regrants"] == 1 and s["cold_regrant_rate"] == 0.5
    # lease 1 held 0..(400 + 600), revoked as idle by the real enforcer; lease 2 held 2000..2100, when the session's
    # kernel ended (its stop_s) and the lease with it
    assert [(lease.state, lease.reason) for lease in run.leases] == [
        (LeaseState.REVOKED, "idle"), (LeaseState.RELEASED, "kernel_shutdown")]
    assert s["reserved_gpu_s"] == pytest.approx(1000 + 100)
    assert s["busy_gpu_s"] == 300
    assert s["reserved_idle_fraction"] == pytest.approx(1 - 300 / 1100)
    assert s["time_to_gpu_s"]["1"]["max"] == 0


def test_baseline_holds_from_start_to_stop(one_session):
    base = summarize(replay(one_session, Cluster(1, 1), mode="session"))
    assert base["reserved_gpu_s"] == 2100 and base["busy_gpu_s"] == 300
    assert base["reserved_idle_fraction"] == pytest.approx(1 - 300 / 2100)
    lease = summarize(replay(one_session, Cluster(1, 1), mode="lease", idle=600))
    assert lease["reserved_idle_fraction"] < base["reserved_idle_fraction"]


def test_short_idle_timeout_makes_every_later_cell_cold(one_session):
    s = summarize(replay(one_session, Cluster(1, 1), mode="lease", idle=60))
    assert s["cold_regrant_rate"] == 1.0
    assert s["reserved_gpu_s"] == pytest.approx(2 * 160 + 100)  # the last one ends with the kernel at 2100


def test_policy_file_caps_the_idle_timeout(one_session, tmp_path):
    cfg = write(tmp_path, "policy.py", "c.LeasePolicy.max_idle_timeout_seconds = 150\n")
    run = replay(one_session, Cluster(1, 1), load_policy(str(cfg)), mode="lease", idle=600)
    assert [o.warm for o in run.outcomes] == [False, False, False]  # the 200 s pause outlives 150 s
    assert all(lease.idle_timeout_seconds == 150 for lease in run.leases)


def test_gang_waits_for_all_its_gpus(tmp_path):
    bursts = write(tmp_path, "b.csv", "session_id,start_s,duration_s,num_gpus\na,0,100,1\nb,10,50,4\n")
    run = replay(load_trace(bursts), Cluster(1, 4), mode="lease", idle=0)
    s = summarize(run)
    gang = next(o for o in run.outcomes if o.gpus == 4)
    assert gang.wait == 90  # until the 1-GPU cell ends at 100: never a partial hold
    assert s["gang_block_gpu_s"] == pytest.approx(3 * 90)  # 3 GPUs idle from 10 to 100
    assert s["time_to_gpu_s"]["4"]["p50"] == 90
    # with lingering leases the gang waits for the idle revocation too
    run = replay(load_trace(bursts), Cluster(1, 4), mode="lease", idle=60)
    assert next(o for o in run.outcomes if o.gpus == 4).wait == 150


def test_a_waiting_cell_moves_the_sessions_later_cells(tmp_path):
    bursts = write(tmp_path, "b.csv", "session_id,start_s,duration_s,num_gpus\n"
                   "a,0,100,1\nb,50,100,1\nb,200,10,1\n")
    run = replay(load_trace(bursts), Cluster(1, 1), mode="lease", idle=0)
    b1, b2 = (o for o in run.outcomes if o.owner == "b")
    assert b1.wait == 50 and b1.arrival == 50
    assert b2.arrival == 250 and b2.wait == 0  # same 50 s pause after its (late) predecessor


def test_the_lease_a_session_still_holds_ends_with_its_kernel(tmp_path):
    # one GPU: a's cell ends at 100 and its kernel at 130, before its idle deadline (700) and before the pressure
    # idle timeout would revoke it for b's waiting cell (160): its lease ends with the kernel (as the extension gives
    # a kernel's leases back when it ends), and b's cell gets the GPU at 130. b waited 80 s, so its stop moves by as
    # much (500 -> 580), still before its idle deadline (230 + 600).
    bursts = write(tmp_path, "b.csv", "session_id,start_s,duration_s,num_gpus\na,0,100,1\nb,50,100,1\n")
    sessions = write(tmp_path, "s.csv", "session_id,start_s,stop_s,max_gpus\na,0,130,1\nb,50,500,1\n")
    run = replay(load_trace(bursts, sessions), Cluster(1, 1), mode="lease", idle=600)
    assert [o.wait for o in run.outcomes] == [0, 80]
    assert [(x.reason, x.ended_at - OFFSET) for x in run.leases] == [("kernel_shutdown", 130), ("kernel_shutdown", 580)]
    # stops after the leases' ends change nothing (a's revoked for b at 160, b's idle at 260 + 600); nor does a trace
    # without a sessions file, where no kernel ends
    sessions = write(tmp_path, "s.csv", "session_id,start_s,stop_s,max_gpus\na,0,5000,1\nb,50,5000,1\n")
    for trace in (load_trace(bursts, sessions), load_trace(bursts)):
        run = replay(trace, Cluster(1, 1), mode="lease", idle=600)
        assert [(x.reason, x.ended_at - OFFSET) for x in run.leases] == [("idle_pressure", 160), ("idle", 860)]


def test_baseline_sessions_queue_first_come_first_served(tmp_path):
    bursts = write(tmp_path, "b.csv", "session_id,start_s,duration_s,num_gpus\na,0,10,2\nb,5,10,2\n")
    sessions = write(tmp_path, "s.csv", "session_id,start_s,stop_s,max_gpus\na,0,100,2\nb,5,50,2\n")
    run = replay(load_trace(bursts, sessions), Cluster(1, 2), mode="session")
    s = summarize(run)
    assert [o.wait for o in run.outcomes] == [0, 95]  # b waits for a's stop
    assert s["reserved_gpu_s"] == 2 * 100 + 2 * 45


def test_without_sessions_the_baseline_spans_each_sessions_bursts(tmp_path):
    bursts = write(tmp_path, "b.csv", "session_id,start_s,duration_s,num_gpus\na,0,10,1\na,90,10,1\n")
    s = summarize(replay(load_trace(bursts), Cluster(1, 1), mode="session"))
    assert s["reserved_gpu_s"] == 100 and s["reserved_idle_fraction"] == pytest.approx(0.8)


@pytest.mark.parametrize(
    ("text", "expect"),
    [
        ("session_id,start_s,num_gpus\ns,0,1\n", ":1: missing column(s) duration_s"),
        ("session_id,start_s,duration_s,num_gpus\ns,0,10,1\ns,-5,10,1\n", ":3: start_s='-5' is negative"),
        ("session_id,start_s,duration_s,num_gpus\ns,0,ten,1\n", ":2: duration_s='ten' is not a number"),
        ("session_id,start_s,duration_s,num_gpus\ns,0,10,1.5\n", ":2: num_gpus='1.5' is not a whole number"),
        ("session_id,start_s,duration_s,num_gpus\ns,0,10,nan\n", ":2: num_gpus='nan' is not a finite number"),
        ("", "empty file"),
    ],
)
def test_bad_bursts_name_file_line_and_value(tmp_path, text, expect):
    p = write(tmp_path, "bad.csv", text)
    with pytest.raises(TraceError) as e:
        load_trace(p)
    assert str(p) in str(e.value) and expect in str(e.value)


def test_bad_sessions_and_too_many_gpus(tmp_path):
    bursts = write(tmp_path, "b.csv", "session_id,start_s,duration_s,num_gpus\ns,0,10,1\nt,0,10,16\n")
    with pytest.raises(TraceError, match=r"b\.csv:3: num_gpus=16 is more than the cluster's 8 GPUs"):
        replay(load_trace(bursts), Cluster(1, 8))
    sessions = write(tmp_path, "s.csv", "session_id,start_s,stop_s,max_gpus\ns,10,5,1\n")
    with pytest.raises(TraceError, match=r"s\.csv:2: stop_s=5 is before start_s=10"):
        load_trace(bursts, sessions)
    sessions = write(tmp_path, "s2.csv", "session_id,start_s,stop_s,max_gpus\ns,0,50,1\n")
    with pytest.raises(TraceError, match=r"b\.csv:3: session_id='t' is not in"):
        load_trace(bursts, sessions)


def test_cli_bad_trace_exits_2_without_traceback(tmp_path):
    p = write(tmp_path, "bad.csv", "session_id,start_s,duration_s,num_gpus\ns,0,10,x\n")
    proc = subprocess.run([sys.executable, "-m", "jupyter_gpulease.cli", "replay", str(p)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert f"{p}:2" in proc.stderr and "num_gpus='x'" in proc.stderr and "not a number" in proc.stderr
    assert "Traceback" not in proc.stderr
    big = write(tmp_path, "big.csv", "session_id,start_s,duration_s,num_gpus\ns,0,10,32\n")
    assert replay_main([str(big), "--cluster", "2x8"]) == 2


def test_cli_json_through_gpulease(tmp_path, one_session):
    bursts = write(tmp_path, "b.csv", "session_id,start_s,duration_s,num_gpus\n"
                   "s,0,100,1\ns,300,100,1\ns,2000,100,1\n")
    sessions = write(tmp_path, "s.csv", "session_id,start_s,stop_s,max_gpus\ns,0,2100,1\n")
    proc = subprocess.run(
        [sys.executable, "-m", "jupyter_gpulease.cli", "--json", "replay", str(bursts), "--sessions", str(sessions),
         "--cluster", "1x1", "--sweep", "idle=1m,10m"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["baseline"]["reserved_gpu_s"] == 2100
    assert [r["idle_timeout_s"] for r in out["runs"]] == [60, 600]
    assert [r["cold_regrant_rate"] for r in out["runs"]] == [1.0, 0.5]
    assert out["runs"][1]["reclaimed_fraction"] == pytest.approx(1 - 1100 / 2100)


def test_cli_table(tmp_path, capsys):
    bursts = write(tmp_path, "b.csv", "start_s,duration_s,num_gpus\n0,100,1\n50,100,2\n")
    assert replay_main([str(bursts), "--cluster", "1x2", "--idle", "5m"]) == 0
    out = capsys.readouterr().out
    assert "session (baseline)" in out and "lease idle=5.0m" in out and "TTG 2GPU" in out


def test_plot_of_the_sweep(tmp_path, one_session):
    pytest.importorskip("matplotlib", reason="matplotlib is in the 'test' extra; install it to test --plot")
    bursts = write(tmp_path, "b.csv", "session_id,start_s,duration_s,num_gpus\ns,0,100,1\ns,300,100,1\n")
    png = tmp_path / "sweep.png"
    assert replay_main([str(bursts), "--cluster", "1x1", "--sweep", "idle=1m,10m", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_percentile_and_jain():
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5], 99) == 5
    assert jain([1, 1, 1]) == 1.0 and jain([1, 0, 0, 0]) == 0.25


def test_tile_shifts_copies_with_distinct_sessions(one_session):
    t = tile(one_session, 3)
    assert len(t.bursts) == 3 * len(one_session.bursts)
    assert {b.session for b in t.bursts} == {"s", "s#1", "s#2"}
    assert t.bursts[len(one_session.bursts)].start == one_session.span


def test_jitter_moves_each_session_with_its_bursts_repeatably(tmp_path):
    bursts = tmp_path / "b.csv"
    bursts.write_text("session_id,burst,start_s,duration_s,num_gpus\n"
                      "a,0,4000,60,1\na,1,4300,60,1\nb,0,5000,60,2\n,0,6000,60,1\n")
    sessions = tmp_path / "s.csv"
    sessions.write_text("session_id,start_s,stop_s,max_gpus\na,3900,4500,1\nb,4900,5200,2\n")
    trace = load_trace(bursts, sessions)
    one, again, other = jitter(trace, 1, 600), jitter(trace, 1, 600), jitter(trace, 2, 600)
    assert one == dataclasses.replace(again, name=one.name) and one.bursts != other.bursts
    by = {(b.session, b.start - o.start) for b, o in zip(one.bursts, trace.bursts, strict=True)}
    shift = {s: d for s, d in by}
    assert len(by) == len(shift) == 3, "a session's bursts move together; the lone burst by itself"
    assert all(abs(d) <= 600 for d in shift.values())
    a = next(s for s in one.sessions if s.id == "a")
    assert a.start - 3900 == shift["a"] and a.stop - 4500 == shift["a"]
    assert [b.gpus for b in one.bursts] == [b.gpus for b in trace.bursts]


@pytest.mark.skipif(not NOTEBOOK_BURSTS.exists(), reason=f"{NOTEBOOK_BURSTS} is not on this machine")
def test_notebook_trace_structural_sanity():
    trace = load_trace(NOTEBOOK_BURSTS, NOTEBOOK_SESSIONS)
    cluster = Cluster(8, 8)
    base = summarize(replay(trace, cluster, mode="session"))
    lease = summarize(replay(trace, cluster, mode="lease", idle=600))
    for s in (base, lease):
        assert s["granted"] == s["gpu_bursts"] == 518 and s["cpu_bursts"] == 272
        for key in ("reserved_idle_fraction", "cold_regrant_rate", "allocation", "fairness_jain",
                    "gang_block_fraction"):
            assert 0 <= s[key] <= 1, key
    assert base["reserved_idle_fraction"] == pytest.approx(0.743, abs=0.001)  # the trace README's 74 %
    assert lease["reserved_idle_fraction"] < base["reserved_idle_fraction"]
    assert lease["busy_gpu_s"] == base["busy_gpu_s"]


def test_missing_file_and_bad_policy_exit_2(tmp_path, capsys):
    assert replay_main([str(tmp_path / "nope.csv")]) == 2
    assert "nope.csv: cannot read" in capsys.readouterr().err
    bursts = write(tmp_path, "b.csv", "start_s,duration_s,num_gpus\n0,10,1\n")
    cfg = write(tmp_path, "pol.py", "c.LeasePolicy.max_idle_timeout_seconds = -1\n")
    assert replay_main([str(bursts), "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "pol.py" in err and "invalid policy" in err and "LeasePolicy.max_idle_timeout_seconds=-1" in err


def _no_gpu_held_twice(run):
    by_gpu: dict[str, list[tuple[float, float]]] = {}
    for lease in run.leases:
        for d in lease.devices:
            by_gpu.setdefault(d, []).append((lease.granted_at, lease.ended_at))
    for spans in by_gpu.values():
        spans.sort()
        for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
            assert start >= end


def test_random_traces_grant_everything_once(tmp_path):
    hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is in the 'test' extra")
    st = hypothesis.strategies
    burst = st.tuples(st.sampled_from("abcd"), st.integers(0, 2000), st.integers(0, 500), st.sampled_from([0, 1, 2, 4]))

    @hypothesis.settings(max_examples=40, deadline=None, database=None)
    @hypothesis.given(st.lists(burst, min_size=1, max_size=25), st.sampled_from([0, 60, 300]))
    def check(rows, idle):
        text = "session_id,start_s,duration_s,num_gpus\n" + "".join(f"{s},{t},{d},{g}\n" for s, t, d, g in rows)
        trace = load_trace(write(tmp_path, "r.csv", text))
        for mode in ("lease", "session"):
            run = replay(trace, Cluster(2, 4), mode=mode, idle=idle)
            s = summarize(run)
            assert s["granted"] == s["gpu_bursts"] == sum(1 for r in rows if r[3])
            assert s["reserved_gpu_s"] >= s["busy_gpu_s"] - 1e-6
            assert all(lease.state.terminal for lease in run.leases)
            _no_gpu_held_twice(run)

    check()


def test_report_has_queue_depth_over_time_and_cost_per_event(tmp_path):
    """Three 1-GPU jobs at once on one GPU: 2 wait for 100 s, then 1 for 100 s, then none."""
    bursts = write(tmp_path, "jobs.csv", "job_id,start_s,duration_s,num_gpus\na,0,100,1\nb,0,100,1\nc,0,100,1\n")
    trace = load_trace(bursts)
    s = summarize(replay(trace, Cluster(1, 1), mode="lease", idle=0))
    assert s["queue_depth"]["max"] == 2
    assert s["queue_depth"]["p50"] == 1 and s["queue_depth"]["p95"] == 2  # weighted by virtual time
    cost = s["pass_ms_per_event"]
    assert cost["n"] >= 3 and 0 < cost["p50"] <= cost["p99"] <= cost["max"]
    assert any("3 burst(s)" in n and "no session_id" in n for n in s["notes"]), s["notes"]
    base = summarize(replay(trace, Cluster(1, 1), mode="session"))
    text = describe([s], base)
    assert "queue depth max 2" in text and "p95 2" in text and "scheduling cost per event" in text
    assert text.count("have no session_id") == 1  # the same note once, not per run


def _on_a_terminal(args: list[str]) -> str:
    """What the CLI writes to a terminal (stdout and stderr on one pty)."""
    main_fd, sub_fd = os.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "lease_broker.replay", *args], stdout=sub_fd, stderr=sub_fd)
    os.close(sub_fd)
    chunks = []
    while True:
        try:
            data = os.read(main_fd, 65536)
        except OSError:  # the pty closes when the process exits
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(timeout=120) == 0
    os.close(main_fd)
    return b"".join(chunks).decode()


def test_progress_on_a_terminal_and_none_with_json(tmp_path):
    bursts = generate(tmp_path / "jobs.csv", jobs=200, days=1)
    shown = _on_a_terminal([str(bursts)])
    assert "\rgpulease replay: lease run" in shown and "100.0% of 200 bursts" in shown  # a line redrawn in place
    assert "\rgpulease replay: session run" in shown and "100.0% of 200 sessions" in shown
    assert "queue depth max" in shown
    quiet = _on_a_terminal([str(bursts), "--json"])
    assert "% of" not in quiet
    assert json.loads(quiet)["runs"][0]["queue_depth"]["max"] >= 1


def test_overload_trace_is_deterministic_and_has_its_mix_and_load(tmp_path):
    a = generate(tmp_path / "a.csv", jobs=2000, days=4, gpus_total=64, load=3.0, seed=7)
    b = generate(tmp_path / "b.csv", jobs=2000, days=4, gpus_total=64, load=3.0, seed=7)
    assert a.read_bytes() == b.read_bytes()
    assert generate(tmp_path / "c.csv", jobs=2000, days=4, seed=8).read_bytes() != a.read_bytes()
    bursts = load_trace(a).bursts  # the replay's own reader takes it
    assert len(bursts) == 2000 and not any(x.session for x in bursts)
    share = {g: sum(1 for x in bursts if x.gpus == g) / 2000 for g in (1, 4, 8)}
    assert share[1] == pytest.approx(1 / 2, abs=0.04) and share[8] == pytest.approx(1 / 3, abs=0.04)
    assert share[4] == pytest.approx(1 / 6, abs=0.04) and sum(share.values()) == 1
    span = 4 * 86400
    assert sum(x.gpus * x.duration for x in bursts) / (64 * span) == pytest.approx(3.0, rel=0.01)
    assert all(0 <= x.start < span and 120 <= x.duration <= 3 * 86400 for x in bursts)
    durations = sorted(x.duration for x in bursts)
    assert sum(durations) / len(durations) > 3 * durations[len(durations) // 2]  # heavy tail: mean >> median
    hour = [int(x.start % 86400 // 3600) for x in bursts]
    afternoon, night = sum(1 for h in hour if 12 <= h < 18), sum(1 for h in hour if 0 <= h < 6)
    assert afternoon > 2 * night  # the daily cycle peaks in the afternoon
    jobs_of: dict[str, int] = {}
    for x in bursts:
        jobs_of[x.user] = jobs_of.get(x.user, 0) + 1
    ranked = sorted(jobs_of.values(), reverse=True)
    assert 40 <= len(ranked) <= 60 and all(u.startswith("user") for u in jobs_of)  # 60 users, Zipf: a few heavy
    assert 0.15 < ranked[0] / 2000 < 0.35 and sum(ranked[:5]) / 2000 > 0.45


def test_overload_trace_command_and_bad_arguments(tmp_path):
    out = tmp_path / "t.csv"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.overload_trace", str(out), "--jobs", "50", "--days", "1"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert len(out.read_text().splitlines()) == 51
    proc = subprocess.run([sys.executable, "-m", "benchmarks.overload_trace", str(out), "--load", "0"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "load=0.0" in proc.stderr and "Traceback" not in proc.stderr


def test_a_mixed_cluster_replays_on_its_own_nodes(tmp_path, capsys):
    cluster = Cluster.parse("1x4:A100-40GB, 1x8:H100")
    assert (str(cluster), cluster.total, cluster.nodes, cluster.gpus_per_node) == ("1x4:A100-40GB,1x8:H100", 12, 2, 8)
    gpus = cluster.inventory().discover()
    assert [(g.name, g.memory_total >> 30) for g in gpus] == [("A100-40GB", 40)] * 4 + [("H100", 80)] * 8
    bursts = write(tmp_path, "b.csv", "session_id,start_s,duration_s,num_gpus\na,0,100,8\nb,10,50,4\nc,20,10,8\n")
    run = replay(load_trace(bursts), cluster, mode="lease", idle=0)
    waits = {o.arrival - run.outcomes[0].arrival: o.wait for o in run.outcomes}
    assert waits == {0: 0, 10: 0, 20: 80}  # the 4-GPU cell fits the A100 node; the second 8 waits for the H100s
    assert replay_main([str(bursts), "--cluster", "1x4:A100-40GB,1x8:H100", "--idle", "1m"]) == 0
    assert "1x4:A100-40GB,1x8:H100" in capsys.readouterr().out
    with pytest.raises(ValueError, match="NODESxGPUS"):
        Cluster.parse("2x8:")


# ---------------------------------------------------------------- start estimates against real waits
@pytest.fixture
def one_waits(tmp_path):
    """Two sessions on one GPU: b's burst arrives while a's runs, and waits for a's lease to end."""
    bursts = write(tmp_path, "b.csv", "session_id,start_s,duration_s,num_gpus\na,0,100,1\nb,50,10,1\n")
    return load_trace(bursts)


def test_score_of_estimates_against_waits():
    # no estimate: a miss; 10 s for 20 s: both under the 30 s floor, exact; a third: out; 5/3: in
    s = score([(None, 100.0), (10.0, 20.0), (100.0, 300.0), (500.0, 300.0)])
    assert s["n"] == 4 and s["with_estimate"] == 3
    assert s["within_2x"] == 0.5 and s["under_half"] == 0.25
    assert s["median_ratio"] == 1.0


def test_replay_scores_the_estimate_each_queued_request_was_told(one_waits):
    # a's lease lingers its whole idle timeout while b waits: the pressure idle timeout off
    calm = LeasePolicy(config=Config(LeasePolicy=Config(pressure_idle_timeout_seconds=0)))
    assert replay(one_waits, Cluster(1, 1), calm, mode="lease", idle=600).told == []  # not asked: no cost
    run = replay(one_waits, Cluster(1, 1), calm, mode="lease", idle=600, estimates=True)
    (told,) = run.told  # b queued; a was granted at once
    assert told.lease.user == "b" and told.lease.created_at == told.lease.granted_at - 650  # a: 100 + 600 idle
    assert told.planned == told.lease.created_at + 710  # a's time limit: burst + idle + 60 s slack
    assert told.low is not None and told.low <= told.shown <= told.high
    a = summarize(run)["estimates"]
    assert a["queued"] == a["granted"] == 1
    assert a["time_limit"]["within_2x"] == 1.0 and a["time_limit"]["median_ratio"] == pytest.approx(710 / 650)
    assert a["estimate"]["with_estimate"] == 1  # a ran no cell before: the Lindy guess, about a minute
    assert a["estimate"]["median_ratio"] == pytest.approx((told.shown - told.lease.created_at) / 650)


def test_coverage_counts_the_real_waits_inside_the_words_shown_and_their_width():
    """The range as users read it: the words (rounded outward) hold the real wait or not; the width is the
    words' upper end over their lower end, each floored at 30 s."""
    def told(low, high, wait):
        lease = Lease(id="x", user="u", uid=1, request=LeaseRequest(), state=LeaseState.QUEUED, created_at=0.0)
        lease.granted_at = wait
        return Told(lease, low, low, high, None)

    a = accuracy([
        told(70.0, 170.0, 175.0),  # "in 1–3 min": the words hold 175 s, though the range does not
        told(0.0, 250.0, 20.0),  # "within 5 min": 20 s, floored to 30
        told(600.0, 900.0, 2000.0),  # "in 10–15 min": far later, out
        told(600.0, 900.0, 300.0),  # too early: out
    ])
    assert a["with_range"] == 4
    assert a["in_words"] == 0.5 and a["in_range"] == 0.25
    assert a["words_width"] == pytest.approx(statistics.median([180 / 60, 300 / 30, 900 / 600, 900 / 600]))


def test_replay_coverage_of_the_shown_range(one_waits):
    """On a small replay: b queues while a's first cell runs (no history: the Lindy guess, widened, "within
    6 min"). With the default pressure idle timeout a's lease ends a minute after its cell and the words hold b's
    wait; with it off, a's lease lingers its 10 min idle timeout, which no holder model foresaw: a miss."""
    calm = LeasePolicy(config=Config(LeasePolicy=Config(pressure_idle_timeout_seconds=0)))
    pressed = summarize(replay(one_waits, Cluster(1, 1), mode="lease", idle=600, estimates=True))["estimates"]
    lingered = summarize(replay(one_waits, Cluster(1, 1), calm, mode="lease", idle=600, estimates=True))["estimates"]
    assert pressed["with_range"] == lingered["with_range"] == 1
    assert pressed["in_words"] == 1.0 and lingered["in_words"] == 0.0
    assert 100.0 > pressed["words_width"] > 1.0  # a range, not "any time"


def test_replay_limits_default_asks_for_the_policy_default(one_waits):
    run = replay(one_waits, Cluster(1, 1), mode="lease", idle=600, limits="default", estimates=True)
    (told,) = run.told
    assert told.planned == told.lease.created_at - 50 + 3600  # a asked for 1 h, the policy default
    assert summarize(run)["limits"] == "default"
    with pytest.raises(ValueError, match="Unknown limits"):
        replay(one_waits, Cluster(1, 1), mode="lease", idle=600, limits="guess")


def test_replay_cli_reports_the_estimates(tmp_path, capsys):
    bursts = write(tmp_path, "b.csv", "session_id,start_s,duration_s,num_gpus\na,0,100,1\nb,50,10,1\n")
    assert replay_main([str(bursts), "--cluster", "1x1", "--limits", "default", "--baseline", "none"]) == 0
    out = capsys.readouterr().out
    assert "start estimates" in out and "1 requests that queued" in out
    assert "time-limit plan" in out and "0% within 2x" in out  # 1 h against a 650 s wait
