"""Remote cells on Ray that can be interrupted, never freeze the kernel, and end cleanly: a REAL local Ray cluster
(tests/ray_cluster.py), a REAL broker with ``--inventory=ray`` and a REAL kernel (tests/kernels.py).

The kernel runs with ``PYTHONUNBUFFERED=1`` in its own environment (as a kernel started by some launchers does):
the cell must not inherit it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import waiting
from ray_cluster import ray_missing
from remote_fixtures import placed, ray_cell_fixtures

from jupyter_gpulease.client import BrokerClient

pytestmark = [
    pytest.mark.skipif(bool(ray_missing()), reason=ray_missing() or "ray installed"),
    pytest.mark.timeout(600),
]

T = 60.0  # generous: on a busy 2-core machine an actor may take seconds to start

wait_for = functools.partial(waiting.wait_for, timeout=T, interval=0.05)


broker, client, kernel = ray_cell_fixtures("ray-cells", {"PYTHONUNBUFFERED": "1"}, timeout=T)


def _held(client: BrokerClient) -> dict[str, Any]:
    return wait_for(lambda: next((v for v in client.leases() if v["phase"] != "ended"), None), what="the cell's lease")


def _signal_bits(pid: int) -> dict[str, int]:
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("SigBlk", "SigIgn", "SigCgt")):
                name, value = line.split(":")
                fields[name] = int(value.strip(), 16)
    return fields


def test_ray_interrupt_reaches_the_cells_own_except(kernel: Any, client: BrokerClient) -> None:
    msg_id = kernel.submit(
        "%%gpu --grace 20s\nimport os, time\nprint('worker', os.getpid(), flush=True)\n"
        "try:\n    n = 0\n    while True:\n        time.sleep(0.05)\n        n += 1\n"
        "        if n == 3:\n            print('in the loop', flush=True)\n"
        "except KeyboardInterrupt:\n    print('the cell caught it', flush=True)\n    raise\n")
    partial = kernel.collect(msg_id, timeout=T * 2, until=lambda outs: "in the loop" in "".join(
        o["content"].get("text", "") for o in outs))
    pid = int(partial.stdout.split("worker ")[1].split()[0])
    lease = _held(client)
    assert lease["placement"]["kind"] == "ray"
    bits = _signal_bits(pid)  # Ray's actor process has SIGINT ignored and blocked: the worker undid both
    sigint = 1 << (signal.SIGINT - 1)
    assert not bits["SigBlk"] & sigint and not bits["SigIgn"] & sigint and bits["SigCgt"] & sigint, bits
    t0 = time.monotonic()
    kernel.km.interrupt_kernel()
    r = kernel.collect(msg_id, timeout=T)
    answered = time.monotonic() - t0
    # on failure: whether the worker ran the cell's except (its output came), and when the answer came
    assert r.status == "error" and r.error is not None and r.error["ename"] == "KeyboardInterrupt", (
        r.stdout, r.stderr, r.error, f"answered after {answered:.2f} s")
    assert "the cell caught it" in r.stdout  # its own except ran: not killed after the grace period (20 s)
    assert "time.sleep(0.05)" in "\n".join(r.error["traceback"])  # the worker's own traceback
    assert answered < 20, answered
    print(f"ray interrupt answered in {answered * 1000:.0f} ms")
    wait_for(lambda: not waiting.process_alive(pid), what="the worker to exit")
    wait_for(lambda: client.lease(lease["id"])["phase"] == "ended", what="the lease released")


def test_ray_interrupted_wait_loses_nothing_the_relay_was_bringing(client: BrokerClient, tmp_path: Path) -> None:
    """An interrupt that comes while the kernel waits for the actor's ``poll`` (Ray looks for signals once a second
    while ``ray.get`` waits: a wait that long is a loaded machine's) cuts the wait short, but the call runs on in the
    actor and takes what the worker writes next: the cell's answer to the interrupt. It was lost, and the cell ended
    as "The GPU worker exited with status 1" (the project's CI, ``test_ray_interrupt_reaches_the_cells_own_except``).
    The interrupt here is the kernel's own path in this process: SIGALRM with Python's SIGINT handler."""
    from jupyter_gpulease.executors.ray import RayWorker

    view = placed(client, client.request_lease(1, wait=T), T)
    worker = RayWorker(view["placement"], lease_id=view["id"], start_timeout=T, call_timeout=T)
    go, said = tmp_path / "go", []
    try:
        worker.submit({"kind": "cell", "cell_name": "<cell>", "want_value": False,
                       "code": f"import os, time\nwhile not os.path.exists({str(go)!r}):\n    time.sleep(0.01)\n"
                               "print('after the interrupt', flush=True)\n"})
        wait_for(lambda: worker.poll(0.2, said.append, said.append) is None and worker.ready, what="the worker ready")
        before = signal.signal(signal.SIGALRM, signal.default_int_handler)
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.2)
            with pytest.raises(KeyboardInterrupt):
                worker.poll(30.0, said.append, said.append)  # the actor waits up to 30 s for the worker's output
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, before)
        go.touch()  # the cell answers now, while the cut-short call still waits on the actor
        result = wait_for(lambda: worker.poll(0.5, said.append, said.append), what="the cell's result")
        assert result["status"] == "ok", result
        assert "".join(said) == "after the interrupt\n", said
    finally:
        worker.close()
        client.release(view["id"])


def test_ray_stopped_worker_ends_the_cell_within_10_s_and_releases(kernel: Any, client: BrokerClient) -> None:
    msg_id = kernel.submit("%%gpu\nimport os, time\nprint('pids', os.getpid(), os.getppid(), flush=True)\n"
                           "time.sleep(600)\n")
    partial = kernel.collect(msg_id, timeout=T * 2, until=lambda outs: "pids" in "".join(
        o["content"].get("text", "") for o in outs))
    worker, actor = (int(p) for p in partial.stdout.split("pids ")[1].split()[:2])
    lease = _held(client)
    try:
        os.kill(actor, signal.SIGSTOP)  # the actor's process stops answering (a hung actor)
        t0 = time.monotonic()
        r = kernel.collect(msg_id, timeout=T)
        ended = time.monotonic() - t0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(actor, signal.SIGCONT)
    assert r.status == "error" and r.error is not None, r.outputs
    assert "stopped answering" in r.error["evalue"] and "call_timeout" in r.error["evalue"], r.error
    assert "\n" not in r.error["evalue"].strip()  # one line
    assert ended < 10, ended
    print(f"ray stopped actor: cell ended after {ended:.1f} s")
    wait_for(lambda: not waiting.process_alive(actor), what="the actor to be killed")
    wait_for(lambda: not waiting.process_alive(worker), what="the worker to end with its actor")
    wait_for(lambda: client.lease(lease["id"])["phase"] == "ended", what="the lease released")


def test_ray_cell_gets_the_kernels_environment_not_rays(kernel: Any, client: BrokerClient) -> None:
    r = kernel.run("%%gpu --out env\nimport os\nenv = {k: os.environ.get(k) for k in ('PYTHONUNBUFFERED', "
                   "'GPULEASE_LEASE_ID', 'MPLBACKEND')}", timeout=T * 2)
    assert r.status == "ok", r.outputs
    env = eval(kernel.run("env").result or "{}")
    assert env["PYTHONUNBUFFERED"] is None and env["GPULEASE_LEASE_ID"] and env["MPLBACKEND"] == "Agg", env


def test_ray_missing_interpreter_fails_in_one_line_naming_the_node(kernel: Any, client: BrokerClient,
                                                                    tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-python")
    kernel.run(f"%config GpuMagics.worker_python = {missing!r}")
    try:
        r = kernel.run("%%gpu\nprint('never')", timeout=T * 2)
    finally:
        kernel.run("%config GpuMagics.worker_python = ''")
    assert r.status == "error" and r.error is not None, r.outputs
    text = r.error["evalue"]
    assert missing in text and "does not exist on node" in text and "worker_python" in text, r.error
    assert "never" not in r.stdout
    wait_for(lambda: not [v for v in client.leases() if v["phase"] != "ended"], what="the lease released")
