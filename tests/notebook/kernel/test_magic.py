"""%%gpu in real kernels (jupyter_client) against a real broker with a simulated inventory."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from kernels import Kernel
from waiting import process_alive, wait_for

from jupyter_gpulease.wire import transfer


def _wait_ended(client, lease_id: str, timeout: float) -> dict:  # type: ignore[no-untyped-def]
    def ended():  # type: ignore[no-untyped-def]
        lease = client.lease(lease_id)
        return lease if lease["ended_at"] else None

    return wait_for(ended, timeout, f"lease {lease_id} to end")  # type: ignore[no-any-return]



def _holding(client) -> list[dict]:  # type: ignore[no-untyped-def]
    return [x for x in client.leases() if x["state"] in ("granted", "active", "idle")]


def test_training_cell_with_in_out_and_streamed_output_then_kernel_cell(kernel: Kernel, client) -> None:
    kernel.run("import numpy as np\nw0 = np.zeros(3)\nsteps = 3\nbig = np.arange(300_000, dtype='f8')\nsame = big")
    r = kernel.run(
        "%%gpu --in w0,steps,big,same --out w,history\n"
        "import os, sys\n"
        "print('devices', os.environ['CUDA_VISIBLE_DEVICES'], 'lease', os.environ['GPULEASE_LEASE_ID'])\n"
        "history = []\n"
        "w = w0.copy()\n"
        "for i in range(steps):\n"
        "    w = w + 1\n"
        "    history.append(float(w.sum()))\n"
        "    print(f'step {i} loss {history[-1]}', flush=True)\n"
        "print('progress 1/2\\rprogress 2/2')\n"
        "print('shared', same is big, big.flags.writeable)\n"
        "big.sum()\n"
    )
    assert r.status == "ok", r.outputs
    gpu = client.gpus()["gpus"]
    assert "devices GPU-" in r.stdout and r.stdout.split("devices ")[1].split()[0] in {g["id"] for g in gpu}
    assert "step 2 loss 9.0" in r.stdout
    assert "progress 1/2\rprogress 2/2" in r.stdout  # \r progress intact
    assert "shared True True" in r.stdout  # shared references survive, arrays writable
    assert r.result == "np.float64(44999850000.0)"  # the last expression, displayed with its repr
    assert "gpulease: lease " in r.stdout and "(simulated)" in r.stdout
    # the kernel got the outputs, and holds no GPU for the next (plotting) cell
    r2 = kernel.run("import os\nprint(w.tolist(), history, repr(os.environ.get('CUDA_VISIBLE_DEVICES')))")
    assert r2.stdout.strip() == "[3.0, 3.0, 3.0] [3.0, 6.0, 9.0] ''"
    wait_for(lambda: _holding(client) == [], 5, "the lease to be released")


def _buffer_files() -> set[str]:
    """Files of values on their way: in this user's own shm directory (``/dev/shm/gpulease-<uid>``)."""
    return {f for f in os.listdir(transfer.shm_dir()) if f.startswith("gpulease-")}


def test_out_of_band_transfer_of_large_arrays(kernel: Kernel) -> None:
    before = _buffer_files()  # other processes' transfers are not this test's
    kernel.run("import numpy as np\nx = np.ones((4, 1 << 18))")  # 8 MiB: goes out of band
    r = kernel.run("%%gpu --in x --out y\ny = x * 2\n")
    assert r.status == "ok", r.outputs
    r = kernel.run("print(y.shape, float(y.sum()), y.flags.writeable)")
    assert r.stdout.strip() == f"(4, 262144) {2.0 * 4 * (1 << 18)} True"
    assert _buffer_files() - before == set()


def test_in_auto_sends_free_names_and_notes_the_rest(kernel: Kernel) -> None:
    kernel.run("a = 2\napi_token = 'xyz'\ndef sq(v):\n    return v * v\nclass P:\n    k = 3")
    r = kernel.run("%%gpu\nprint(sq(a) + P.k)\ntry:\n    api_token\nexcept NameError:\n    print('no secret')")
    assert r.status == "ok", r.outputs
    assert "7\n" in r.stdout and "no secret" in r.stdout
    assert "api_token (looks like a secret" in r.stdout and "api_token" not in r.stderr
    r = kernel.run("%%gpu --in a\nprint(a)\nprint(undefined_name)")
    assert r.error and r.error["ename"] == "NameError"
    assert "undefined_name" in r.stdout and "not defined in the kernel" in r.stdout and not r.stderr


