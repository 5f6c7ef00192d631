"""A kernel's leases end with the kernel (issue 31): how soon, and what the heartbeat that remains costs.

One real broker (simulated inventory, its default tick and heartbeat timeout) on a Unix socket and on TCP. Real
kernels (jupyter_client) and a real JupyterLab on this host ask over the socket, so the broker watches each
kernel's process; each sample is the time from the kernel's exit (seen through a pidfd the moment it happens) to
the last of its leases ended (the broker's ``ended_at``), for the four ways a kernel ends: JupyterLab stopped with
Ctrl-C twice while a ``%%gpu --bg`` cell runs, the kernel restarted mid-cell, ``kill -9`` of the kernel mid-cell,
and a kernel that exits (``os._exit``) between cells holding a ``--session``. A negative figure: the kernel gave
its leases back itself before it exited (its clean shutdown). Baseline: ``kill -9`` of kernels that reach the same
broker over TCP (a kernel on another host), whose leases end only by the heartbeat timeout.

The heartbeat a kernel on another host keeps: the broker's CPU per heartbeat and per kernel-hour at the kernel's
default interval (10 s), and how late heartbeats arrive at the broker (the gap between two of them, seen in its
log, less the interval) while the kernel runs a CPU-bound cell, and on a machine loaded with busy processes too:
what the heartbeat timeout must outlast so that a busy kernel is never taken for a dead one.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from jupyter_client.blocking.client import BlockingKernelClient
from jupyter_client.manager import KernelManager

from jupyter_gpulease.client import BrokerClient, LeaseView

from .broker_process import Broker, cpu_seconds, stop_process
from .report import Figure, figure

TITLE = "A kernel's leases end with the kernel"

#: the kernel's default heartbeat interval (``GpuMagics.heartbeat_interval``) and the broker's default timeout
INTERVAL, TIMEOUT = 10.0, 60.0
#: the heartbeat interval of the lateness runs: many gaps in a short run (lateness does not depend on it)
GAP_INTERVAL = 1.0
LOOP = "import time\nwhile True:\n    time.sleep(0.05)"


class ExitClock:
    """The wall-clock time process ``pid`` exits, seen through a pidfd the moment it does."""

    def __init__(self, pid: int) -> None:
        self.pid, self.fd = pid, os.pidfd_open(pid)
        self.at: float | None = None
        self._thread = threading.Thread(target=self._wait, daemon=True)
        self._thread.start()

    def _wait(self) -> None:
        select.select([self.fd], [], [])
        self.at = time.time()
        os.close(self.fd)

    def wait(self, timeout: float) -> float:
        self._thread.join(timeout)
        if self.at is None:
            raise RuntimeError(f"process {self.pid} did not exit within {timeout} s")
        return self.at


class _Kernel:
    def __init__(self, url: str, artifacts: str, token: str = "") -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPULEASE_")}
        env.update({"GPULEASE_BROKER": url, "GPULEASE_ARTIFACT_ROOT": artifacts})
        if token:
            env["GPULEASE_TOKEN"] = token
        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(env=env, stderr=subprocess.DEVNULL)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)
        self.run("%load_ext jupyter_gpulease\n%config GpuMagics.show_summary = False")

    @property
    def pid(self) -> int:
        return int(self.km.provisioner.pid)  # type: ignore[union-attr]

    def run(self, code: str, timeout: float = 600) -> None:
        reply = self.kc.execute_interactive(code, timeout=timeout, output_hook=lambda msg: None)
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"benchmark cell failed: {code[:60]!r}: {reply['content'].get('evalue')}")

    def stop(self) -> None:
        self.kc.stop_channels()
        if self.km.has_kernel:
            self.km.shutdown_kernel(now=True)


def _live(client: BrokerClient) -> list[LeaseView]:
    return [x for x in client.leases() if not x.ended]


def _wait(cond: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)
    return value


def _ended_after(client: BrokerClient, ids: set[str], exited: float, timeout: float) -> float:
    """Seconds from the kernel's exit to the last of its leases ended (waits for them)."""
    views = _wait(lambda: (v := [client.lease(i) for i in ids]) and all(x.ended_at for x in v) and v, timeout,
                  f"leases {sorted(ids)} to end")
    return max(float(x.ended_at) for x in views) - exited


