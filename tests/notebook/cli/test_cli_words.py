"""The `gpulease` command in the user's own words, against a real broker: the broker address checked wherever it
comes from, near-miss commands and options, a closed pipe, what `renew` does, the rules that end a CLI lease,
the quota and the broker's words for waits, estimates and ends."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from waiting import wait_for

from jupyter_gpulease.client import LeaseView
from jupyter_gpulease.tables import lease_text

CLI = [sys.executable, "-m", "jupyter_gpulease.cli"]


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env={**os.environ, **(env or {})},
                          timeout=60)


def gpulease(broker, *args: str) -> subprocess.CompletedProcess:
    return run(*args, env={"GPULEASE_BROKER": broker.url})


def test_gpulease_broker_is_checked_as_broker_is_and_broker_goes_after_the_command(broker):
    for bad in ("garbage", "localhost:8888", "https://example.org"):
        r = run("status", env={"GPULEASE_BROKER": bad})
        assert r.returncode == 2 and r.stderr.count("\n") == 1, (bad, r.stderr)
        assert f"GPULEASE_BROKER={bad!r}" in r.stderr and "unix://" in r.stderr and "http://" in r.stderr
        assert "socket path" in r.stderr and "Connection refused" not in r.stderr
    r = run("status", env={"GPULEASE_BROKER": broker.socket})  # a bare socket path is a socket
    assert r.returncode == 0 and "4/4 GPUs free" in r.stdout, r.stderr
    for args in (("status", "--broker", broker.url), ("gpus", f"--broker={broker.socket}"),
                 ("--broker", broker.url, "leases", "--json")):
        r = run(*args, env={"GPULEASE_BROKER": "garbage"})  # --broker wins, wherever it is
        assert r.returncode == 0, (args, r.stderr)
    r = run("status", "--broker", "garbage")
    assert r.returncode == 2 and "--broker='garbage'" in r.stderr and "http://" in r.stderr


def test_output_into_a_closed_pipe_ends_quietly(broker):
    p = subprocess.Popen([*CLI, "status"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "GPULEASE_BROKER": broker.url})
    assert p.stdout is not None and p.stderr is not None
    p.stdout.close()  # as `| head -3` does once it has its lines: every write now fails
    err = p.stderr.read()
    assert p.wait(timeout=60) == 141
    assert "Traceback" not in err and "BrokenPipe" not in err and err == ""


def test_near_miss_commands_name_the_right_one_in_plain_words():
    r = run("usage")
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "'gpulease admin usage'" in r.stderr and "entry point" not in r.stderr and "jupyter_gpulease." not in r.stderr
    assert "'gpulease status'" in run("stauts").stderr
    assert "'gpulease release'" in run("cancel", "l-1").stderr
    assert "entry point" not in run("-h").stdout


def test_a_duration_in_two_words_is_about_time_not_the_top_level_usage(broker):
    r = gpulease(broker, "request", "1", "--time", "5", "minutes")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "--time" in r.stderr and "--time 5m" in r.stderr and "usage: gpulease [-h]" not in r.stderr
    assert json.loads(gpulease(broker, "leases", "--json").stdout) == []  # nothing was asked for
    r = gpulease(broker, "request", "--tiem", "5m")
    assert r.returncode == 2 and "--tiem" in r.stderr and "did you mean --time?" in r.stderr
    assert "usage: gpulease [-h]" not in r.stderr


def test_renew_sets_the_time_left_and_says_so(broker):
    assert "set the time left" in run("renew", "-h").stdout
    lease_id = gpulease(broker, "request", "1", "--time", "10m").stdout.split()[0]
    r = gpulease(broker, "renew", lease_id, "--time", "30m")
    assert r.returncode == 0 and "time left" in r.stdout and "30 min" in r.stdout, r.stdout
    r = gpulease(broker, "renew", lease_id, "--time", "5m")  # less than it has: never shortened
    assert r.returncode == 0 and "unchanged" in r.stdout and "never shortens" in r.stdout, r.stdout


@pytest.mark.parametrize("broker", [["--LeasePolicy.max_duration_seconds=3600"]], indirect=True)
def test_a_renewal_refusal_is_the_brokers_words_in_one_line(broker):
    lease_id = gpulease(broker, "request", "1", "--time", "10m").stdout.split()[0]
    r = gpulease(broker, "renew", lease_id, "--time", "5h")
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    said = json.loads(gpulease(broker, "renew", lease_id, "--time", "5h", "--json").stdout)
    assert r.stderr.strip() == f"gpulease: {said['message']}" and said["status"] == 403


def test_show_of_an_ended_lease_does_not_promise_a_measurement(broker):
    c = broker.client()
    lease = c.request_lease(1, heartbeat=False)
    c.release(lease["id"])
    ended = c.lease(lease["id"])
    out = gpulease(broker, "show", lease["id"]).stdout
    assert "not measured yet" not in out
    if ended.usage and ended.usage.get("peak_memory") is None:
        assert "not measured" in out
    # the same lease still held says it may come
    held = LeaseView.from_json({**ended.raw, "ended_at": None, "state": "granted", "phase": "holding",
                                "usage": {"peak_memory": None, "mean_utilization": None, "samples": 0}})
    assert "not measured yet" in lease_text(held, [])


def test_request_says_the_idle_and_pressure_rules(broker):
    out = gpulease(broker, "request", "1", "--time", "10m", "--idle", "5m").stdout
    assert "time limit 10 min" in out and "gpulease renew" in out
    assert "5 min idle" in out and "60 s idle" in out and "someone waits" in out, out
    assert "attached" in out  # what keeps it from being idle
    queued = gpulease(broker, "request", "4", "--idle", "5m").stdout
    assert "queued (position 1)" in queued and "once granted" in queued


@pytest.mark.parametrize("broker", [["--LeasePolicy.max_gpus_per_user=3"]], indirect=True)
def test_quota_says_what_is_left_in_the_brokers_words(broker):
    gpulease(broker, "request", "1")
    quota = json.loads(gpulease(broker, "quota", "--json").stdout)
    limit = next(x for x in quota["limits"] if x["unit"] == "gpus" and x["limit"] == 3)
    out = gpulease(broker, "quota").stdout
    assert limit["text"] in out
    row = next(line for line in out.splitlines() if line.startswith(limit["text"]))
    assert "1 GPU" in row and "3 GPUs" in row and "2 GPUs" in row  # used, of, left


def test_queue_show_and_leases_say_the_brokers_words(broker):
    holder = json.loads(gpulease(broker, "request", "4", "--time", "10m", "--json").stdout)
    waiting = json.loads(gpulease(broker, "request", "1", "--json").stdout)
    row = wait_for(lambda: (r := json.loads(gpulease(broker, "queue", "--json").stdout)[0]).get("estimate_text")
                   and r, 10, "the estimate (it comes with the broker's next look at the queue)")
    assert row["wait"]["reason"] == "gpus_busy" and row["estimate_text"], row
    table = gpulease(broker, "queue").stdout
    assert row["wait"]["text"] in table and row["estimate_text"] in table
    shown = gpulease(broker, "show", waiting["id"]).stdout
    assert row["estimate_text"] in shown and row["wait"]["text"] in shown
    leases = gpulease(broker, "leases").stdout  # WHY: the broker's words, never the slug
    assert row["wait"]["text"] in leases and "gpus_busy" not in leases, leases
    gpulease(broker, "release", holder["id"])
    ended = json.loads(gpulease(broker, "show", holder["id"], "--json").stdout)
    assert ended["reason_text"] in gpulease(broker, "leases", "--ended", "5").stdout
    assert ended["reason_text"] in gpulease(broker, "show", holder["id"]).stdout


def test_the_user_guide_says_the_rules_a_cli_lease_ends_by(broker):
    from pathlib import Path

    guide = Path(__file__).parents[3].joinpath("docs", "user-guide.md").read_text()
    cli = guide.split("## `gpulease` (command line)", 1)[1].split("\n## ", 1)[0]
    assert "pressure_idle_timeout_seconds" in cli and "gpulease quota" in cli
    out = gpulease(broker, "request", "1", "--time", "10m").stdout.splitlines()
    example = cli.split("l-cd1817bd2cf0 granted\n", 1)[1].split("```", 1)[0].splitlines()
    assert [line.split(":", 1)[0].split(",")[0] for line in out[2:]] == \
        [line.split(":", 1)[0].split(",")[0] for line in example[1:]]  # the guide's lines are the real ones
    assert out[3] == example[2]  # the idle rule word for word (the policy's defaults)


def test_a_queued_request_says_why_it_waits_when_it_queues(broker):
    holder = json.loads(gpulease(broker, "request", "4", "--json").stdout)
    r = gpulease(broker, "request", "1")
    assert "queued (position 1)" in r.stdout
    waiting = r.stdout.split()[0]
    view = json.loads(gpulease(broker, "show", waiting, "--json").stdout)
    assert f"waits: {view['wait']['text']}" in r.stdout and "starts: " in r.stdout, r.stdout
    r = gpulease(broker, "request", "1", "--wait", "1")  # the waiting line too
    assert "queued: position 2, starts: " in r.stderr or "queued: position 2, waits: " in r.stderr, r.stderr
    gpulease(broker, "release", holder["id"])
