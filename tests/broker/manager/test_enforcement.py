"""Enforcement with a real broker process: idle revocation from the simulated inventory's CPU
activity, and processes that use a GPU without a lease (fake NVML driver, real processes)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from broker_process import scrape_metrics
from fake_nvml import FakeNvml, FakeProc
from nvml_helpers import EventLog, Worker, wait_for

NVML_ARGS = ["--inventory=nvml", "--tick=0.1", "--LeaseBroker.sample_seconds=0.2"]


@pytest.fixture
def state(tmp_path: Path) -> FakeNvml:
    return FakeNvml.standard(tmp_path / "nvml.state", 2)


@pytest.fixture
def sleeper():
    procs: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        p = subprocess.Popen(["sleep", "120"])
        procs.append(p)
        return p

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def test_simulated_idle_revocation_follows_cpu_activity(broker_factory, tmp_path: Path) -> None:
    broker = broker_factory(gpus=1, args=["--tick=0.1", "--LeasePolicy.warn_before_seconds=1.5",
                                          "--LeasePolicy.idle_mark_seconds=0.5",
                                          "--SimulatedInventory.activity_cpu_seconds=0.03"])
    c = broker.client()
    events = EventLog(broker.socket)
    try:
        with Worker(tmp_path) as w:
            lease = c.request_lease(1, heartbeat=False, idle_timeout_seconds=3)
            c.attach(lease["id"], w.pid)
            w.busy(True)  # burns CPU: active past the idle timeout
            wait_for(lambda: c.lease(lease["id"])["state"] == "active", timeout=10)
            first = c.lease(lease["id"])["last_activity"]
            wait_for(lambda: c.lease(lease["id"])["last_activity"] > first + 3, timeout=15)
            assert c.lease(lease["id"])["idle_deadline"] is None  # busy: no idle countdown
            assert not events.of("warning")
            w.busy(False)
            assert events.wait("warning", timeout=15, lease_id=lease["id"])["kind"] == "idle"
            got = wait_for(lambda: (x := c.lease(lease["id"]))["state"] == "revoked" and x, timeout=15)
            assert got["reason"] == "idle"
            assert w.proc.wait(5) == -15
    finally:
        events.close()


def test_unleased_process_is_reported_in_events_view_and_metrics(broker_factory, state: FakeNvml, sleeper,
                                                                 tmp_path: Path) -> None:
    broker = broker_factory(args=NVML_ARGS, env=state.env())
    c = broker.client()
    events = EventLog(broker.socket)
    try:
        with Worker(tmp_path) as leased:
            lease = c.request_lease(1, heartbeat=False)
            c.attach(lease["id"], leased.pid)
            held = lease["devices"][0]["index"]
            other = 1 - held
            rogue = sleeper()
            state.procs = [FakeProc(held, leased.pid, 1 << 30), FakeProc(other, rogue.pid, 3 << 30)]
            state.write()
            ev = events.wait("gpu.unleased_process", timeout=10)
            assert (ev["pid"], ev["process_user"], ev["memory"], ev["gpu_id"], ev["action"]) == (
                rogue.pid, "root" if os.geteuid() == 0 else ev["process_user"], 3 << 30, state.gpus[other].uuid, "warn")
            assert len(events.of("gpu.unleased_process")) == 1  # the leased process is not reported
            gpus = {g["index"]: g for g in c.gpus()["gpus"]}
            assert gpus[other]["unleased_processes"] == [{"pid": rogue.pid, "user": ev["process_user"],
                                                          "memory": 3 << 30}]
            assert gpus[held]["unleased_processes"] == []
            text = scrape_metrics(broker.socket)
            assert (f'gpulease_unleased_processes{{gpu="{state.gpus[other].uuid}",index="{other}",'
                    f'user="{ev["process_user"]}"}} 1.0') in text
            assert rogue.poll() is None  # warn only
            # reported once, not at every sample
            wait_for(lambda: "unleased" in broker.log(), timeout=5)
            assert len(events.of("gpu.unleased_process")) == 1
            state.procs = state.procs[:1]
            state.write()
            wait_for(lambda: {g["index"]: g for g in c.gpus()["gpus"]}[other]["unleased_processes"] == [], timeout=10)
    finally:
        events.close()


def test_a_descendant_of_a_leased_process_is_not_unleased(broker_factory, state: FakeNvml) -> None:
    broker = broker_factory(args=NVML_ARGS, env=state.env())
    c = broker.client()
    import sys

    parent = subprocess.Popen([sys.executable, "-c", "import subprocess; p=subprocess.Popen(['sleep','60']);"
                               "print(p.pid, flush=True); p.wait()"], stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        lease = c.request_lease(1, heartbeat=False)
        c.attach(lease["id"], parent.pid)
        idx = lease["devices"][0]["index"]
        state.procs = [FakeProc(idx, child, 1 << 30)]
        state.write()
        wait_for(lambda: c.gpus()["gpus"][idx]["memory_used"] >= 1 << 30, timeout=10)
        wait_for(lambda: "gpulease_unleased_processes" in scrape_metrics(broker.socket), timeout=5)
        assert c.gpus()["gpus"][idx]["unleased_processes"] == []
        assert "unleased process" not in broker.log()
    finally:
        parent.kill()
        parent.wait()


def test_kill_policy_stops_the_unleased_process(broker_factory, state: FakeNvml, sleeper) -> None:
    broker = broker_factory(args=[*NVML_ARGS, "--LeasePolicy.unleased_process_action=kill",
                                  "--LeasePolicy.term_timeout=0.5"], env=state.env())
    c = broker.client()
    events = EventLog(broker.socket)
    try:
        rogue = sleeper()
        state.procs = [FakeProc(0, rogue.pid, 2 << 30)]
        state.write()
        ev = events.wait("gpu.unleased_process", timeout=10, pid=rogue.pid)
        assert ev["action"] == "kill"
        assert rogue.wait(10) == -15
        assert "gpulease_unleased_process_kills_total 1.0" in scrape_metrics(broker.socket)
        assert c.gpus()["gpus"][0]["state"] == "free"
    finally:
        events.close()


def test_users_see_only_the_owner_of_an_unleased_process() -> None:
    from lease_broker.core.identity import Identity
    from lease_broker.manager.gpuwatch import GpuWatch

    watch = GpuWatch.__new__(GpuWatch)
    watch.unleased = {"GPU-x": {42: {"pid": 42, "user": "bob", "uid": 1001, "memory": 1 << 30, "gpu_id": "GPU-x"}}}
    assert watch.view("GPU-x", Identity("alice", 1000)) == [{"user": "bob"}]
    assert watch.view("GPU-x", Identity("bob", 1001)) == [{"pid": 42, "user": "bob", "memory": 1 << 30}]
    assert watch.view("GPU-x", Identity("root", 0, admin=True)) == [{"pid": 42, "user": "bob", "memory": 1 << 30}]
    assert watch.view("GPU-y", Identity("alice", 1000)) == []


def test_a_waiting_request_gets_the_gpu_of_an_idle_lease_after_the_pressure_timeout(broker_factory) -> None:
    """A real broker: the holder is idle (no process, no activity) with a 10-minute idle timeout of its own; a
    second request arrives and, with pressure_idle_timeout_seconds=2, gets the GPU seconds later, the holder warned
    first."""
    broker = broker_factory(gpus=1, args=["--tick=0.1", "--LeasePolicy.pressure_idle_timeout_seconds=2",
                                          "--LeasePolicy.warn_before_seconds=1", "--LeasePolicy.idle_mark_seconds=0.2"])
    c = broker.client()
    events = EventLog(broker.socket)
    try:
        idle = c.request_lease(1, heartbeat=False, idle_timeout_seconds=600)
        waiting = c.request_lease(1, heartbeat=False)
        assert waiting["state"] == "queued"
        got = c.lease(waiting["id"], wait=30)
        assert got["state"] == "granted" and got["devices"] == idle["devices"]
        ended = c.lease(idle["id"])
        assert ended["state"] == "revoked" and ended["reason"] == "idle_pressure"
        warning = events.wait("warning", timeout=5, lease_id=idle["id"])
        assert warning["kind"] == "idle" and warning["deadline"] <= ended["ended_at"]
        assert ended["ended_at"] - ended["granted_at"] < 30  # not its own 10 minutes
    finally:
        events.close()