def _kernel_case(client: BrokerClient, url: str, artifacts: str, how: str) -> float:
    k = _Kernel(url, artifacts)
    try:
        if how == "session":
            k.run("%%gpu --session m\nmodel = [1, 2]")
        else:
            k.kc.execute("%%gpu 2\n" + LOOP)
            _wait(lambda: [x for x in _live(client) if x.holding], 30, "the cell's lease")
        ids = {x.id for x in _live(client)}
        clock = ExitClock(k.pid)
        if how == "restart":
            k.km.restart_kernel(now=True)
        elif how == "kill":
            os.kill(k.pid, signal.SIGKILL)
        else:
            k.kc.execute("import os\nos._exit(0)")
        return _ended_after(client, ids, clock.wait(30), 30)
    finally:
        k.stop()


def _lab_case(client: BrokerClient, url: str, workdir: str) -> float:
    """JupyterLab with a ``%%gpu 4 --bg`` cell running, stopped by Ctrl-C twice in its terminal."""
    root, runtime = Path(workdir, "root"), Path(workdir, "runtime")
    root.mkdir(parents=True, exist_ok=True)
    port, token = _free_port(), os.urandom(16).hex()
    terminal, tty = pty.openpty()
    env = {**os.environ, "GPULEASE_BROKER": url, "GPULEASE_ARTIFACT_ROOT": os.path.join(workdir, "artifacts"),
           "JUPYTER_RUNTIME_DIR": str(runtime)}
    log_path = Path(workdir, "lab.log")
    proc = subprocess.Popen([sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", f"--port={port}", "--ip=127.0.0.1",
                             f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
                             "--ServerApp.port_retries=0"], stdin=tty, stdout=open(log_path, "ab"),
                            stderr=subprocess.STDOUT, env=env, cwd=root, start_new_session=True)
    kc: BlockingKernelClient | None = None
    try:
        def api(path: str, body: bytes | None = None) -> bytes:
            req = urllib.request.Request(f"http://127.0.0.1:{port}/{path}", data=body,
                                         headers={"Authorization": f"token {token}"})
            with urllib.request.urlopen(req, timeout=30) as r:
                return bytes(r.read())

        _wait(lambda: _answers(api, "api/status"), 120, "JupyterLab to answer")
        kernel_id = json.loads(api("api/kernels", b'{"name": "python3"}'))["id"]
        kc = BlockingKernelClient(connection_file=str(runtime / f"kernel-{kernel_id}.json"))
        kc.load_connection_file()
        kc.start_channels()
        kc.wait_for_ready(timeout=120)
        for code in ("%load_ext jupyter_gpulease", "%%gpu 4 --bg hold --time 20m\n" + LOOP):
            kc.execute_interactive(code, timeout=120, output_hook=lambda msg: None)
        _wait(lambda: [x for x in _live(client) if x.holding], 30, "the --bg cell's lease")
        ids = {x.id for x in _live(client)}
        clock = ExitClock(_kernel_pid(kernel_id))
        proc.send_signal(signal.SIGINT)
        _wait(lambda: b"Shut down this Jupyter server" in log_path.read_bytes(), 30, "the server's question")
        proc.send_signal(signal.SIGINT)
        return _ended_after(client, ids, clock.wait(60), 30)
    finally:
        if kc is not None:
            kc.stop_channels()
        stop_process(proc)
        os.close(terminal)
        os.close(tty)


def _answers(api: Any, path: str) -> bool:
    try:
        api(path)
        return True
    except OSError:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _kernel_pid(kernel_id: str) -> int:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if f"kernel-{kernel_id}.json".encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    return int(entry)
            except OSError:
                continue
    raise RuntimeError(f"no process of kernel {kernel_id}")


def _over_tcp(client: BrokerClient, url: str, token: str, artifacts: str, n: int, timeout: float) -> list[float]:
    """Baseline: ``n`` kernels that reach the broker over TCP, each mid-cell, killed (-9) together."""
    kernels = [_Kernel(url, artifacts, token) for _ in range(n)]
    try:
        for k in kernels:
            k.kc.execute("%%gpu\n" + LOOP)
        admin = _wait(lambda: (v := [x for x in client.leases(everyone=True) if x.holding and x.user == "bench"])
                      and len(v) == n and v, 60, "the TCP kernels' leases")
        ids = [x.id for x in admin]
        clocks = [ExitClock(k.pid) for k in kernels]
        for k in kernels:
            os.kill(k.pid, signal.SIGKILL)
        exits = sorted(c.wait(30) for c in clocks)
        views = _wait(lambda: (v := [client.lease(i) for i in ids]) and all(x.ended_at for x in v) and v,
                      timeout + 30, "the TCP kernels' leases to end by the heartbeat timeout")
        # which kernel held which lease is not known here: pair the i-th exit with the i-th ending (both sorted)
        return [e - x for e, x in zip(sorted(float(v.ended_at) for v in views), exits, strict=True)]
    finally:
        for k in kernels:
            k.stop()


