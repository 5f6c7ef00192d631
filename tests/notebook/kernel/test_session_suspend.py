"""Suspended sessions and cells, end to end: a real broker (simulated inventory), real kernels, real workers. A
``%%gpu --session`` lease the broker would revoke for idleness is suspended instead (its worker's processes
stopped, SIGSTOP on this CPU-only host; its GPU given to others); the session's next cell gets a GPU again and
resumes it with every variable intact, unpicklable ones included. A running cell asked to suspend for a waiting
request (``preempt_mode = "suspend"``) is resumed when its GPUs are free again and finishes with its result."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_cuda import FakeCuda, compiler
from fake_nvml import FakeNvml, FakeProc
from kernels import Kernel, Reply
from waiting import largest_anonymous_rss, process_alive, wait_for

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
    """``stage(gpus, *broker_args, env=..., broker_env=...)``: a real broker (fast ticks) and a real kernel on it that
    beats often (``env``: more of the kernel's environment, e.g. a fake libcuda), as (kernel, client); the session ``m`` is
    stopped and both are closed after the test."""
    made: list[tuple[Kernel, BrokerClient]] = []

    def make(gpus: int = 1, *args: str, env: dict[str, str] | None = None,
             broker_env: dict[str, str] | None = None) -> tuple[Kernel, BrokerClient]:
        b = broker_factory(gpus=gpus, args=["--tick=0.1", *args], name=f"broker{len(made)}", env=broker_env)
        k = Kernel(b.url, str(tmp_path / "art"), env, log=str(tmp_path / f"kernel{len(made)}.log"))
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
def test_with_the_fake_libcuda_a_session_is_checkpointed_and_restored_on_another_gpu(stage, tmp_path: Path) -> None:
    fake = FakeCuda(tmp_path / "cuda")
    k, c = stage(2, env=fake.env())
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


def _region_session(stage, tmp_path: Path, memory: int, broker_args: tuple[str, ...] = (),  # type: ignore[no-untyped-def]
                    kernel_config: tuple[str, ...] = (), mig: bool = False) -> tuple[Any, ...]:
    """A session ``m`` (idle timeout 6 s) whose worker the fake NVML reports holding ``memory`` bytes of GPU memory
    before its first cell ends (so before any idle warning can read NVML), on a host the fake libcuda makes
    checkpoint-capable: (kernel, client, fake libcuda, worker pid, lease id, the region's size). ``mig``: the
    broker on the NVML inventory, its one GPU in MIG mode with one slice, the worker on that slice."""
    from jupyter_gpulease.worker import ckpt_pool

    fake, nvml = FakeCuda(tmp_path / "cuda"), FakeNvml.standard(tmp_path / "nvml.state", n=1)
    if mig:
        nvml.split(0, [("3g.40gb", 40 << 30)])
        broker_args = ("--inventory=nvml", "--LeaseBroker.sample_seconds=0.2", *broker_args)
    k, c = stage(1, "--LeasePolicy.warn_before_seconds=1", "--LeasePolicy.suspend_idle=True", *broker_args,
                 env={**fake.env(), **nvml.env(), "XDG_CACHE_HOME": str(tmp_path / "cache")},
                 broker_env=nvml.env() if mig else None)
    for line in kernel_config:
        assert k.run(line).status == "ok"
    go = tmp_path / "go"
    msg = k.submit("%%gpu --session m --idle 6s\nimport ctypes, os, time\n"
                   "assert ctypes.CDLL(os.environ['GPULEASE_LIBCUDA']).cuInit(0) == 0\nx = 41\n"
                   f"print(os.getpid(), flush=True)\nwhile not os.path.exists({str(go)!r}):\n    time.sleep(0.02)")
    first = k.collect(msg, 60, until=lambda outs: _printed(Reply("partial", outs)).strip())
    pid = int(_printed(first).split()[0])
    nvml.procs = [FakeProc(gpu=0, pid=pid, memory=memory, mig=0 if mig else -1)]
    nvml.write()
    go.touch()
    r1 = k.collect(msg, 60)
    assert r1.status == "ok", r1.outputs
    return k, c, fake, pid, _lease_of(c, "session", "m")["id"], memory + ckpt_pool.MARGIN


def _region_state(k: Kernel, c: BrokerClient, fake: FakeCuda, pid: int, lease_id: str) -> str:
    """What a failed region check shows: the worker, the fake driver's state, the lease, the kernel's log lines."""
    return (f"worker {_proc_state(pid)}, largest anonymous RSS {largest_anonymous_rss(pid)}, fake driver "
            f"{fake.state(pid)}, lease {c.lease(lease_id).raw}, kernel log {k.log_lines('gpulease: session')}")


@pytest.mark.skipif(compiler() is None, reason="no C compiler (gcc or $CC) to build the fake libcuda and the region's "
                                               "library")
def test_an_idle_session_faults_in_its_checkpoint_region_at_the_warning_before_the_ask(stage, tmp_path: Path) -> None:
    """The kernel, warned that the session will be suspended for idleness, has the worker fault in a region of its
    GPU footprint (NVML's, here the fake's: 64 MiB, plus the margin) before the broker asks; the worker gives it back
    at the session's next job. The driver's checkpoint that would write into it is the fake's (it copies nothing)."""
    k, c, fake, pid, lease_id, want = _region_session(stage, tmp_path, 64 << 20)
    assert largest_anonymous_rss(pid) < want
    try:
        wait_for(lambda: largest_anonymous_rss(pid) >= want, 20, "the worker's checkpoint region, faulted in at the "
                                                                "warning")
    except AssertionError as e:
        raise AssertionError(f"{e}: {_region_state(k, c, fake, pid, lease_id)}") from None
    view = c.lease(lease_id)
    assert view.get("phase") == "holding" and view.get("suspend") is None, view.raw  # before the broker's ask
    _phase(c, lease_id, "suspended")
    assert fake.state(pid) == "CHECKPOINTED"
    r2 = k.run("%%gpu --session m\nprint(x + 1)")
    assert r2.status == "ok" and _printed(r2).split() == ["42"], r2.outputs
    wait_for(lambda: largest_anonymous_rss(pid) < want, 10, "the region given back at the session's next job")


@pytest.mark.skipif(compiler() is None, reason="no C compiler (gcc or $CC) to build the fake libcuda and the region's "
                                               "library")
def test_an_ask_that_comes_while_the_region_is_faulted_in_waits_for_it(stage, tmp_path: Path) -> None:
    """The idle warning 0.5 s before the broker's ask and a 3 GiB region (seconds to fault in here): the ask comes
    while the worker faults the region in. (The worker's CPU time is not activity here, as on a whole GPU, where
    the broker reads GPU utilisation: its faulting-in does not put the ask off.) The suspension waits for the
    worker's answer (it used to stop the worker before it answered: the warning's thread then held the session for
    a minute, and the next cell waited for it) and checkpoints a worker whose region is whole; the next cell runs at
    once and the region is given back."""
    k, c, fake, pid, lease_id, want = _region_session(
        stage, tmp_path, 3 << 30, ("--SimulatedInventory.activity_cpu_seconds=1000",),
        ("%config GpuMagics.idle_warning_seconds = 0.5",))
    _phase(c, lease_id, "suspended")
    assert fake.state(pid) == "CHECKPOINTED" and _proc_state(pid) == "T"
    assert largest_anonymous_rss(pid) >= want, _region_state(k, c, fake, pid, lease_id)
    r2 = k.run("%%gpu --session m\nprint(x + 1)", timeout=30)
    assert r2.status == "ok" and _printed(r2).split() == ["42"], r2.outputs
    assert not k.log_lines("gpulease: session 'm'"), k.log_lines("gpulease: session 'm'")
    wait_for(lambda: largest_anonymous_rss(pid) < want, 10, "the region given back at the session's next job")


@pytest.mark.skipif(compiler() is None, reason="no C compiler (gcc or $CC) to build the fake libcuda and the region's "
                                               "library")
def test_a_cell_that_comes_while_the_region_is_faulted_in_says_what_it_waits_for(stage, tmp_path: Path) -> None:
    """The region is faulted in on a background thread that holds the session (up to ``POOL_TIMEOUT``, 60 s, for a
    worker that does not answer); a cell that comes meanwhile says so in one line, and runs once the region is there.
    The worker is stopped before the warning, so the kernel's request for the region (bytes waiting on the worker's
    stdin) stays unanswered until the test lets it go on."""
    k, c, fake, pid, lease_id, want = _region_session(stage, tmp_path, 64 << 20)
    # the first cell's end left a message for the worker (memory for its next inputs): read before it is stopped, so
    # that what then waits in its pipe is the region's request (a loaded machine stopped it unread once: the cell
    # came before the warning and waited on the stopped worker, silently)
    wait_for(lambda: _pipes_pending(pid) == 0, 20, "the worker to read what its first cell's end sent it")
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_for(lambda: _pipes_pending(pid) > 0, 20, "the kernel's request for the region, at the idle warning")
        msg = k.submit("%%gpu --session m\nprint(x + 1)")
        waited = k.collect(msg, 30, until=lambda outs: "this cell goes on" in Reply("partial", outs).stderr)
    finally:
        os.kill(pid, signal.SIGCONT)
    line = next(x for x in waited.stderr.splitlines() if "this cell goes on" in x)
    assert line == ("gpulease: session 'm' is getting host memory ready for its suspension (at most 60 s); this cell "
                    "goes on when that is done"), line
    r = k.collect(msg, 30)
    assert r.status == "ok" and _printed(r).split() == ["42"], r.outputs


def _pipes_pending(pid: int) -> int:
    """Bytes waiting in the process's pipes (its jobs' pipe, a dup of its stdin, above all: a stopped worker reads
    nothing; the kernel reads its output at once)."""
    import array
    import fcntl
    import termios

    pending = 0
    for name in os.listdir(f"/proc/{pid}/fd"):
        if not os.readlink(f"/proc/{pid}/fd/{name}").startswith("pipe:"):
            continue
        fd = os.open(f"/proc/{pid}/fd/{name}", os.O_RDONLY | os.O_NONBLOCK)
        try:
            n = array.array("i", [0])
            fcntl.ioctl(fd, termios.FIONREAD, n)
            pending += n[0]
        finally:
            os.close(fd)
    return pending


@pytest.mark.skipif(compiler() is None, reason="no C compiler (gcc or $CC) to build the fake libcuda and the region's "
                                               "library")
def test_a_session_on_a_mig_slice_gets_no_region_and_its_idle_clock_runs_on(stage, tmp_path: Path) -> None:
    """On a MIG slice the driver does not checkpoint (NVIDIA/cuda-checkpoint#42) and the broker counts the lease's
    CPU time as activity (NVML has no utilisation counters for a slice): a region faulted in at the warning would
    be wasted and would put the idle suspension off by a whole timeout. No region is made, and the idle deadline
    the broker shows never moves once the cell has ended (it moved 3 s on when the region was faulted in)."""
    k, c, fake, pid, lease_id, want = _region_session(stage, tmp_path, 256 << 20, mig=True)
    view = c.lease(lease_id)
    assert view.devices[0]["mig"], view.raw
    deadlines: list[float] = []

    def suspended() -> bool:
        v = c.lease(lease_id)
        assert largest_anonymous_rss(pid) < want, _region_state(k, c, fake, pid, lease_id)
        if v.get("idle_deadline"):
            deadlines.append(float(v["idle_deadline"]))
        return v.get("phase") == "suspended"

    wait_for(suspended, 30, f"lease {lease_id} suspended for idleness")
    assert deadlines and max(deadlines) - min(deadlines) < 0.5, deadlines
    r2 = k.run("%%gpu --session m\nprint(x + 1)", timeout=30)
    assert r2.status == "ok" and _printed(r2).split() == ["42"], r2.outputs


def test_the_device_session_check_passes_on_the_simulated_inventory(tmp_path: Path) -> None:
    """scripts/gpu_check_session.py, the end-to-end step of ``make gpu-check`` on a real GPU, with numpy arrays on
    the simulated inventory: the same broker, kernel and steps, so the device run does not find it broken."""
    root = Path(__file__).parents[3]
    r = subprocess.run([sys.executable, str(root / "scripts" / "gpu_check_session.py"), "--out", str(tmp_path),
                        "--inventory", "simulated", "--payload", "cpu", "--tensors", "2", "--tensor-mib", "8",
                        "--idle", "2", "--warn", "1"], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    res = json.loads((tmp_path / "session.json").read_text())
    assert r.returncode == 0 and res["passed"] and not res["errors"], (res, r.stdout[-2000:])
    assert res["idle_suspend"]["suspended"]["why"] == "idle" and res["idle_suspend"]["worker_state"] == "T"
    assert res["by_hand"]["worker_state_suspended"] == "T" and res["by_hand"]["view"]["why"] == "user"
    for row in (res["next_cell"], res["after_hand_resume"]):
        assert row["tensors_differing"] == [] and row["checksums_equal"] and row["lock_held"], row


def test_no_idle_warning_while_the_sessions_cell_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A heartbeat reply whose idle deadline is near while the session's cell runs (the cell's heartbeats count as
    activity; one the load delayed can bring the deadline near): no warning, and the session is not marked warned,
    so the warning (and the checkpoint region faulted in at it) comes once the session is idle."""
    from jupyter_gpulease.executors.local import LocalWorker
    from jupyter_gpulease.kernel.cellrun import LeaseRun
    from jupyter_gpulease.kernel.sessions import Session
    from jupyter_gpulease.lease_view import LeaseView

    class Beats:  # the Heartbeater's interface, without a thread
        def add(self, lease_id, active=True, on_reply=None):  # type: ignore[no-untyped-def]
            pass

    lease = {"id": "l-1", "state": "granted", "phase": "holding", "devices": [], "env": {}}
    run = LeaseRun(None, Beats(), lease, str(tmp_path))  # type: ignore[arg-type]
    run.suspender.enabled = False
    worker = LocalWorker(session=True)
    try:
        s = Session("m", run, worker)
        near = LeaseView.from_json({**lease, "idle_deadline": time.time() + 2})
        s.busy = True
        s.on_heartbeat(near, 3.0, None)
        assert not s.warned and "has been idle" not in capsys.readouterr().err
        s.busy = False
        s.on_heartbeat(near, 3.0, None)
        assert s.warned and "session 'm' has been idle" in capsys.readouterr().err
    finally:
        worker.kill(0)
        worker.close()
