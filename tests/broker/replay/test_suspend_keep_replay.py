"""The replay models kept GPUs (``suspend_keep_gpus``) through the real broker: a gang suspended for a short cell
resumes as soon as that cell ends, and a request that may not suspend others does not take the gang's GPUs."""

from __future__ import annotations

import pytest
from traitlets.config import Config

from lease_broker.policy.lease_policy import LeasePolicy
from lease_broker.replay import Cluster, Suspend, load_trace, replay, summarize


def policy(**conf: object) -> LeasePolicy:
    return LeasePolicy(config=Config(LeasePolicy=Config(**conf)))


@pytest.mark.parametrize("keep", ["off", "small"])
def test_a_gang_suspended_for_a_cell_resumes_when_the_cell_ends(tmp_path, keep):
    # one 4-GPU node: a 4-GPU cell runs 10,000 s from 0; a one-GPU cell of 100 s comes at 1,000 s and suspends it; a
    # 2-GPU cell (too big to suspend anyone) comes at 1,010 s
    bursts = tmp_path / "b.csv"
    bursts.write_text("session_id,start_s,duration_s,num_gpus,gpu_mem_gib\nlong,0,10000,4,10\ncell,1000,100,1,\n"
                      "pair,1010,500,2,\n")
    costs = Suspend(suspend_seconds_per_gib=0.5, resume_seconds_per_gib=0.25, gib_per_gpu=16)
    run = replay(load_trace(bursts), Cluster(1, 4), policy(preempt_mode="suspend", suspend_max_gpus=1,
                                                             suspend_min_runtime_seconds=300, suspend_keep_gpus=keep),
                 idle=0, suspend=costs)
    long, pair, cell = sorted(run.outcomes, key=lambda o: -o.gpus)
    assert long.suspensions == 1 and long.done and cell.wait == 4 * 10 * 0.5  # (the suspend's cost)
    if keep == "off":  # the pair takes two of the GPUs the gang left: the gang waits for it too
        assert pair.wait < cell.duration and long.suspended > 4 * cell.duration
    else:  # the gang's GPUs are kept for it: it resumes when the cell ends; the pair waits for the gang
        assert long.suspended == pytest.approx(cell.duration)
        assert pair.wait > long.duration - cell.arrival
    assert summarize(run)["suspension"]["all_completed"]
