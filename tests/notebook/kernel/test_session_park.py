"""Parked sessions, end to end: a real broker, real kernels, real session workers. When a `%%gpu --session`
lease ends while the session waits (idle, a waiting request's pressure, by hand), its worker parks its variables
in host memory and exits; the next cell of the session gets a GPU and the variables again."""

from __future__ import annotations

import glob
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kernels import Kernel
from waiting import process_alive, wait_for

from jupyter_gpulease.client import BrokerClient
from jupyter_gpulease.wire import transfer
from jupyter_gpulease.worker import park

SETUP = ("%%gpu --session m{opts}\nimport os\nimport numpy as np\nw = np.arange(2_000_000, dtype='f8')\n"
         "view = w\ndef double(x):\n    return 2 * x\nclass Model:\n    def __init__(self):\n        self.steps = 7\n"
         "model = Model()\nprint(os.getpid())")
CHECK = "%%gpu --session m\nprint(os.getpid(), w.sum(), view is w, double(21), model.steps)"
EXPECTED = f"{float(sum(range(2_000_000)))} True 42 7"


def _printed(r) -> str:  # type: ignore[no-untyped-def]
    """What the cell printed, less gpulease's notes (which are in stdout too: they are not errors)."""
    return "".join(line for line in r.stdout.splitlines(keepends=True) if not line.startswith("gpulease: "))


def _parked_files() -> list[str]:
    """Parked states' files: a manifest and its buffers (``.buf``) each."""
    return glob.glob(os.path.join(transfer.shm_dir(), "gpulease-park-*"))



@pytest.fixture
def stage(broker_factory, tmp_path: Path) -> Iterator[Any]:
    """``stage(gpus=1, *broker_args)``: a real broker (fast ticks) and a real kernel on it, as (kernel, client); the
    session ``m`` is stopped and both are closed after the test."""
    made: list[tuple[Kernel, BrokerClient]] = []

    def make(gpus: int = 1, *args: str) -> tuple[Kernel, BrokerClient]:
        b = broker_factory(gpus=gpus, args=["--tick=0.1", *args], name=f"broker{len(made)}")
        made.append((Kernel(b.url, str(tmp_path / "art")), b.client()))
        # parking is the fallback where a session cannot be suspended (test_session_suspend.py suspends)
        assert made[-1][0].run("%config GpuMagics.suspend_leases = False").status == "ok"
        return made[-1]

    yield make
    for k, c in made:
        k.run("%gpu session stop m")
        k.stop()
        c.close()


def _holding(client: BrokerClient) -> list[dict[str, Any]]:
    return [x for x in client.leases() if x["state"] in ("granted", "active", "idle")]


def _ended(client: BrokerClient, lease_id: str) -> dict[str, Any]:
    def ended() -> dict[str, Any] | None:
        lease = client.lease(lease_id)
        return lease if lease["ended_at"] else None

    return wait_for(ended, 20, f"lease {lease_id} to end")  # type: ignore[no-any-return]


def _stray(k: Kernel, text: str) -> list[str]:
    """Output with ``text`` that reached earlier cells (collected while a cell runs: one runs first)."""
    k.run("pass")
    return [m["content"]["text"] for m in k.stray if m["msg_type"] == "stream" and text in m["content"]["text"]]


def test_a_session_revoked_when_idle_is_parked_and_its_next_cell_gets_it_back(stage) -> None:
    k, c = stage(2, "--LeasePolicy.warn_before_seconds=1")
    before = set(_parked_files())
    r1 = k.run(SETUP.format(opts=" --idle 3s"))
    assert r1.status == "ok", r1.outputs
    pid = int(r1.stdout.split()[0])
    lease_id = _holding(c)[0]["id"]
    lease = _ended(c, lease_id)
    assert lease["state"] == "revoked" and lease["reason"] == "idle"
    wait_for(lambda: not process_alive(pid), 10, "the session worker to exit")  # the broker's SIGTERM: it parks, exits
    wait_for(lambda: _stray(k, "variables are parked in host memory ("), 10, "the parked note in the session's last cell")
    assert "its variables are parked in host memory (7 variables" in _stray(k, "variables are parked in host memory (")[0]
    assert "parked (7 variables" in k.run("%gpu sessions").stdout
    assert set(_parked_files()) - before, "the parked state lives in host memory (the shm directory)"

    r2 = k.run(CHECK)
    assert r2.status == "ok", r2.outputs
    new_pid, rest = _printed(r2).split(" ", 1)
    assert int(new_pid) != pid and rest.startswith(EXPECTED), r2.stdout
    assert "was parked in host memory" in r2.stdout and "7 parked variables (15.3 MiB) are back" in r2.stdout
    assert set(_parked_files()) == before, "restored: the parked files are gone"
    assert "alive" in k.run("%gpu sessions").stdout
    assert len(_holding(c)) == 1 and _holding(c)[0]["id"] != lease_id