def test_error_shows_the_cells_own_traceback(kernel: Kernel, client) -> None:
    r = kernel.run("%%gpu\nx = 1\n\ndef f():\n    return 1 / 0\nf()\n")
    assert r.status == "error"
    err = r.error
    assert err is not None and err["ename"] == "ZeroDivisionError"
    tb = "\n".join(err["traceback"])
    # line numbers as the notebook editor shows them (line 1 is the %%gpu line)
    assert "<gpu In[" in tb and "line 6, in <module>" in tb and "line 5, in f" in tb and "return 1 / 0" in tb
    assert "worker.py" not in tb and "magics.py" not in tb and "cellrun.py" not in tb
    wait_for(lambda: _holding(client) == [], 5, "the lease to be released")  # released after the error too
    r = kernel.run("%%gpu\nout = 'x' * 3\nout\n")
    assert r.status == "ok" and r.result == "'xxx'"


def test_bad_arguments_are_one_line_usage_errors(kernel: Kernel) -> None:
    for line, quoted in (("%%gpu 0", "'0'"), ("%%gpu two", "'two'"), ("%%gpu --time soon", "'soon'"),
                         ("%%gpu --mem lots", "'lots'"), ("%%gpu --in 1x", "'1x'"), ("%%gpu 3-1", "'3-1'"),
                         ("%%gpu --bogus", "--bogus")):
        r = kernel.run(f"{line}\nprint('ran')")
        assert r.status == "error" and r.error is not None, line
        assert r.error["ename"] == "UsageError", (line, r.error)
        assert quoted in r.error["evalue"], (line, r.error["evalue"])
        assert "ran" not in r.stdout
    r = kernel.run("%%gpu\n!ls")
    assert r.error and r.error["ename"] == "UsageError" and "IPython syntax" in r.error["evalue"]
    r = kernel.run("%%gpu 64\npass")  # more GPUs than the inventory holds: the broker's clear refusal
    assert r.error and r.error["ename"] == "UsageError"


def test_interrupt_stops_the_worker_and_releases(kernel: Kernel, client) -> None:
    msg_id = kernel.submit(
        "%%gpu --grace 3s\nimport os, time\nprint('worker', os.getpid(), flush=True)\nn = 0\n"
        "while True:\n    time.sleep(0.05)\n    n += 1\n    if n == 3:\n        print('in the loop', flush=True)"
    )
    # once it says so, the cell is in its loop: an interrupt lands in the sleep
    partial = kernel.collect(msg_id, until=lambda outs: "in the loop" in "".join(o["content"].get("text", "")
                                                                                 for o in outs))
    pid = int(partial.stdout.split("worker ")[1].split()[0])
    lease_id = _holding(client)[0]["id"]
    kernel.km.interrupt_kernel()
    r = kernel.collect(msg_id)
    assert r.status == "error" and r.error is not None and r.error["ename"] == "KeyboardInterrupt"
    tb = "\n".join(r.error["traceback"])
    # the worker's own traceback, in the cell's loop (the sleep, or a line beside it on a loaded host)
    assert '<gpu In[' in tb and "jupyter_gpulease" not in tb, tb
    wait_for(lambda: not process_alive(pid), 5, "worker exit")
    wait_for(lambda: client.lease(lease_id)["state"] == "released", 5, "release")
    assert kernel.run("print('still usable')").stdout == "still usable\n"


def test_kernel_death_kills_worker_and_lease_is_revoked(broker_factory, kernel_factory, tmp_path: Path) -> None:
    b = broker_factory(gpus=1, args=["--tick=0.1", "--heartbeat-timeout=2"], name="hb")
    k = kernel_factory(b)
    msg_id = k.submit("%%gpu\nimport os, time\nprint('worker', os.getpid(), flush=True)\ntime.sleep(600)")
    partial = k.collect(msg_id, until=lambda outs: any("worker " in o["content"].get("text", "") for o in outs))
    pid = int(partial.stdout.split("worker ")[1].split()[0])
    c = b.client()
    lease_id = _holding(c)[0]["id"]
    k.kill9()
    t0 = time.monotonic()
    wait_for(lambda: not process_alive(pid), 5, "the worker to die with its kernel")
    assert time.monotonic() - t0 < 1.5
    lease = _wait_ended(c, lease_id, 15)
    # the broker watches the kernel's process (test_kernel_end.py); missed heartbeats would say holder_gone
    assert lease["state"] == "revoked" and lease["reason"] == "holder_exited"


def test_two_kernels_compete_for_one_gpu(broker_factory, kernel_factory) -> None:
    b = broker_factory(gpus=1, args=["--tick=0.1"], name="one")
    k1, k2 = kernel_factory(b), kernel_factory(b)
    m1 = k1.submit("%%gpu\nimport time\nprint('first start', flush=True)\ntime.sleep(2)\nprint('first end')")
    k1.collect(m1, until=lambda outs: any("first start" in o["content"].get("text", "") for o in outs))
    r2 = k2.run("%%gpu\nprint('second ran')")
    r1 = k1.collect(m1)
    assert r1.status == "ok" and r2.status == "ok", (r1.outputs, r2.outputs)
    assert "second ran" in r2.stdout
    queued = float(r2.stdout.split("queued ")[1].split("s")[0])
    assert queued > 0.5  # it waited for the first cell's lease
    # while it waited, a widget showed the queue position (the widget's model is updated through comms)
    assert any("application/vnd.jupyter.widget-view+json" in o["content"].get("data", {}) for o in r2.outputs)


