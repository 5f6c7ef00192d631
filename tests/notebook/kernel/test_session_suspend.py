"""Suspended sessions and cells, end to end: a real broker (simulated inventory), real kernels, real workers. A
``%%gpu --session`` lease the broker would revoke for idleness is suspended instead (its worker's processes
stopped, SIGSTOP on this CPU-only host; its GPU given to others); the session's next cell gets a GPU again and
resumes it with every variable intact, unpicklable ones included. A running cell asked to suspend for a waiting
request (``preempt_mode = "suspend"``) is resumed when its GPUs are free again and finishes with its result."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_cuda import FakeCuda, compiler
from kernels import Kernel
from waiting import process_alive, wait_for

from jupyter_gpulease.client import BrokerClient

SETUP = ("%%gpu --session m{opts}\nimport os, threading\ngen = (i * i for i in range(10))\nnext(gen)\n"
         "lock = threading.Lock()\nlock.acquire()\nf = open(os.devnull)\nbig = bytearray(8 << 20)\nprint(os.getpid())")
CHECK = "%%gpu --session m\nprint(os.getpid(), next(gen), lock.locked(), f.closed, len(big))"


def _printed(r) -> str:  # type: ignore[no-untyped-def]
    """What the cell printed, less gpulease's notes."""
    return "".join(line for line in r.stdout.splitlines(keepends=True) if not line.startswith("gpulease: "))


