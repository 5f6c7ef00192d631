"""The `gpulease` command against a real broker."""

from __future__ import annotations

import json
import os
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
    assert r.returncode == 1 and r.stderr.strip().startswith("gpulease: No lease 'l-nope'")
    r = gpulease(broker, "request", "0", check=False)
    assert r.returncode == 1 and "Invalid gpus 0" in r.stderr
    env = {**os.environ, "GPULEASE_BROKER": f"unix://{tmp_path}/none.sock"}
    r = subprocess.run([sys.executable, "-m", "jupyter_gpulease.cli", "status"], capture_output=True, text=True, env=env)
    assert r.returncode == 1 and "lease-broker --inventory=simulated" in r.stderr
