"""Errors and notes of `%%gpu` in the user's own words (issue 35), in real kernels against a real broker: an
unpicklable value named, notes that are not errors, ``UsageError`` only for the magic's arguments, a misspelt option
answered with the right one, ``%gpu jobs`` naming a running job's lease."""

from __future__ import annotations

from pathlib import Path

import pytest
from kernels import Kernel
from waiting import wait_for


def test_an_unpicklable_out_names_the_variable_and_the_cell_did_not_fail(kernel: Kernel) -> None:
    r = kernel.run("%%gpu 1 --out lock,n\nimport threading\nn = 3\nlock = threading.Lock()\nprint('done')")
    assert r.error is not None and r.error["ename"] == "TransferError", r.outputs
    assert "--out lock" in r.error["evalue"] and "_thread.lock" in r.error["evalue"], r.error
    assert "builtins.dict" not in r.error["evalue"] and "outputs" not in r.error["evalue"]
    assert len(r.error["traceback"]) == 1, r.error["traceback"]  # one line, not the library's frames
    assert "done" in r.stdout
    summary = next(line for line in r.stdout.splitlines() if line.startswith("gpulease: lease "))
    assert "results not brought back" in summary and "failed" not in summary, summary


def test_an_unpicklable_in_names_the_variable_in_one_line(kernel: Kernel) -> None:
    kernel.run("import threading\nmy_lock = threading.Lock()")
    r = kernel.run("%%gpu --in my_lock\nprint('the cell ran')")
    assert r.error is not None and r.error["ename"] == "TransferError", r.outputs
    assert "'my_lock'" in r.error["evalue"] and "_thread.lock" in r.error["evalue"], r.error
    assert len(r.error["traceback"]) == 1, r.error["traceback"]
    assert "the cell ran" not in r.stdout


def test_comprehension_variables_are_not_called_undefined(kernel: Kernel) -> None:
    kernel.run("xs = [1, 2]\nd = {'a': 1}")
    r = kernel.run("%%gpu\nprint([x * i for i in range(2) for x in xs], {k: v for k, v in d.items()},\n"
                   "      sum(j for j in range(4)), [[c for c in row] for row in ['ab']])")
    assert r.status == "ok", r.outputs
    assert "not defined" not in r.stdout + r.stderr, r.stdout + r.stderr
    assert "[0, 0, 1, 2] {'a': 1} 6 [['a', 'b']]" in r.stdout


def test_notes_are_not_written_as_errors(kernel: Kernel) -> None:
    kernel.run("api_token = 'x'")
    r = kernel.run("%%gpu\ntry:\n    api_token\nexcept NameError:\n    print('not sent')\nprint(undefined_too)")
    assert "api_token (looks like a secret" in r.stdout
    assert "undefined_too" in r.stdout and "not defined in the kernel" in r.stdout
    assert "gpulease:" not in r.stderr, r.stderr  # stderr shows pink in a notebook: errors only


def test_a_misspelt_option_names_the_magic_and_suggests_the_option(kernel: Kernel) -> None:
    r = kernel.run("%%gpu 1 --tiem 5m\nprint('ran')")
    assert r.error is not None and r.error["ename"] == "UsageError"
    assert r.error["evalue"].startswith("%%gpu: ") and "--tiem" in r.error["evalue"], r.error
    assert "did you mean --time?" in r.error["evalue"], r.error
    assert "ran" not in r.stdout


