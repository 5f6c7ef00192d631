"""The Slurm executor: a ``%%gpu`` cell's worker as a step of the lease's Slurm allocation.

When the broker's inventory is a Slurm cluster, a grant is an allocation (``salloc --no-shell``)
on the node(s) that hold the GPUs (the lease view's ``placement``). The kernel then runs::

    srun --jobid=J --overlap --nodes=1 --ntasks=1 --nodelist=<first node> --gpus=<its GPUs>
         python -m jupyter_gpulease.executors.slurm_relay [worker options]

which starts, on the GPU node, the same worker process a local run uses
(``python -m jupyter_gpulease.worker``) in its own process group, with the
``CUDA_VISIBLE_DEVICES`` Slurm gave the step. srun carries only stdin, stdout and stderr,
and forwards output a line at a time, so this relay multiplexes the worker's three
channels (stdout, stderr, framed results) onto its stdout as lines ``<tag> <base64>\\n``,
and takes the kernel's jobs, interrupts and kill requests on its stdin the same way.
When the kernel goes, srun's stdin closes, the relay closes the worker's stdin and the
worker kills its own process group (its lifeline); when the lease ends, the broker's
``scancel`` ends the step and everything in it.

Values over 1 MiB travel out of band as files in ``<lease artifact dir>/.oob``, which must be a
path both hosts see (a shared artifact root), not the kernel's /dev/shm.

This module is the kernel side; the relay's protocol and process are in ``slurm_relay``.
"""

from __future__ import annotations

import contextlib
import io
import json
import queue
import signal
import subprocess
import sys
import threading
import time
from typing import IO, TYPE_CHECKING, Any

from ..wire import transfer
from ..worker.env import worker_env
from .base import OutputDecoder, PlacedExecutor, RelayedWorker, Sink, WorkerCrashed, inputs_on_shared_storage

if TYPE_CHECKING:
    from ..client import LeaseView
from .slurm_relay import CTRL, EXIT, INFO, JOB, KILL, SIGNAL, STDERR, STDOUT, decode_line, encode_line

DEFAULT_START_TIMEOUT = PlacedExecutor.env_timeout("slurm")  # seconds for the step to start

NO_CLIENT = ("the lease was placed in Slurm, but this host has no Slurm client (srun, squeue): install "
             "slurm-client and munge, configured for the broker's cluster ($SLURM_CONF)")


# ------------------------------------------------------------------------------ kernel side
class SlurmStartError(RuntimeError):
    """The lease's allocation or the worker's step could not be started."""


def _slurm_env() -> dict[str, str]:
    env = worker_env()
    env.pop("CUDA_VISIBLE_DEVICES", None)  # Slurm sets it for the step
    for k in [k for k in env if k.startswith(("SLURM_", "SALLOC_", "SRUN_", "SBATCH_"))
              and k not in ("SLURM_CONF",)]:
        env.pop(k)  # a kernel inside a Slurm job must not pass its own job's settings to this step
    return env


def wait_for_job(name: str, timeout: float) -> str:
    """The id of the running Slurm job named ``name`` (the broker's allocation for a lease)."""
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        try:
            p = subprocess.run(["squeue", "--noheader", f"--name={name}", "--states=all", "--format=%i|%T|%r"],
                               capture_output=True, text=True, timeout=30, env=_slurm_env())
        except FileNotFoundError:
            raise SlurmStartError(NO_CLIENT) from None
        if p.returncode:
            raise SlurmStartError(f"squeue failed: {p.stderr.strip()}")
        jobs = [line.split("|") for line in p.stdout.splitlines() if line.strip()]
        jobs.sort(key=lambda j: int(j[0]))
        if jobs:
            job_id, state, reason = jobs[-1][:3]
            if state in ("RUNNING", "CONFIGURING"):
                return job_id
            if state not in ("PENDING",):
                raise SlurmStartError(f"the lease's Slurm job {job_id} is {state} ({reason})")
            last = f"job {job_id} is pending ({reason})"
        else:
            last = f"no Slurm job named {name} yet"
        if time.monotonic() > deadline:
            raise SlurmStartError(f"the lease's allocation did not start within {timeout:g} s: {last}")
        time.sleep(0.02)