def _cpu_per_call(pid: int, call: Any, batches: int, per_batch: int) -> list[float]:
    """The broker's CPU milliseconds per call, one sample per batch of ``per_batch`` calls."""
    out = []
    for _ in range(batches):
        c0 = cpu_seconds(pid)
        for _ in range(per_batch):
            call()
        out.append((cpu_seconds(pid) - c0) * 1000 / per_batch)
    return out


_BEAT = re.compile(r"^(\d+\.\d+) 200 POST /api/v1/leases/(l-[0-9a-f]+)/heartbeat ", re.M)


def _gaps(log: Path, lease_id: str, since: float, until: float) -> list[float]:
    """Seconds between consecutive heartbeats of ``lease_id`` the broker answered in [since, until], less the
    interval."""
    times = [float(m.group(1)) for m in _BEAT.finditer(log.read_text(errors="replace"))
             if m.group(2) == lease_id and since <= float(m.group(1)) <= until]
    return [b - a - GAP_INTERVAL for a, b in zip(times, times[1:], strict=False)]


BUSY_CELL = (
    "import random, time\n"
    "big = [random.random() for _ in range(2_000_000)]\n"
    "end = time.monotonic() + {seconds}\n"
    "while time.monotonic() < end:\n"
    "    sorted(big)  # holds the GIL for the whole sort\n"
    "    sum(i * i for i in range(200_000))\n"
)


def _lateness(client: BrokerClient, url: str, artifacts: str, log: Path, seconds: float,
              hogs: int) -> dict[str, list[float]]:
    """Heartbeat lateness of a kernel holding a ``--session`` lease: idle; running a CPU-bound cell; the same with
    ``hogs`` busy processes on the machine."""
    k = _Kernel(url, artifacts)
    out: dict[str, list[float]] = {}
    try:
        k.run(f"%config GpuMagics.heartbeat_interval = {GAP_INTERVAL}")
        k.run("%%gpu --session hb --idle 1h\nx = 1")
        (lease,) = [x for x in _live(client) if x.labels.get("session") == "hb"]
        t0 = time.time()
        time.sleep(seconds)  # an idle kernel: heartbeats as they come
        out["idle"] = _gaps(log, lease.id, t0, time.time())
        t0 = time.time()
        k.run(BUSY_CELL.format(seconds=seconds))
        out["busy"] = _gaps(log, lease.id, t0, time.time())
        procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hogs)]
        try:
            t0 = time.time()
            k.run(BUSY_CELL.format(seconds=seconds))
            out["loaded"] = _gaps(log, lease.id, t0, time.time())
        finally:
            for p in procs:
                p.kill()
                p.wait()
        k.run("%gpu session stop hb")
    finally:
        k.stop()
    return out


