"""How a `%%gpu` cell ends when it does not simply succeed, as a user sees it in a real kernel against a real broker:
an interrupt while queued, its lease released from elsewhere while it runs, an error in the cell."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from kernels import Kernel
from waiting import wait_for


@pytest.fixture
def kernel_factory(tmp_path: Path) -> Iterator:
    started: list[Kernel] = []

    def make(broker) -> Kernel:  # type: ignore[no-untyped-def]
        k = Kernel(broker.url, str(tmp_path / "artifacts"))
        started.append(k)
        return k

    yield make
    for k in started:
        k.stop()


def test_interrupt_while_queued_says_cancelled_in_one_line(broker_factory, kernel_factory) -> None:
    b = broker_factory(gpus=1, args=["--tick=0.1"], name="q")
    c = b.client()
    held = c.request_lease(1, heartbeat=False)
    k = kernel_factory(b)
    msg_id = k.submit("%%gpu\nprint('never')")
    k.wait_queued(msg_id)  # the cell is in its wait loop (an HTTP long poll)
    queued = c.queue()
    k.km.interrupt_kernel()
    r = k.collect(msg_id)
    assert r.status == "error" and r.error is not None  # still an interrupt: Run All stops here
    assert r.error["ename"] == "KeyboardInterrupt"
    tb = "\n".join(r.error["traceback"])
    assert tb.startswith("%%gpu: ") and "cancelled" in tb and "position 1" in tb, tb
    assert len(r.error["traceback"]) == 1
    everything = tb + r.stdout + r.stderr
    assert "http.client" not in everything and "socket" not in everything and "Traceback" not in everything
    assert c.queue() == [], (r.stdout, r.stderr)  # the cell withdrew its request before it answered
    assert c.lease(queued[0]["lease_id"])["state"] == "cancelled"
    assert k.run("print('still usable')").stdout == "still usable\n"
    c.release(held["id"])


def test_lease_released_from_elsewhere_stops_the_cell_and_says_by_whom(broker, kernel_factory) -> None:
    k = kernel_factory(broker)
    msg_id = k.submit("%%gpu\nimport time\nprint('training', flush=True)\ntime.sleep(600)")
    k.collect(msg_id, until=lambda outs: any("training" in o["content"].get("text", "") for o in outs))
    c = broker.client()
    lease = wait_for(lambda: next((x for x in c.leases() if x["pids"]), None), 10, "the worker to be attached")
    env = {"GPULEASE_BROKER": broker.url, "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-m", "jupyter_gpulease.cli", "release", lease["id"]], check=True, env=env,
                   capture_output=True, timeout=60)
    r = k.collect(msg_id)
    assert r.status == "error" and r.error is not None
    assert r.error["ename"] == "LeaseEnded", r.error
    line = f"%%gpu: lease {lease['id']} was released by {lease['user']} with gpulease release while the cell ran: " \
           "the cell was stopped"
    assert r.error["traceback"] == [line]
    assert "WorkerCrashed" not in r.stdout + r.stderr and "SIGTERM" not in "\n".join(r.error["traceback"])
    assert c.lease(lease["id"])["state"] == "released"


def test_a_failed_cell_prints_its_summary_and_leaves_a_trail(kernel_factory, broker, tmp_path: Path) -> None:
    k = kernel_factory(broker)
    r = k.run("%%gpu\nprint('before the error')\nx = 1 / 0\n")
    assert r.status == "error" and r.error is not None and r.error["ename"] == "ZeroDivisionError"
    summary = next(line for line in r.stdout.splitlines() if line.startswith("gpulease: lease "))
    lease_id = summary.split()[2]
    assert "1 GPU [" in summary and "failed (ZeroDivisionError) after " in summary and "(simulated)" in summary
    d = tmp_path / "artifacts" / lease_id
    assert f"artifacts {d}" in summary
    wait_for(lambda: (d / "meta.json").exists(), 5, "meta.json")
    meta = json.loads((d / "meta.json").read_text())
    assert meta["status"] == "error"
    assert meta["error"] == {"type": "ZeroDivisionError", "message": "division by zero"}
    log = (d / "output.log").read_text()
    assert log.startswith("before the error\n")
    assert "Traceback (most recent call last)" in log and "x = 1 / 0" in log
    assert log.rstrip().endswith("ZeroDivisionError: division by zero")


def test_interrupting_the_python_apis_wait_cancels_in_one_line(broker_factory, kernel_factory) -> None:
    b = broker_factory(gpus=1, args=["--tick=0.1"], name="api")
    c = b.client()
    held = c.request_lease(1, heartbeat=False)
    k = kernel_factory(b)
    msg_id = k.submit("import jupyter_gpulease\nwith jupyter_gpulease.lease(1) as held:\n    print('never')")
    k.wait_queued(msg_id)
    queued = c.queue()
    k.km.interrupt_kernel()
    r = k.collect(msg_id)
    assert r.error is not None and r.error["ename"] == "KeyboardInterrupt"
    assert r.error["traceback"][0].startswith("lease(1): ") and "cancelled" in r.error["traceback"][0]
    assert len(r.error["traceback"]) == 1  # one line
    assert c.lease(queued[0]["lease_id"])["state"] == "cancelled"
    c.release(held["id"])


def test_a_bad_broker_address_is_one_line_naming_the_variable(broker, tmp_path: Path) -> None:
    k = Kernel("foo://x", str(tmp_path / "artifacts"))
    try:
        r = k.run("%%gpu\nprint('ran')")
        assert r.error is not None and r.error["ename"] == "UsageError"
        evalue = r.error["evalue"]
        assert evalue.startswith("%%gpu: ") and "GPULEASE_BROKER='foo://x'" in evalue, evalue
        assert "unix:///path/to.sock" in evalue and "http://host:port" in evalue and "\n" not in evalue, evalue
    finally:
        k.stop()


def test_artifact_storage_that_cannot_be_written_does_not_lose_the_cells_result(broker_factory, tmp_path: Path) -> None:
    """The artifact root lies under a regular file (no directory can be made there, even as root): the cell still
    runs, prints and returns its value, and the cell says its log and meta.json could not be saved."""
    b = broker_factory(gpus=1, args=["--tick=0.1"], name="art")
    (tmp_path / "a-file").write_text("not a directory\n")
    k = Kernel(b.url, str(tmp_path / "a-file" / "artifacts"))
    try:
        r = k.run("%%gpu\nprint('hello')\n6 * 7")
        assert r.status == "ok", r.outputs
        assert "hello" in r.stdout and r.result == "42"
        assert "cannot write" in r.stderr and "output.log" in r.stderr
        c = b.client()
        wait_for(lambda: not c.leases(), 10, "the cell's lease to be released")
        seen: list[dict] = list(r.outputs)  # type: ignore[type-arg]

        def noted() -> bool:  # printed where the lease is released: with the cell's output, or just after it
            seen.extend(k.run("pass").outputs)
            return any("could not write artifacts" in m["content"].get("text", "")
                       for m in [*k.stray, *seen] if m["msg_type"] == "stream")

        wait_for(noted, 10, "the note that meta.json was not saved")
    finally:
        k.stop()
