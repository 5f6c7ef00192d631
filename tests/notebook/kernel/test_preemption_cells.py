"""Preemption as a notebook user sees it: a real kernel runs a low-priority `%%gpu` cell on a real broker's only
GPU; a high-priority request arrives. The cell's worker gets SIGUSR1 and the cell prints the warning; a cell that
checkpoints and stops gives the GPU back in time, a cell that ignores it is stopped after the grace and its error
says it was preempted and by which class (not by whom: the user is no admin of this broker)."""

from __future__ import annotations

import functools
import getpass
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import waiting
from broker_process import BrokerProcess
from kernels import Kernel

CELL = (
    "%%gpu --priority low --time 10m\n"
    "import time, jupyter_gpulease\n"
    "print('training', flush=True)\n"
    "for step in range(1200):\n"
    "    if CHECKPOINTS and jupyter_gpulease.preempting():\n"
    "        print('checkpoint saved at step', step)\n"
    "        break\n"
    "    time.sleep(0.05)\n"
)


wait_for = functools.partial(waiting.wait_for, timeout=15.0)


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[tuple[BrokerProcess, Kernel]]:
    b = BrokerProcess(tmp_path / "b", gpus=1, args=["--tick=0.1", "--LeaseBroker.root_is_admin=False",
                                                    f"--LeaseBroker.admin_users=['not-{getpass.getuser()}']"])
    (b.workdir / "lease_broker_config.py").write_text("c.LeasePolicy.preempt_grace_seconds = {'high': 3}\n")
    b.start()
    k = Kernel(b.url, str(tmp_path / "art"))
    try:
        yield b, k
    finally:
        k.stop()
        b.stop()


def _start_low_cell(b: BrokerProcess, k: Kernel, checkpoints: bool) -> tuple[str, dict]:
    assert k.run(f"CHECKPOINTS = {checkpoints}").status == "ok"
    msg_id = k.submit(CELL)
    k.collect(msg_id, until=lambda outs: any("training" in o["content"].get("text", "") for o in outs))
    c = b.client()
    low = wait_for(lambda: next((x for x in c.leases() if x["priority"] == "low" and x["pids"]), None))
    high = c.request_lease(1, priority="high", heartbeat=False)
    assert high["state"] == "queued"
    return msg_id, {"low": low, "high": high}


def test_a_cell_that_checkpoints_gives_the_gpu_back(setup) -> None:  # type: ignore[no-untyped-def]
    b, k = setup
    msg_id, leases = _start_low_cell(b, k, checkpoints=True)
    r = k.collect(msg_id, timeout=30)
    assert r.status == "ok", r.outputs
    assert "preempted" in r.stderr and "higher priority" in r.stderr
    assert "checkpoint saved at step" in r.stdout
    c = b.client()
    # released by the cell (right after its worker exits, off the cell's critical path), within the grace
    low = wait_for(lambda: (x := c.lease(leases["low"]["id"]))["ended_at"] and x)
    assert (low["state"], low["reason"]) == ("released", "released")
    assert wait_for(lambda: c.lease(leases["high"]["id"])["state"] == "granted")


def test_a_cell_that_ignores_the_warning_is_stopped_and_says_by_which_class(setup) -> None:  # type: ignore[no-untyped-def]
    b, k = setup
    msg_id, leases = _start_low_cell(b, k, checkpoints=False)
    r = k.collect(msg_id, timeout=30)
    assert r.error is not None, r.outputs
    assert "being preempted" in r.stderr
    assert r.error["ename"] == "WorkerCrashed"
    assert "preempted" in r.error["evalue"] and "'high'" in r.error["evalue"] and "user" not in r.error["evalue"]
    c = b.client()
    low = c.lease(leases["low"]["id"])
    assert (low["state"], low["reason"], low["preempted_by"]) == ("revoked", "preempted", {"priority": "high"})
    assert wait_for(lambda: c.lease(leases["high"]["id"])["state"] == "granted")


def test_the_heartbeat_brings_the_class_and_the_grace_to_the_cell(tmp_path: Path) -> None:
    from jupyter_gpulease.kernel.cellrun import LeaseRun

    class Beats:  # the Heartbeater's interface, without a thread
        def add(self, lease_id, active=True, on_reply=None):  # type: ignore[no-untyped-def]
            self.on_reply = on_reply

    beats = Beats()
    lease = {"id": "l-1", "state": "granted", "phase": "holding", "devices": [], "env": {}}
    run = LeaseRun(None, beats, lease, str(tmp_path))  # type: ignore[arg-type]
    beats.on_reply({**lease, "preempting": {"by_class": "high", "deadline": time.time() + 60}})
    beats.on_reply({**lease, "preempting": {"by_class": "high", "deadline": time.time() + 50}})  # once only
    notes = run.take_notices()
    assert len(notes) == 1 and all(w in notes[0] for w in ("preempted", "'high'", "checkpoint"))
    assert run.take_notices() == []