def run(opts: Any) -> list[Figure]:
    quick = bool(getattr(opts, "quick", False))
    tries = 2 if quick else 10
    timeout = 5.0 if quick else TIMEOUT
    window = 4.0 if quick else 30.0
    hogs = 2 * (os.cpu_count() or 1)
    tmp = tempfile.mkdtemp(prefix="glhold")
    port = _free_port()
    b = Broker(os.path.join(tmp, "b"), gpus=max(8, tries), nodes=1)
    b.args = [a for a in b.args if not a.startswith("--log-level")] + [
        f"--port={port}", f"--heartbeat-timeout={timeout:g}", "--log-level=DEBUG",
        "--LeaseBroker.log_format=%(created).6f %(message)s"]
    os.makedirs(b.workdir)
    artifacts = os.path.join(tmp, "artifacts")
    results: dict[str, list[float]] = {}
    try:
        b.start()
        assert b.proc is not None
        url = "unix://" + b.socket
        client = BrokerClient(url)
        for how in ("restart", "kill", "session"):
            results[how] = [_kernel_case(client, url, artifacts, how) for _ in range(tries)]
        results["lab"] = [_lab_case(client, url, os.path.join(tmp, f"lab{i}")) for i in range(tries)]
        token = subprocess.run([sys.executable, "-m", "lease_broker", "token", "create", "bench", "--admin",
                                f"--db={b.db}"], capture_output=True, text=True, check=True).stdout.strip()
        results["tcp"] = _over_tcp(BrokerClient(f"http://127.0.0.1:{port}", token=token),
                                   f"http://127.0.0.1:{port}", token, artifacts, tries, timeout)
        lease = client.request_lease(1, heartbeat=True, duration_seconds=3600)
        per = 50 if quick else 500
        results["beat"] = _cpu_per_call(b.proc.pid, lambda: client.heartbeat(lease.id), 10, per)
        results["info"] = _cpu_per_call(b.proc.pid, client.info, 10, per)
        client.release(lease.id)
        results.update(_lateness(client, url, artifacts, Path(b.workdir, "broker.log"), window, hogs))
        gone = [x for x in client.leases(ended=1000) if x.reason == "holder_gone" and x.user != "bench"]
        results["false"] = [float(len(gone))]
    finally:
        b.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    base = f"kill -9 of a kernel over TCP: heartbeat timeout {timeout:g} s"
    bar = ("p99", "<=", 1.0)
    why = (f"{tries} tries; seconds from the kernel process's exit (a pidfd) to the broker's ended_at of the last of "
           f"its leases. Baseline: {tries} kernels reaching the same broker over TCP, killed together, their leases "
           "ended by the heartbeat timeout (the i-th exit paired with the i-th ending).")
    per_hour = 3600 / INTERVAL
    return [
        figure("Ctrl-C twice of JupyterLab with a %%gpu 4 --bg cell running", "s", results["lab"], base,
               results["tcp"], bar=bar, note=why + " Negative: the kernel gave its lease back itself at its clean "
               "shutdown, before it exited (in the other cases a few ms either way: the broker's and this "
               "process's wake-ups on the kernel's exit)."),
        figure("kernel restarted mid-cell (restart_kernel(now=True))", "s", results["restart"], base,
               results["tcp"], bar=bar),
        figure("kill -9 of the kernel mid-cell", "s", results["kill"], base, results["tcp"], bar=bar),
        figure("kernel exits (os._exit) between cells holding a --session", "s", results["session"], base,
               results["tcp"], bar=bar),
        figure("broker CPU per heartbeat", "ms", results["beat"], "per GET /api/v1/info", results["info"],
               note=f"10 batches of {per} heartbeats of one lease over the Unix socket; the broker's user+system CPU "
                    "time (10 ms ticks) per call, with this run's DEBUG log (a line a request) included."),
        figure(f"broker CPU per kernel-hour of heartbeats ({INTERVAL:g} s interval)", "ms",
               [x * per_hour for x in results["beat"]], f"{per_hour:g} GET /api/v1/info",
               [x * per_hour for x in results["info"]],
               note="One lease's heartbeats for an hour at the kernel's default interval (a kernel holding more "
                    "leases beats for each)."),
        figure(f"heartbeat lateness: kernel in a CPU-bound cell, {hogs} busy processes on {os.cpu_count()} cores",
               "s", results["loaded"], "kernel idle, machine idle", results["idle"],
               bar=("max", "<=", TIMEOUT - INTERVAL),
               note=f"Gap between two heartbeats of a --session lease in the broker's log, less the interval "
                    f"({GAP_INTERVAL:g} s here), over {window:g} s: the kernel sorts a 2M-float list (holding the "
                    "GIL for the whole sort) and sums in Python, while busy processes take every core. Bar: a gap "
                    f"under the default timeout ({TIMEOUT:g} s) at the default interval ({INTERVAL:g} s), i.e. no "
                    "false revocation."),
        figure("heartbeat lateness: kernel in a CPU-bound cell, machine idle", "s", results["busy"],
               "kernel idle, machine idle", results["idle"]),
        figure("false revocations (holder_gone) of this run's kernels", "leases", results["false"],
               "kill -9 over TCP (revoked by design)", [float(tries)], bar=("max", "<=", 0.0),
               note="Leases of this run's kernels that reached the broker over the Unix socket revoked for missed "
                    "heartbeats (the TCP baseline's are revoked on purpose and not counted)."),
    ]
