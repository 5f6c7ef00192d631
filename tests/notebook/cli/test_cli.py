"""The `gpulease` command against a real broker."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys


def gpulease(broker, *args, check=True):
    env = {**os.environ, "GPULEASE_BROKER": broker.url}
    r = subprocess.run([sys.executable, "-m", "jupyter_gpulease.cli", *args], capture_output=True, text=True,
                       env=env, timeout=60)
    if check:
        assert r.returncode == 0, r.stderr
    return r


def test_status_table_labels_simulated(broker):
    out = gpulease(broker, "status").stdout
    assert "SIMULATED" in out and "4/4 GPUs free" in out
    assert out.count("[sim]") == 4


def test_request_leases_release_cycle(broker):
    lease = json.loads(gpulease(broker, "--json", "request", "2", "--time", "30m").stdout)
    assert lease["state"] == "granted" and len(lease["devices"]) == 2
    assert lease["env"]["CUDA_VISIBLE_DEVICES"].count("GPU-") == 2
    table = gpulease(broker, "leases").stdout
    assert lease["id"] in table and "granted" in table
    queued = gpulease(broker, "request", "3").stdout
    assert "queued (position 1)" in queued
    assert "1" in gpulease(broker, "queue").stdout
    assert "released" in gpulease(broker, "release", lease["id"]).stdout
    shown = json.loads(gpulease(broker, "--json", "show", lease["id"]).stdout)
    assert [h["to"] for h in shown["history"]] == ["queued", "granted", "released"]


def test_errors_are_one_line_and_nonzero(broker, tmp_path):
    r = gpulease(broker, "release", "l-nope", check=False)
    assert r.returncode == 1 and r.stderr.startswith("gpulease: ") and "'l-nope'" in r.stderr
    r = gpulease(broker, "request", "0", check=False)
    assert r.returncode == 1 and "Invalid gpus 0" in r.stderr
    env = {**os.environ, "GPULEASE_BROKER": f"unix://{tmp_path}/none.sock"}
    r = subprocess.run([sys.executable, "-m", "jupyter_gpulease.cli", "status"], capture_output=True, text=True, env=env)
    assert r.returncode == 1 and "lease-broker --inventory=simulated" in r.stderr


def test_json_before_or_after_the_command(broker):
    for args in (("--json", "leases"), ("leases", "--json"), ("gpus", "--json"), ("queue", "--json")):
        r = gpulease(broker, *args)
        assert isinstance(json.loads(r.stdout), (list, dict)), args
    lease = json.loads(gpulease(broker, "request", "1", "--json").stdout)
    assert lease["state"] == "granted"
    shown = json.loads(gpulease(broker, "show", lease["id"], "--json").stdout)
    assert shown["id"] == lease["id"] and shown["history"]
    gpulease(broker, "release", lease["id"], "--json")


def test_gpus_and_show_are_readable_tables(broker):
    out = gpulease(broker, "gpus").stdout
    assert out.splitlines()[0].split()[:3] == ["NODE", "IDX", "NAME"] and out.count("[sim]") == 4
    assert "{" not in out
    lease_id = gpulease(broker, "request", "2", "--time", "30m").stdout.split()[0]
    gpulease(broker, "release", lease_id)
    out = gpulease(broker, "show", lease_id).stdout
    assert "{" not in out and '"' not in out
    assert out.splitlines()[0].split() == ["lease", lease_id]
    assert "released" in out and "time limit" in out and "30 min" in out
    assert "TRANSITION" in out and "queued -> granted" in out and "granted -> released" in out
    requested = next(line for line in out.splitlines() if line.startswith("requested"))
    assert re.fullmatch(r"requested\s+(\w+ )*\d\d:\d\d", requested), requested  # local clock text, not epoch seconds


def test_request_wait_that_times_out_cancels_and_fails(broker):
    held = json.loads(gpulease(broker, "request", "4", "--json").stdout)
    r = gpulease(broker, "request", "1", "--wait", "1", check=False)
    assert r.returncode == 1
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("gpulease: ") and "--wait 1 s" in line and "cancelled" in line and "--queue" in line
    assert "Traceback" not in r.stderr
    assert json.loads(gpulease(broker, "queue", "--json").stdout) == []
    ended = json.loads(gpulease(broker, "leases", "--ended", "5", "--json").stdout)
    assert any(x["state"] == "cancelled" for x in ended)
    r = gpulease(broker, "request", "1", "--wait", "1", "--queue")
    assert "queued (position 1)" in r.stdout
    assert len(json.loads(gpulease(broker, "queue", "--json").stdout)) == 1
    gpulease(broker, "release", held["id"])


def test_user_errors_are_one_line_naming_the_option(broker):
    for args in (("request", "1", "--time=-5m"), ("request", "1", "--time", "-5m"), ("request", "--idle", "-1"),
                 ("request", "--time", "soon")):
        r = gpulease(broker, *args, check=False)
        opt = "--time" if "--time" in " ".join(args) else "--idle"
        assert r.returncode == 1, (args, r.stderr)
        assert r.stderr.count("\n") == 1 and r.stderr.startswith(f"gpulease: Invalid {opt} "), (args, r.stderr)
        assert "duration_seconds" not in r.stderr and "idle_timeout_seconds" not in r.stderr
    r = gpulease(broker, "request", "1", "--time", "-5m", check=False)
    assert "'-5m'" in r.stderr
    env = {**os.environ, "GPULEASE_BROKER": "foo://x"}
    r = subprocess.run([sys.executable, "-m", "jupyter_gpulease.cli", "status"], capture_output=True, text=True,
                       env=env, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "GPULEASE_BROKER='foo://x'" in r.stderr and "unix://" in r.stderr and "http://" in r.stderr


def test_empty_lists_say_so(broker):
    assert gpulease(broker, "leases").stdout.strip() == "No leases."
    assert "empty" in gpulease(broker, "queue").stdout


def test_request_by_gpu_type_and_memory_on_a_mixed_broker(broker_factory):
    broker = broker_factory(args=["--tick=0.1", "--SimulatedInventory.cluster=1x2:A100-40GB,1x2:H100"])
    status = gpulease(broker, "status").stdout
    assert status.count("A100-40GB [sim]") == 2 and status.count("H100 [sim]") == 2 and "40.0 GiB" in status
    h100 = json.loads(gpulease(broker, "--json", "request", "2", "--gpu-type", "H100").stdout)
    assert [d["name"] for d in h100["devices"]] == ["H100", "H100"] and h100["gpu_type"] == "H100"
    big = gpulease(broker, "request", "1", "--gpu-mem", "64G").stdout  # only the H100s have 80G: it waits
    assert "queued (position 1)" in big
    queue = gpulease(broker, "queue").stdout
    assert "1 >=64.0 GiB" in queue  # what it waits for
    r = gpulease(broker, "request", "1", "--gpu-type", "V100", check=False)
    assert r.returncode == 1 and "2x H100 (80G)" in r.stderr and "2x A100-40GB (40G)" in r.stderr
    r = gpulease(broker, "request", "1", "--gpu-mem", "-1G", check=False)
    assert r.returncode == 1 and "Invalid --gpu-mem '-1G'" in r.stderr