def test_pressure_takes_an_idle_sessions_gpu_for_a_waiting_request_and_the_session_keeps_its_state(stage) -> None:
    k, c = stage(1, "--LeasePolicy.pressure_idle_timeout_seconds=1")
    r1 = k.run(SETUP.format(opts=" --idle 10m"))
    assert r1.status == "ok", r1.outputs
    session_lease = _holding(c)[0]["id"]
    t0 = time.monotonic()
    waiting = c.request_lease(1, wait=30)  # another user's cell, say: it waits for the one GPU
    assert waiting["state"] == "granted", waiting
    assert time.monotonic() - t0 < 15
    lease = c.lease(session_lease)
    assert lease["state"] == "revoked" and lease["reason"] == "idle_pressure"
    wait_for(lambda: _stray(k, "variables are parked in host memory ("), 10, "the parked note")
    c.release(waiting["id"])
    r2 = k.run(CHECK)
    assert r2.status == "ok", r2.outputs
    assert _printed(r2).split(" ", 1)[1].startswith(EXPECTED), r2.stdout


def test_park_by_hand_gives_the_gpu_back_names_what_cannot_be_kept_and_stop_drops_it(stage) -> None:
    k, c = stage()
    before = set(_parked_files())
    r1 = k.run("%%gpu --session m\nx = 5\nsquares = (i * i for i in range(3))")
    assert r1.status == "ok", r1.outputs
    r = k.run("%gpu session park m")
    assert r.status == "ok", r.outputs
    assert "parked in host memory (1 variable" in r.stdout, r.stdout
    assert "left out (cannot be pickled): squares (TypeError" in r.stdout
    assert _holding(c) == []  # the GPU is free at once
    r2 = k.run("%%gpu\nprint('another cell ran')")  # the one GPU serves other cells meanwhile
    assert "another cell ran" in r2.stdout
    r3 = k.run("%%gpu --session m\nprint(x, 'squares' in dir())")
    assert _printed(r3).startswith("5 False"), r3.outputs
    k.run("%gpu session park m")
    assert set(_parked_files()) - before
    r4 = k.run("%gpu session stop m")
    assert r4.status == "ok", r4.outputs
    assert set(_parked_files()) == before, "a stopped session's parked state is removed"
    r5 = k.run("%gpu session park nope")
    assert r5.status == "error" and "No session 'nope'" in str(r5.outputs)


def test_a_parked_state_that_cannot_be_loaded_fails_the_cell_clearly_and_stays_parked(stage) -> None:
    k, c = stage()
    before = set(_parked_files())
    assert k.run(SETUP.format(opts="")).status == "ok"
    assert k.run("%gpu session park m").status == "ok"
    manifest, buffers = sorted(set(_parked_files()) - before)
    assert buffers == manifest + ".buf" == park.read(manifest)["packed"]["file"]
    os.unlink(buffers)  # the big array's buffers are lost
    r = k.run(CHECK)
    assert r.status == "error"
    assert "RestoreError" in str(r.outputs) and "could not load the session's parked variables" in str(r.outputs)
    assert _holding(c) == [], "the lease taken for the failed restore is released"
    assert "parked (" in k.run("%gpu sessions").stdout, "the state stays parked: the next cell tries again"
    k.run("%gpu session stop m")
    assert set(_parked_files()) == before


def test_a_killed_kernels_parked_state_is_swept_when_a_kernel_of_this_user_starts(stage) -> None:
    import subprocess
    import sys

    import numpy as np

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    shm = transfer.shm_dir()
    orphan = os.path.join(shm, f"gpulease-park-{int(dead.stdout)}-{os.urandom(8).hex()}")
    live = os.path.join(shm, f"gpulease-park-{os.getpid()}-{os.urandom(8).hex()}")  # this process: alive
    try:
        for to in (orphan, live):
            park.park({"w": np.ones(1 << 18)}, shm, to)  # 2 MiB: its buffers go to a file of their own
        assert os.path.exists(orphan + ".buf")
        stage()  # a kernel of this user loads the extension
        wait_for(lambda: not os.path.exists(orphan), 10, "the orphaned parked state to be removed")
        assert not os.path.exists(orphan + ".buf")
        assert os.path.exists(live), "a live kernel's parked state stays"
    finally:
        park.discard(live)
        park.discard(orphan)