def test_session_keeps_its_worker_and_is_revoked_when_idle(broker_factory, kernel_factory) -> None:
    """Without parking (GpuMagics.park_sessions = False) a revoked session's variables are gone; parking:
    test_session_park.py."""
    b = broker_factory(gpus=2, args=["--tick=0.1", "--LeasePolicy.warn_before_seconds=1"], name="sess")
    k = kernel_factory(b)
    k.run("%config GpuMagics.park_sessions = False")
    k.run("%config GpuMagics.suspend_leases = False")  # suspended sessions: test_session_suspend.py
    r1 = k.run("%%gpu --session m --idle 3s\nimport os\nmodel = [1, 2, 3]\nprint(os.getpid())")
    r2 = k.run("%%gpu --session m\nmodel.append(4)\nprint(os.getpid(), model)")
    assert r1.status == "ok" and r2.status == "ok", (r1.outputs, r2.outputs)
    pid = int(r1.stdout.split()[0])
    assert r2.stdout.startswith(f"{pid} [1, 2, 3, 4]")
    assert "alive" in k.run("%gpu sessions").stdout
    c = b.client()
    lease_id = _holding(c)[0]["id"]
    lease = _wait_ended(c, lease_id, 15)
    assert lease["state"] == "revoked" and lease["reason"] == "idle"
    wait_for(lambda: not process_alive(pid), 5, "the session worker to be stopped")
    r3 = k.run("%%gpu --session m\nprint('model' in dir())")
    assert "ended" in r3.stdout and "starting a new one" in r3.stdout and "False" in r3.stdout
    warnings = [m for m in k.stray if m["msg_type"] == "stream" and "will be revoked" in m["content"]["text"]]
    assert warnings, "the idle warning should reach the session's cell"
    k.run("%gpu session stop m")
    wait_for(lambda: _holding(c) == [], 5, "the session lease to be released")


def test_background_output_lands_in_its_own_cell(kernel: Kernel, client) -> None:
    bg = kernel.submit("%%gpu --bg job1 --out res\nimport time\nfor i in range(3):\n"
                       "    print('bg line', i, flush=True)\n    time.sleep(0.4)\nres = 42")
    r_bg = kernel.collect(bg)
    assert r_bg.status == "ok" and "runs in the background" in r_bg.stdout
    r = kernel.run("import time\nprint('foreground')")
    assert "bg line" not in r.stdout
    wait_for(lambda: kernel.run("print(res if 'res' in dir() else None)").stdout.strip() == "42", 20, "bg result")
    bg_text = "".join(m["content"]["text"] for m in kernel.stray
                      if m["msg_type"] == "stream" and m["parent_header"].get("msg_id") == bg)
    assert "bg line 0" in bg_text and "bg line 2" in bg_text and "[job1] gpulease: lease" in bg_text
    assert "done" in kernel.run("%gpu jobs").stdout


def test_artifacts_are_written_and_load_back(kernel: Kernel, tmp_path: Path) -> None:
    r = kernel.run("%%gpu\nimport os\nprint('hello log')\n"
                   "open(os.path.join(os.environ['GPULEASE_ARTIFACTS'], 'model.txt'), 'w').write('weights')")
    assert r.status == "ok", r.outputs
    lease_id = r.stdout.split("gpulease: lease ")[1].split()[0]
    d = tmp_path / "artifacts" / lease_id
    wait_for(lambda: (d / "meta.json").exists(), 5, "meta.json")
    meta = json.loads((d / "meta.json").read_text())
    assert meta["lease_id"] == lease_id and meta["status"] == "ok" and meta["exit_status"] == 0
    assert meta["devices"] and len(meta["code_sha256"]) == 1
    assert (d / "output.log").read_text() == "hello log\n"
    assert (d / "model.txt").read_text() == "weights"
    r = kernel.run(f"import jupyter_gpulease.artifacts as A\na = A.load({lease_id!r})\nprint(a.files, a.log)")
    assert "'model.txt'" in r.stdout and "hello log" in r.stdout
    assert lease_id in kernel.run("%gpu artifacts").stdout