def test_a_wait_timeout_and_a_cancel_from_elsewhere_are_not_usage_errors(broker_factory, kernel_factory) -> None:
    b = broker_factory(gpus=1, args=["--tick=0.1"], name="full")
    c = b.client()
    held = c.request_lease(1, heartbeat=False)
    k = kernel_factory(b.url)
    r = k.run("%%gpu 1 --wait 1s\nprint('ran')")
    assert r.error is not None and r.error["ename"] == "LeaseUnavailable", r.error
    assert "--wait 1 s" in r.error["evalue"], r.error
    assert len(r.error["traceback"]) == 1 and "ran" not in r.stdout

    msg_id = k.submit("%%gpu 1\nprint('ran')")
    queued = wait_for(lambda: c.queue(), 10, "the request to queue")
    c.release(queued[0]["lease_id"], "cancelled")  # as the sidebar's Cancel does
    r = k.collect(msg_id)
    assert r.error is not None and r.error["ename"] == "LeaseUnavailable", r.error
    assert "ended while queued" in r.error["evalue"] and len(r.error["traceback"]) == 1, r.error
    words = c.lease(queued[0]["lease_id"])["reason_text"]
    assert r.error["evalue"].endswith(f"ended while queued: {words}"), r.error  # the broker's words, not a slug
    assert "(cancelled)" not in r.error["evalue"]
    c.release(held["id"])


def test_a_broker_that_is_down_is_not_a_usage_error(kernel_factory, tmp_path: Path) -> None:
    k = kernel_factory(f"unix://{tmp_path}/no-broker.sock")
    r = k.run("%%gpu\nprint('ran')")
    assert r.error is not None and r.error["ename"] == "BrokerUnreachable", r.error
    assert "No GPU lease broker answers" in r.error["evalue"] and len(r.error["traceback"]) == 1, r.error
    r = k.run("%gpu status")
    assert r.error is not None and r.error["ename"] == "BrokerUnreachable", r.error


def test_jobs_shows_the_lease_of_a_running_background_job(kernel: Kernel, client, tmp_path: Path) -> None:
    go = tmp_path / "go"
    msg_id = kernel.submit(f"%%gpu --bg j1\nimport os, time\nwhile not os.path.exists({str(go)!r}):\n"
                           "    time.sleep(0.05)\nprint('bg done')")
    kernel.collect(msg_id)
    lease_id = wait_for(lambda: [x["id"] for x in client.leases() if x["state"] in ("granted", "active", "idle")],
                        10, "the job's lease")[0]

    def row() -> list[str] | None:
        lines = [line.split() for line in kernel.run("%gpu jobs").stdout.splitlines()]
        mine = [words for words in lines if words and words[0] == "j1" and words[1] == "running"]
        return mine[0] if mine and mine[0][2] != "-" else None

    assert wait_for(row, 10, "%gpu jobs to show the running job's lease")[2] == lease_id
    go.touch()
    wait_for(lambda: "done" in kernel.run("%gpu jobs").stdout, 10, "the job to end")


@pytest.mark.parametrize("broker", [["--LeasePolicy.max_gpus_per_user=3"]], indirect=True)
def test_gpu_quota_says_what_is_left(kernel: Kernel, client) -> None:
    client.request_lease(1, heartbeat=False)
    limit = next(x for x in client.quota()["limits"] if x["unit"] == "gpus" and x["limit"] == 3)
    r = kernel.run("%gpu quota")
    assert r.status == "ok", r.outputs
    row = next(line for line in r.stdout.splitlines() if line.startswith(limit["text"]))
    assert "1 GPU" in row and "3 GPUs" in row and "2 GPUs" in row, row  # used, of, left


def test_the_waiting_line_says_why_in_the_brokers_words(broker_factory, capsys) -> None:
    """A cell queued behind a busy GPU shows the broker's ``wait.text`` (outside a notebook: the text line)."""
    from jupyter_gpulease.kernel.acquire import LeaseUnavailable, acquire

    b = broker_factory(gpus=1, args=["--tick=0.1"], name="busy")
    c = b.client()
    held = c.request_lease(1, heartbeat=False, duration_seconds=600)
    with pytest.raises(LeaseUnavailable):
        acquire(c, {"gpus": 1, "heartbeat": False}, 1.5, "%%gpu 1")
    line = capsys.readouterr().err
    assert "queued, position 1" in line, line
    assert "expected to end" in line, line  # why: the holder of the GPU, and when it is expected to end
    assert "estimated start " in line, line  # the broker's estimate_text
    c.release(held["id"])