def _proc_state(pid: int) -> str:
    """The process's state letter (/proc/PID/stat): T while stopped."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


@pytest.fixture
def stage(broker_factory, tmp_path: Path) -> Iterator[Any]:
    """``stage(gpus, *broker_args)``: a real broker (fast ticks) and a real kernel on it that beats often, as
    (kernel, client); the session ``m`` is stopped and both are closed after the test."""
    made: list[tuple[Kernel, BrokerClient]] = []

    def make(gpus: int = 1, *args: str) -> tuple[Kernel, BrokerClient]:
        b = broker_factory(gpus=gpus, args=["--tick=0.1", *args], name=f"broker{len(made)}")
        k = Kernel(b.url, str(tmp_path / "art"))
        assert k.run("%config GpuMagics.heartbeat_interval = 0.3").status == "ok"
        made.append((k, b.client()))
        return made[-1]

    yield make
    for k, c in made:
        k.run("%gpu session stop m")
        k.stop()
        c.close()


def _lease_of(client: BrokerClient, label: str, value: str) -> dict[str, Any]:
    return wait_for(lambda: next((x.raw for x in client.leases() if x.labels.get(label) == value), None), 10,
                    f"the lease with label {label}={value}")


def _phase(client: BrokerClient, lease_id: str, phase: str, timeout: float = 20) -> dict[str, Any]:
    def reached() -> dict[str, Any] | None:
        view = client.lease(lease_id)
        return view.raw if view.get("phase") == phase else None

    return wait_for(reached, timeout, f"lease {lease_id} to be {phase}")


def _stray(k: Kernel, text: str) -> list[str]:
    """Output with ``text`` that reached earlier cells (collected while a cell runs: one runs first)."""
    k.run("pass")
    return [m["content"]["text"] for m in k.stray if m["msg_type"] == "stream" and text in m["content"]["text"]]


def test_an_idle_session_is_suspended_its_gpu_serves_another_request_and_its_next_cell_resumes_it(stage) -> None:
    k, c = stage(1, "--LeasePolicy.warn_before_seconds=1", "--LeasePolicy.suspend_idle=True")
    r1 = k.run(SETUP.format(opts=" --idle 2s"))
    assert r1.status == "ok", r1.outputs
    pid = int(_printed(r1).split()[0])
    lease_id = _lease_of(c, "session", "m")["id"]

    view = _phase(c, lease_id, "suspended")
    assert view["suspended"]["why"] == "idle" and view["suspended"]["how"] == "stop"
    wait_for(lambda: _proc_state(pid) == "T", 10, "the session worker to be stopped")
    other = c.request_lease(1, wait=20)  # the one GPU serves another request meanwhile
    assert other.holding, other.raw
    status = k.run("%gpu status")
    assert view["suspended"]["text"] in status.stdout, status.stdout
    assert view["suspended"]["text"] in k.run("%gpu sessions").stdout
    wait_for(lambda: _stray(k, view["suspended"]["text"]), 10, "the suspension's words in the session's last cell")
    c.release(other.id)

    r2 = k.run(CHECK)
    assert r2.status == "ok", r2.outputs
    assert _printed(r2).split() == [str(pid), "1", "True", "False", str(8 << 20)], r2.stdout
    assert view["suspended"]["text"] in r2.stderr  # it says what it resumes, in the broker's words
    after = c.lease(lease_id)
    assert after.holding and after.reason in ("resumed", "active", "idle", "granted"), after.raw
    assert _proc_state(pid) != "T"


def test_suspend_and_resume_by_hand(stage) -> None:
    k, c = stage(1)
    r1 = k.run(SETUP.format(opts=""))
    assert r1.status == "ok", r1.outputs
    pid = int(_printed(r1).split()[0])
    lease_id = _lease_of(c, "session", "m")["id"]

    r = k.run("%gpu session suspend m")
    assert r.status == "ok", r.outputs
    view = c.lease(lease_id)
    assert view.get("phase") == "suspended" and view["suspended"]["why"] == "user", view.raw
    assert view["suspended"]["text"] in r.stdout and _proc_state(pid) == "T"
    assert c.request_lease(1, wait=10).holding  # its GPU is free
    for x in c.leases():
        if x.id != lease_id:
            c.release(x.id)

    r = k.run("%gpu session resume m")
    assert r.status == "ok", r.outputs
    assert c.lease(lease_id).holding and _proc_state(pid) != "T"
    r2 = k.run(CHECK)
    assert r2.status == "ok", r2.outputs
    assert _printed(r2).split()[:3] == [str(pid), "1", "True"], r2.stdout
    assert k.run("%gpu session resume m").error is not None  # not suspended: one line says so


def test_a_session_that_is_not_suspendable_still_parks_by_pickling(stage) -> None:
    k, c = stage(1, "--LeasePolicy.warn_before_seconds=1", "--LeasePolicy.suspend_idle=True")
    assert k.run("%config GpuMagics.suspend_leases = False").status == "ok"
    r1 = k.run("%%gpu --session m --idle 2s\nimport os\nx = 41\nprint(os.getpid())")
    assert r1.status == "ok", r1.outputs
    pid = int(_printed(r1).split()[0])
    lease_id = _lease_of(c, "session", "m")["id"]
    assert "suspendable" not in c.lease(lease_id).raw or not c.lease(lease_id)["suspendable"]
    ended = _phase(c, lease_id, "ended")
    assert ended["state"] == "revoked", ended
    wait_for(lambda: not process_alive(pid), 10, "the session worker to exit (parked)")
    r2 = k.run("%%gpu --session m\nprint(x + 1)")
    assert r2.status == "ok" and _printed(r2).strip() == "42", r2.outputs
    assert "was parked in host memory" in r2.stdout


def test_a_running_cell_asked_to_suspend_for_a_waiting_request_resumes_and_finishes(stage) -> None:
    k, c = stage(1, "--LeasePolicy.preempt_mode=suspend", "--LeasePolicy.suspend_min_runtime_seconds=0")
    msg = k.submit("%%gpu\nimport os, time\nprint(os.getpid(), flush=True)\nt = 0\n"
                   "for _ in range(60):\n    time.sleep(0.1)\n    t += 1\nprint('done', t)")
    lease_id = _lease_of(c, "source", "%%gpu")["id"]
    wait_for(lambda: c.lease(lease_id).pids, 10, "the cell's worker to be attached to its lease")
    t0 = time.monotonic()
    other = c.request_lease(1, wait=30)
    assert other.holding, other.raw
    assert time.monotonic() - t0 < 20
    view = c.lease(lease_id)
    assert view.get("phase") == "suspended" and view["suspended"]["why"] == "preempted", view.raw
    c.release(other.id)
    r = k.collect(msg, timeout=60)
    assert r.status == "ok", r.outputs
    assert "done 60" in r.stdout
    assert view["suspended"]["text"] in r.stderr + r.stdout  # the cell said it was suspended, in the broker's words
    assert "resumed on [" in r.stderr + r.stdout


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc (Linux) to see a stopped process")
def test_the_lease_view_stays_suspended_while_the_kernel_beats(stage) -> None:
    k, c = stage(1)
    assert k.run(SETUP.format(opts="")).status == "ok"
    lease_id = _lease_of(c, "session", "m")["id"]
    assert k.run("%gpu session suspend m").status == "ok"
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:  # heartbeats go on every 0.3 s: a suspended lease is not gone
        assert c.lease(lease_id).get("phase") == "suspended"
        time.sleep(0.2)


@pytest.mark.skipif(compiler() is None, reason="no C compiler (gcc or $CC) to build the fake libcuda")
def test_with_the_fake_libcuda_a_session_is_checkpointed_and_restored_on_another_gpu(broker_factory,
                                                                                      tmp_path: Path) -> None:
    fake = FakeCuda(tmp_path / "cuda")
    b = broker_factory(gpus=2, args=["--tick=0.1"])
    c = b.client()
    k = Kernel(b.url, str(tmp_path / "art"), fake.env())
    try:
        assert k.run("%config GpuMagics.heartbeat_interval = 0.3").status == "ok"
        r1 = k.run("%%gpu --session m\nimport ctypes, os\nassert ctypes.CDLL(os.environ['GPULEASE_LIBCUDA']).cuInit(0) == 0"
                   "\nx = [1, 2, 3]\ngen = iter(range(5))\nprint(os.getpid())")
        assert r1.status == "ok", r1.outputs
        pid = int(_printed(r1).split()[0])
        lease = _lease_of(c, "session", "m")
        old_gpu = lease["devices"][0]["id"]

        assert k.run("%gpu session suspend m").status == "ok"
        view = c.lease(lease["id"])
        assert view["suspended"]["how"] == "checkpoint" and view["suspended"]["devices"] == [old_gpu], view.raw
        assert fake.state(pid) == "CHECKPOINTED" and _proc_state(pid) == "T"
        others = [c.request_lease(1, wait=10) for _ in range(2)]  # both GPUs serve others: its own among them
        keep = next(o for o in others if o.devices[0]["id"] != old_gpu)
        c.release(keep.id)  # the other GPU is free, its own still held

        r2 = k.run("%%gpu --session m\nprint(os.getpid(), x, next(gen))")
        assert r2.status == "ok", r2.outputs
        assert _printed(r2).split() == [str(pid), "[1,", "2,", "3]", "0"], r2.stdout
        after = c.lease(lease["id"])
        assert after.devices[0]["id"] != old_gpu
        assert fake.state(pid) == "RUNNING"
        assert any(call.startswith("restore " + old_gpu) for call in fake.calls(pid)), fake.calls(pid)
    finally:
        k.run("%gpu session stop m")
        k.stop()
        c.close()
