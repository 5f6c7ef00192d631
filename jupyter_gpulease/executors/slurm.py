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

Values over 1 MiB travel out of band as files in ``<lease artifact dir>/.oob`` where the node sees the
kernel's artifact root (the marker check, ``base.RootCheck``); elsewhere in the messages themselves, through
a direct TCP connection between the kernel and the relay (``slurm_bulk``: a per-worker key sent on srun's stdin,
every frame authenticated), each frame announced by a line on srun's stdio so that the order holds; where the
node cannot connect to the kernel, through srun's stdio itself (base64 lines, about 10 MB/s). Either way the job
goes out in pieces as it is pickled, its inputs from the values' own memory (``transfer.write_framed``).

A step lives in the lease's allocation, which ends with the lease: a lease that runs several calls (the Python
API's) gets its next call's step started while the current one runs (``SlurmExecutor.keep_warm``).

This module is the kernel side; the relay's protocol and process are in ``slurm_relay``.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any, ClassVar

from traitlets import Bool, TraitError, Unicode, validate

from ..wire import transfer
from ..worker.env import worker_env
from .base import ENDED, OutputDecoder, PlacedExecutor, RelayedWorker, RootCheck, Sink, WorkerCrashed

if TYPE_CHECKING:
    from ..client import LeaseView
from . import slurm_bulk, slurm_relay
from .slurm_relay import (
    BULK,
    BULK_MIN,
    CTRL,
    EXIT,
    INFO,
    JOB,
    KILL,
    OPEN,
    OPENED,
    PING,
    SIGNAL,
    STDERR,
    STDOUT,
    decode_line,
    encode_line,
)