def test_worker_crash_is_a_clear_error_and_releases(kernel: Kernel, client) -> None:
    r = kernel.run("%%gpu\nimport os, sys\nprint('about to crash', file=sys.stderr, flush=True)\nos.abort()")
    assert r.status == "error" and r.error is not None and r.error["ename"] == "WorkerCrashed"
    assert "SIGABRT" in r.error["evalue"] and "about to crash" in r.error["evalue"]
    wait_for(lambda: _holding(client) == [], 5, "the lease to be released")
    r = kernel.run("%%gpu\nimport sys\nsys.exit(3)")
    assert r.error is not None and r.error["ename"] == "SystemExit"


def test_line_magic_commands(kernel: Kernel) -> None:
    assert "SIMULATED" in kernel.run("%gpu status").stdout
    assert "queue is empty" in kernel.run("%gpu queue").stdout
    assert kernel.run("%gpu leases").status == "ok"
    r = kernel.run("%gpu frobnicate")
    assert r.error and r.error["ename"] == "UsageError" and "status" in r.error["evalue"]
    payload = kernel.run("%%gpu?").reply.get("payload", [])
    assert any("--session" in p.get("data", {}).get("text/plain", "") for p in payload), payload
    r = kernel.run("from jupyter_gpulease.kernel.magics import GpuMagics\nprint(GpuMagics.gpu.__doc__)")
    assert "--session" in r.stdout and "--grace" in r.stdout and "%gpu status" in r.stdout


def test_interrupt_while_queued_cancels_the_request(broker_factory, kernel_factory) -> None:
    b = broker_factory(gpus=1, args=["--tick=0.1"], name="q")
    c = b.client()
    held = c.request_lease(1, heartbeat=False)
    k = kernel_factory(b)
    msg_id = k.submit("%%gpu\nprint('never')")
    k.wait_queued(msg_id)
    assert c.queue()
    k.km.interrupt_kernel()
    r = k.collect(msg_id)
    assert r.status == "error" and "never" not in r.stdout
    assert c.queue() == []
    c.release(held["id"])


def test_kernel_config_loads_the_extension(broker, tmp_path: Path) -> None:
    """The documented way to load the extension in every kernel: an IPython config file."""
    profile = tmp_path / "ipython"
    (profile / "profile_default").mkdir(parents=True)
    (profile / "profile_default" / "ipython_config.py").write_text(
        "c.InteractiveShellApp.extensions = ['jupyter_gpulease']\nc.GpuMagics.warm_workers = 0\n"
    )
    k = Kernel(broker.url, str(tmp_path / "a"), {"IPYTHONDIR": str(profile)})
    try:
        r = k.run("%%gpu\nprint('configured')")
        assert r.status == "ok" and "configured" in r.stdout
        assert k.run("print(get_ipython().find_magic('gpu', 'cell') is not None)").stdout.strip() == "True"
    finally:
        k.stop()


def test_artifacts_to_an_fsspec_url(kernel: Kernel) -> None:
    """A remote artifact root (any fsspec URL): the worker writes locally, the files are uploaded at the end."""
    kernel.run("%config GpuMagics.artifact_root = 'memory://gl-arts'")
    r = kernel.run("%%gpu\nimport os\nprint('to memory')\n"
                   "open(os.path.join(os.environ['GPULEASE_ARTIFACTS'], 'w.txt'), 'w').write('w')")
    assert r.status == "ok", r.outputs
    lease_id = r.stdout.split("gpulease: lease ")[1].split()[0]
    assert f"memory://gl-arts/{lease_id}" in r.stdout
    r = kernel.run(
        "import time, jupyter_gpulease.artifacts as A\n"
        "for _ in range(100):\n"
        "    try:\n"
        f"        a = A.load({lease_id!r}, 'memory://gl-arts'); break\n"
        "    except FileNotFoundError:\n"
        "        time.sleep(0.05)\n"
        "print(sorted(a.files), a.log.strip(), a.meta['status'])"
    )
    assert r.stdout.strip() == "['meta.json', 'output.log', 'w.txt'] to memory ok", r.outputs


def test_negative_values_and_empty_lists_are_answered_clearly(kernel: Kernel) -> None:
    for line in ("%%gpu 1 --time -5m", "%%gpu 1 --time=-5m", "%%gpu --idle -1"):
        r = kernel.run(f"{line}\nprint('ran')")
        assert r.error is not None and r.error["ename"] == "UsageError", (line, r.error)
        opt = "--idle" if "--idle" in line else "--time"
        assert r.error["evalue"].startswith(f"%%gpu: Invalid {opt} '-"), (line, r.error["evalue"])
        assert "ran" not in r.stdout
    assert kernel.run("%gpu leases").stdout.startswith("No leases.")
    r = kernel.run("%%gpu\nprint('once')")
    assert r.status == "ok"
    assert "LEASE" in kernel.run("%gpu leases 5").stdout