class SlurmWorker(RelayedWorker):
    """Kernel side: the Worker interface, for a worker that runs as a Slurm job step."""

    local = False  # not a process of this host: nothing to attach to the lease by pid

    def __init__(self, placement: dict[str, Any], python: str | None = None, preload: list[str] | None = None,
                 session: bool = False, node: int = 0, start_timeout: float = DEFAULT_START_TIMEOUT) -> None:
        self.start_timeout = start_timeout
        job_id = str(placement.get("job_id") or "") if placement.get("state") == "ready" else ""
        if not job_id:
            job_id = wait_for_job(placement["job_name"], self.start_timeout)
        where = placement["bundles"][node]
        self.job_id, self.node = job_id, where["node"]
        args = (["--session"] if session else []) + (["--preload", ",".join(preload)] if preload else [])
        self.cmd = ["srun", f"--jobid={job_id}", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={self.node}",
                    f"--gpus={int(where['gpus'])}", "--quiet", "--kill-on-bad-exit=1", "--job-name=gpulease-cell",
                    python or sys.executable, "-m", "jupyter_gpulease.executors.slurm_relay", *args]
        try:
            self.proc = subprocess.Popen(self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, env=_slurm_env(), start_new_session=True)
        except FileNotFoundError:
            raise SlurmStartError(NO_CLIENT) from None
        self.events: queue.Queue[tuple[int, bytes]] = queue.Queue()
        self._stderr_tail = b""
        self._worker_rc: int | None = None
        self._wlock = threading.Lock()
        self._out_closed = threading.Event()
        assert self.proc.stdout is not None and self.proc.stderr is not None
        threading.Thread(target=self._read_out, args=(self.proc.stdout,), daemon=True,
                         name="gpulease-srun-out").start()
        threading.Thread(target=self._read_err, args=(self.proc.stderr,), daemon=True,
                         name="gpulease-srun-err").start()
        self.ready: dict[str, Any] | None = None
        self._frames = transfer.FrameReader()
        self._results: list[dict[str, Any]] = []
        self._decoders = {STDOUT: OutputDecoder(), STDERR: OutputDecoder()}
        self._done = False
        self.info = self._wait_info()
        self.pid: int = int(self.info["pid"])

    # ---------------------------------------------------------------- srun's pipes (threads)
    def _read_out(self, stream: IO[bytes]) -> None:
        for line in stream:
            msg = decode_line(line)
            if msg is None:
                continue
            if msg[0] == EXIT:
                self._worker_rc = int(json.loads(msg[1])["returncode"])
            self.events.put(msg)
        self._out_closed.set()
        self.events.put((-1, b""))  # srun's stdout closed: the step is over

    def _read_err(self, stream: IO[bytes]) -> None:
        for line in stream:  # srun's and slurmstepd's own messages (and the relay's, should it fail)
            self._stderr_tail = (self._stderr_tail + line)[-4000:]

    def _wait_info(self) -> dict[str, Any]:
        try:
            tag, data = self.events.get(timeout=self.start_timeout)
        except queue.Empty:
            self._stop_srun()
            raise SlurmStartError(f"the worker's Slurm step did not start within {self.start_timeout:g} s: "
                                  f"{self._tail().strip()}") from None
        if tag != INFO:
            self._stop_srun()
            rc = self.proc.wait(5) if self.proc.poll() is None else self.proc.returncode
            raise SlurmStartError(f"srun failed (status {rc}): {self._tail().strip() or 'no message'}")
        return dict(json.loads(data))

    # ---------------------------------------------------------------- state
    def alive(self) -> bool:
        return not self._done and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        if self._worker_rc is not None:
            return self._worker_rc
        return self.proc.returncode if self._done else None

    def _send(self, tag: int, data: bytes) -> None:
        with self._wlock:
            assert self.proc.stdin is not None
            self.proc.stdin.write(encode_line(tag, data))
            self.proc.stdin.flush()

    def submit(self, job: dict[str, Any]) -> None:
        job = dict(job)
        env = dict(job.get("env") or {})
        env["CUDA_VISIBLE_DEVICES"] = self.info["cuda_visible_devices"]  # as Slurm gave this step
        env.update({"GPULEASE_NODE": self.info["node"], "GPULEASE_SLURM_JOB_ID": self.job_id})
        job["env"] = env
        job = inputs_on_shared_storage(job, env.get("GPULEASE_ARTIFACTS"))
        buf = io.BytesIO()
        transfer.send(buf, job)
        try:
            self._send(JOB, buf.getvalue())
        except (BrokenPipeError, ValueError):
            pass  # the step is gone: poll() says how

    # ---------------------------------------------------------------- output
    def _ended(self) -> bool:
        return self._done

    def _crashed(self) -> WorkerCrashed:
        return WorkerCrashed(self.returncode, self._tail())

    def _fetch(self, timeout: float, out: Sink, err: Sink) -> int:
        """Relay what the step sent; returns how many chunks of output (stdout/stderr) it brought."""
        batch: list[tuple[int, bytes]] = []
        try:
            batch.append(self.events.get(timeout=timeout) if timeout > 0 else self.events.get_nowait())
        except queue.Empty:
            return 0
        while True:
            try:
                batch.append(self.events.get_nowait())
            except queue.Empty:
                break
        chunks = 0
        for tag, data in batch:
            if tag == -1:
                self._done = True
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(5)
                continue
            if tag == CTRL and data:
                for msg in self._frames.feed(data):
                    if msg.get("type") == "ready":
                        self.ready = msg
                    else:
                        self._results.append(msg)
            elif tag in (STDOUT, STDERR) and data:
                chunks += 1
                if tag == STDERR:
                    self._stderr_tail = (self._stderr_tail + data)[-4000:]
                text = self._decoders[tag].decode(data)
                if text:
                    (out if tag == STDOUT else err)(text)
        return chunks

    def _tail(self) -> str:
        return self._stderr_tail.decode(errors="replace")

    def drain(self, out: Sink, err: Sink) -> None:
        if not self._done:
            self._fetch(0.0, out, err)

    # ---------------------------------------------------------------- stopping
    def interrupt(self) -> None:
        with contextlib.suppress(Exception):
            self._send(SIGNAL, json.dumps({"signal": int(signal.SIGINT)}).encode())

    def kill(self, grace: float = 2.0) -> None:
        with contextlib.suppress(Exception):
            self._send(KILL, json.dumps({"grace": grace}).encode())
        try:
            self.proc.wait(grace + 10)
        except subprocess.TimeoutExpired:
            self._stop_srun()
        self.close()

    def _stop_srun(self) -> None:
        """srun does not answer: kill it, and the step in Slurm."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        step = (getattr(self, "info", None) or {}).get("step_id")
        if step:
            subprocess.run(["scancel", f"{self.job_id}.{step}"], capture_output=True, timeout=30, env=_slurm_env())
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)

    def wait_exit(self, timeout: float = 5.0) -> int | None:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill(0.5)
        self._out_closed.wait(5)  # the worker's exit status is the last line srun forwards
        self._done = self._done or self._out_closed.is_set()
        return self.returncode

    def close(self) -> None:
        """Close the worker's lifeline (srun's stdin); srun ends with the step."""
        self._done = self._done or self.proc.poll() is not None
        with contextlib.suppress(Exception):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        if self.proc.poll() is None:
            def reap() -> None:
                try:
                    self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    self._stop_srun()

            threading.Thread(target=reap, daemon=True, name="gpulease-srun-reaper").start()


class SlurmExecutor(PlacedExecutor):
    """Workers for leases the broker placed with Slurm (the lease view's ``placement.kind`` is ``slurm``):
    a step of the Slurm allocation that holds the lease's GPUs."""

    kind = "slurm"

    def worker(self, lease: LeaseView, python: str | None, preload: list[str] | None,
               session: bool) -> SlurmWorker:
        assert lease.placement is not None
        return SlurmWorker(lease.placement, python, preload, session=session, start_timeout=self.start_timeout)