DEFAULT_START_TIMEOUT = PlacedExecutor.env_timeout("slurm")  # seconds for the step to start
JOB_CHUNK = 1 << 20  # bytes of a job per line to the relay: a value of 200 MB is never one line of 270 MB
DEFAULT_CALL_TIMEOUT = PlacedExecutor.env_call_timeout("slurm")  # seconds the started relay may take to answer

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
    #: bytes of jobs and results this kernel moved through the direct channel and through srun's stdio
    moved: ClassVar[dict[str, int]] = {"direct": 0, "stdio": 0}

    def __init__(self, placement: dict[str, Any], python: str | None = None, preload: list[str] | None = None,
                 session: bool = False, node: int = 0, start_timeout: float = DEFAULT_START_TIMEOUT,
                 call_timeout: float = DEFAULT_CALL_TIMEOUT, direct: bool = True, bulk_address: str = "",
                 bulk_ports: tuple[int, int] | None = None) -> None:
        """``direct``: values of a node without the shared root through the direct channel (``slurm_bulk``) on
        ``bulk_address`` (''; the address the node reaches srun on) and a port of ``bulk_ports`` (None: any)."""
        self.start_timeout, self.call_timeout = start_timeout, call_timeout
        self._direct, self._bulk_address, self._bulk_ports = direct, bulk_address, bulk_ports
        self._bulk: slurm_bulk.Channel | None = None  # the direct channel, once open
        self._bulk_tried = self._closed = False
        self.bulk_error = ""  # why the direct channel could not be opened (values went through srun's stdio)
        self._opened: queue.Queue[dict[str, Any]] = queue.Queue()  # the relay's answer to OPEN
        self._heard = time.monotonic()  # when the relay last sent anything (srun's stdout)
        self._pinged: float | None = None  # when the kernel asked the quiet relay to answer
        self._how = ""  # for the cell's error, where the exit status does not say it (the relay stopped answering)
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
        self.events: queue.Queue[tuple[int, Any]] = queue.Queue()
        self._stderr_tail = b""
        self._worker_rc: int | None = None
        self._wlock = threading.Lock()
        self._out_closed = threading.Event()
        self._sees: queue.Queue[bool] = queue.Queue()  # the relay's answers to the marker check (SEES)
        assert self.proc.stdout is not None and self.proc.stderr is not None
        threading.Thread(target=self._read_out, args=(self.proc.stdout,), daemon=True,
                         name="gpulease-srun-out").start()
        self._err_reader = threading.Thread(target=self._read_err, args=(self.proc.stderr,), daemon=True,
                                            name="gpulease-srun-err")
        self._err_reader.start()
        self.ready: dict[str, Any] | None = None
        self._frames = transfer.FrameReader()
        self._results: list[dict[str, Any]] = []
        self._decoders = {STDOUT: OutputDecoder(), STDERR: OutputDecoder()}
        self._inbox: deque[tuple[int, Any]] = deque()
        self._done = False
        self.info = self._wait_info()
        self.pid: int = int(self.info["pid"])
        # values through the shared artifact root only where the node sees it, else through srun's stdio
        self._root = RootCheck(self._ask_sees, self.node)

    def _ask_sees(self, path: str, token: str) -> bool:
        """The relay's marker check (``base.RootCheck``); no answer within ``call_timeout``: not seen."""
        try:
            self._send(slurm_relay.CHECK, json.dumps({"path": path, "token": token}).encode())
            return self._sees.get(timeout=self.call_timeout)
        except (OSError, ValueError, queue.Empty):
            return False

    # ---------------------------------------------------------------- srun's pipes (threads)
    def _read_out(self, stream: IO[bytes]) -> None:
        for line in stream:
            msg = decode_line(line)
            if msg is None:
                continue
            self._heard, self._pinged = time.monotonic(), None
            if msg[0] == slurm_relay.SEES:
                self._sees.put(bool(json.loads(msg[1])["sees"]))
                continue
            if msg[0] == OPENED:
                self._opened.put(dict(json.loads(msg[1])))
                continue
            if msg[0] == BULK:  # a frame of the worker's results on the direct channel, here in the stream
                try:
                    assert self._bulk is not None
                    frame = self._bulk.recv(max(self.call_timeout, 1.0))
                except (AssertionError, OSError) as e:
                    if not self._closed:  # (closed here: the kernel let go of the worker)
                        self._hang(f"send the cell's results on the direct channel ({e})")
                    continue
                SlurmWorker.moved["direct"] += len(frame)
                self.events.put((CTRL, frame))
                continue
            elif msg[0] == CTRL:
                SlurmWorker.moved["stdio"] += len(msg[1])
            if msg[0] == EXIT:
                self._worker_rc = int(json.loads(msg[1])["returncode"])
            self.events.put(msg)
        self._out_closed.set()
        self.events.put((ENDED, None))  # srun's stdout closed: the step is over

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
            self._err_reader.join(2)  # srun's last words
            python = self.cmd[self.cmd.index("-m") - 1]
            if f"execve(): {python}: No such file" in self._tail():
                raise SlurmStartError(f"the worker's interpreter {python} does not exist on node {self.node}: install "
                                      "the same Python environment at the same path on every GPU node, or point "
                                      "GpuMagics.worker_python at one that is there")
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

    def _send(self, tag: int, data: bytes | memoryview) -> None:
        """One line to the relay through srun's stdin, never blocking the kernel for good: a relay that takes none
        of it for ``call_timeout`` (stopped, its pipes full) is taken for hung (BrokenPipeError)."""
        if self._how:
            raise BrokenPipeError("the relay stopped answering")  # taken for hung already: never wait again
        line = memoryview(encode_line(tag, data))
        with self._wlock:
            assert self.proc.stdin is not None
            fd = self.proc.stdin.fileno()
            os.set_blocking(fd, False)
            while line:
                try:
                    line = line[os.write(fd, line):]
                    continue
                except BlockingIOError:
                    pass
                if not select.select([], [fd], [], self.call_timeout)[1]:
                    self._hang("take the kernel's message")
                    raise BrokenPipeError("the relay stopped reading")

    def submit(self, job: dict[str, Any]) -> None:
        job = dict(job)
        env = dict(job.get("env") or {})
        env["CUDA_VISIBLE_DEVICES"] = self.info["cuda_visible_devices"]  # as Slurm gave this step
        env.update({"GPULEASE_NODE": self.info["node"], "GPULEASE_SLURM_JOB_ID": self.job_id})
        job["env"] = env
        job = self._root.job(job)
        if job.get("inline") and self._direct:  # the node does not see the shared root: values both ways here
            self._open_bulk()
        # the job in pieces as it is pickled, never joined: its inputs go out from the values' own memory
        size = transfer.framed_size(job)
        try:
            if self._bulk is not None and size >= BULK_MIN:  # frames of at most MAX_FRAME, each announced
                bulk = self._bulk

                def frame(piece: memoryview) -> None:
                    self._send(BULK, b"")
                    bulk.send(piece, self.call_timeout)

                SlurmWorker.moved["direct"] += transfer.write_framed(job, frame, slurm_bulk.MAX_FRAME, size)
                return
            # lines of at most JOB_CHUNK, each to the worker as it comes
            SlurmWorker.moved["stdio"] += transfer.write_framed(job, lambda piece: self._send(JOB, piece), JOB_CHUNK,
                                                                size)
        except TimeoutError:
            self._hang("take the cell's values on the direct channel")
        except (BrokenPipeError, ValueError, OSError):
            pass  # the step is gone: poll() says how

    def _open_bulk(self) -> None:
        """Open the direct channel once: listen on the address the node reaches this host on, send the relay the
        port and a new key on srun's stdin, accept its connection once it proved the key. Where it cannot be
        opened, the values go through srun's stdio (``bulk_error`` says why)."""
        if self._bulk_tried:
            return
        self._bulk_tried = True
        host = self._bulk_address or str(self.info.get("comm_host") or "")
        if not host:
            self.bulk_error = "the relay did not say which address its node reaches srun on (SLURM_SRUN_COMM_HOST)"
            return
        try:
            listener = slurm_bulk.Listener(host, self._bulk_ports)
        except OSError as e:
            self.bulk_error = f"cannot listen on {host}: {e}"
            return
        try:
            self._send(OPEN, json.dumps({"host": host, "port": listener.port, "key": listener.key.hex()}).encode())
            self._bulk = listener.accept(self.call_timeout, lambda: not self._opened.empty())
            answer = self._opened.get(timeout=self.call_timeout)
        except (OSError, queue.Empty) as e:
            answer = {"ok": False, "error": str(e)}
        finally:
            listener.close()
        if not answer.get("ok"):
            if self._bulk is not None:
                self._bulk.close()
                self._bulk = None
            self.bulk_error = f"the node did not connect to {host}:{listener.port}: {answer.get('error')}"

    # ---------------------------------------------------------------- output
    def _ended(self) -> bool:
        return self._done

    def _crashed(self) -> WorkerCrashed:
        if self._how:
            return WorkerCrashed(None, "", self._how)
        if self._worker_rc is None and self.proc.returncode is not None and self.proc.returncode < 0:
            # srun itself was killed (the worker's status never came): say so, not that the worker was
            sig = signal.Signals(-self.proc.returncode).name if -self.proc.returncode in signal.valid_signals() else ""
            return WorkerCrashed(None, self._tail(), f"lost its Slurm step before the cell finished: srun on this host was killed by "
                                                   f"{sig or 'a signal'}")
        return WorkerCrashed(self.returncode, self._tail())

    def _check_answering(self) -> None:
        """A relay quiet for a second (at most ``call_timeout`` / 2) is asked to answer; one that does not within
        ``call_timeout`` is taken for hung: srun is killed and the step cancelled."""
        if self._done:
            return
        now = time.monotonic()
        if self._pinged is None:
            if now - self._heard >= min(1.0, self.call_timeout / 2):
                self._pinged = now
                with contextlib.suppress(Exception):
                    self._send(PING, b"")
            return
        if now - self._pinged >= self.call_timeout:
            self._hang("answer")

    def _hang(self, what: str) -> None:
        """The relay did not ``what`` within ``call_timeout``: kill srun and cancel the step (in the background)."""
        if self._how:
            return
        step = (getattr(self, "info", None) or {}).get("step_id")
        self._how = (f"stopped answering: its relay in Slurm step {self.job_id}.{step} on {self.node} did not {what} "
                     f"within {self.call_timeout:g} s (SlurmExecutor.call_timeout), so srun was killed and the step "
                     "cancelled")
        self._done = True
        threading.Thread(target=self._stop_srun, daemon=True, name="gpulease-srun-stop").start()

    def _fetch(self, timeout: float, out: Sink, err: Sink) -> int:
        """Relay what the step sent; returns how many chunks of output (stdout/stderr) it brought."""
        if not self._inbox:
            self._check_answering()
            try:
                self._inbox.append(self.events.get(timeout=timeout) if timeout > 0 else self.events.get_nowait())
            except queue.Empty:
                return 0
            while True:
                try:
                    self._inbox.append(self.events.get_nowait())
                except queue.Empty:
                    break
        return self._relay(out, err)

    def _end(self, status: Any) -> None:
        self._done = True
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)

    def _tail(self) -> str:
        return self._stderr_tail.decode(errors="replace")

    # ---------------------------------------------------------------- stopping
    def interrupt(self) -> None:
        with contextlib.suppress(Exception):
            self._send(SIGNAL, json.dumps({"signal": int(signal.SIGINT)}).encode())

    def kill(self, grace: float = 2.0) -> None:
        with contextlib.suppress(Exception):
            self._send(KILL, json.dumps({"grace": grace}).encode())
        try:
            self.proc.wait(grace + 5.0 + self.call_timeout)  # the relay's kill: SIGTERM, SIGKILL after grace
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
        """Close the worker's lifeline (srun's stdin) and the direct channel; srun ends with the step."""
        self._done = self._done or self.proc.poll() is not None
        self._closed = True
        if self._bulk is not None:
            self._bulk.close()
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

    direct_channel = Bool(
        True,
        config=True,
        help="Whether values of 1 MiB and more to and from a node that does not see the shared artifact root go "
        "through a direct TCP connection from the node's relay to the kernel (a new key per worker sent on srun's "
        "stdin, every frame authenticated with HMAC-SHA256), e.g. True; False: through srun's own stdio (base64 "
        "lines, about 10 MB/s). Where the node cannot connect, srun's stdio is used all the same.",
    )

    bulk_address = Unicode(
        "",
        config=True,
        help="The address of this host the GPU nodes connect to for the direct channel, e.g. 10.0.0.5; '': the "
        "address srun tells the step it reaches srun on ($SLURM_SRUN_COMM_HOST).",
    )

    bulk_ports = Unicode(
        "",
        config=True,
        help="The ports the kernel may listen on for the direct channel, as low-high (e.g. 60001-60100, to open "
        "in a firewall between the GPU nodes and the notebook hosts); '': any free ephemeral port.",
    )

    keep_warm = Bool(
        True,
        config=True,
        help="Whether a lease that runs several calls one after another (the Python API's lease().run, map) has "
        "the step of its next call started while the current one runs, so that the next call finds its relay and "
        "a fresh worker running instead of waiting for srun; from the lease's second call on, one step at most, "
        "ended with the lease (its allocation's scancel), e.g. True. A %%gpu cell's lease ends with the cell, so "
        "nothing is kept for it (--session keeps its worker anyway).",
    )

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._lock = threading.Lock()
        self._spares: dict[tuple[str, str | None, tuple[str, ...]], _Spare] = {}  # the next call's step, started
        self._used: dict[str, None] = {}  # leases this executor started a worker for (the latest few)

    @validate("bulk_ports")
    def _check_ports(self, proposal: Any) -> str:
        value = str(proposal["value"]).strip()
        if value and _port_range(value) is None:
            raise TraitError(f"SlurmExecutor.bulk_ports must be low-high (e.g. 60001-60100), not {value!r}")
        return value

    def worker(self, lease: LeaseView, python: str | None, preload: list[str] | None,
               session: bool) -> SlurmWorker:
        """A worker in a step of the lease's allocation: the one started for this call already (``keep_warm``),
        else a new step; a lease's second call on also starts the step of its next call."""
        key = (lease.id, python, tuple(preload or ()))
        with self._lock:
            self._sweep()
            spare = None if session else self._spares.pop(key, None)
            again = lease.id in self._used
            self._used[lease.id] = None
            while len(self._used) > 64:
                del self._used[next(iter(self._used))]
        worker = spare.take() if spare is not None else None
        if worker is None:
            worker = self._new(lease, python, preload, session)
        if again and not session and self.keep_warm:
            with self._lock:
                if key not in self._spares:
                    self._spares[key] = _Spare(lambda: self._new(lease, python, preload, False))
        return worker

    def _new(self, lease: LeaseView, python: str | None, preload: list[str] | None, session: bool) -> SlurmWorker:
        assert lease.placement is not None
        return SlurmWorker(lease.placement, python, preload, session=session, start_timeout=self.start_timeout,
                           call_timeout=self.call_timeout, direct=self.direct_channel, bulk_address=self.bulk_address,
                           bulk_ports=_port_range(self.bulk_ports))

    def _sweep(self) -> None:
        """Let go of the started steps whose lease ended (its scancel ended them) or that failed to start."""
        for key, spare in list(self._spares.items()):
            if spare.gone():
                del self._spares[key]
                spare.close()

    def shutdown(self) -> None:
        with self._lock:
            spares, self._spares = list(self._spares.values()), {}
        for spare in spares:
            spare.close()


class _Spare:
    """A worker of a lease's next call, being started in the background (``SlurmExecutor.keep_warm``)."""

    def __init__(self, start: Callable[[], SlurmWorker]) -> None:
        self._worker: SlurmWorker | None = None
        self._thread = threading.Thread(target=self._start, args=(start,), daemon=True, name="gpulease-srun-warm")
        self._thread.start()

    def _start(self, start: Callable[[], SlurmWorker]) -> None:
        with contextlib.suppress(Exception):  # (the lease ended meanwhile: its next call starts a step of its own)
            self._worker = start()

    def take(self) -> SlurmWorker | None:
        """The started worker (waiting for its start to end), or None where it did not start or has ended."""
        self._thread.join()
        if self._worker is not None and not self._worker.alive():
            self.close()
        return self._worker

    def gone(self) -> bool:
        return not self._thread.is_alive() and (self._worker is None or not self._worker.alive())

    def close(self) -> None:
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.close()


def _port_range(text: str) -> tuple[int, int] | None:
    low, sep, high = text.strip().partition("-")
    try:
        ports = (int(low), int(high or low))
    except ValueError:
        return None
    return ports if 0 < ports[0] <= ports[1] < 65536 else None
