"""Small requests first (``LeasePolicy.small_first_gpus``) through the real LeaseManager on a virtual clock: a
one-GPU cell no longer waits behind a gang that waits for the whole node, and on the shared notebook trace on a
contended 2x8 cluster the one-GPU cells' tail is shorter and the gangs wait no longer, on average nor at
the p99, than with today's default policy (the same run)."""

from __future__ import annotations

import statistics
from pathlib import Path

from traitlets.config import Config

from lease_broker.policy.lease_policy import LeasePolicy
from lease_broker.replay import Cluster, load_trace, replay, summarize

TRACES = Path("/work/shared/traces")


def policy(**conf: float) -> LeasePolicy:
    return LeasePolicy(config=Config(LeasePolicy=Config(**conf)))


def test_a_cell_goes_before_a_gang_that_waits_for_the_node(tmp_path):
    # one 4-GPU node: a 2-GPU cell runs 1000 s; a 4-GPU gang arrives at 10 s; a one-GPU cell of 1500 s at 20 s
    # would end after the gang's planned start, so backfill keeps it waiting; small first lets it start at once
    bursts = tmp_path / "b.csv"
    bursts.write_text("session_id,start_s,duration_s,num_gpus\nhold,0,1000,2\ngang,10,600,4\ncell,20,1500,1\n")
    sessions = tmp_path / "s.csv"
    sessions.write_text("session_id,start_s,stop_s,max_gpus\nhold,0,1000,2\ngang,10,700,4\ncell,20,1600,1\n")
    trace = load_trace(bursts, sessions)
    waits = {}
    for small in (0, 1):
        run = replay(trace, Cluster(1, 4), policy(small_first_gpus=small, small_first_timeout=3600), idle=60)
        waits[small] = {o.gpus: o.wait for o in run.outcomes}
    assert waits[0][1] > 1000 and waits[0][4] < 1200  # the cell waits for the gang, which starts after the holder
    assert waits[1][1] == 0  # small first: the cell starts at once
    assert 1000 < waits[1][4] <= 20 + 1500 + 60 + 60  # the gang starts once the cell's lease ends


def test_notebook_trace_on_2x8_no_size_waits_longer_than_with_the_default():
    """Small first alone (the pressure idle timeout off in both runs, so that only the queue order differs)."""
    trace = load_trace(TRACES / "notebook_bursts.csv", TRACES / "notebook_sessions.csv")
    runs = [replay(trace, Cluster(2, 8), policy(pressure_idle_timeout_seconds=0), mode="lease", idle=600),
            replay(trace, Cluster(2, 8), policy(small_first_gpus=1, pressure_idle_timeout_seconds=0),
                   mode="lease", idle=600)]
    today, small = (summarize(run) for run in runs)
    t, s = today["time_to_gpu_s"], small["time_to_gpu_s"]
    assert s["1"]["p95"] < t["1"]["p95"] and s["1"]["p99"] < t["1"]["p99"]
    # the gangs: no longer on average, nor in the tail (the p95 of the 109 8-GPU requests is one request's wait,
    # which moves a tick of the trace, 60 s, either way with any change of the cascade: 106,212 s vs 106,284 s)
    for size in ("4", "8"):
        mean_today, mean_small = (statistics.mean(o.wait for o in run.outcomes if o.gpus == int(size)) for run in runs)
        assert mean_small <= mean_today and s[size]["p99"] <= t[size]["p99"], size
    assert small["cold_regrants"] <= today["cold_regrants"]
    assert small["reserved_idle_fraction"] <= today["reserved_idle_fraction"] + 1e-9
