"""The local executor: a ``%%gpu`` cell's worker as a child process of the kernel, on this host.

A worker is a fresh Python process in its own session (so the kernel's interrupt does
not reach it unasked). Its stdout and stderr are pipes the kernel forwards chunk by
chunk (``\\r`` progress bars intact); a third pipe carries framed results. Its stdin
is its lifeline: if the kernel dies, the pipe closes and the worker kills itself.
A ``WarmPool`` keeps single-use workers started ahead of the next lease.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from ..wire import fastpath, transfer
from ..worker import ckpt_pool
from ..worker.env import worker_env
from .base import Executor, OutputDecoder, Sink, Worker, WorkerCrashed

if TYPE_CHECKING:
    from ..lease_view import LeaseView


class LocalWorker(Worker):
    """A worker process on this host, a child of the kernel."""

    local = True  # a process of this host, child of the kernel: attached to the lease by pid

    def __init__(self, python: str | None = None, preload: list[str] | None = None, session: bool = False) -> None:
        r, w = os.pipe()
        env = ckpt_pool.preload_env(worker_env({"GPULEASE_CTRL_FD": str(w)}))
        cmd = [python or sys.executable, "-m", "jupyter_gpulease.worker"]
        if session:
            cmd.append("--session")
        if preload:
            cmd += ["--preload", ",".join(preload)]
        try:
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(w,),
                env=env, start_new_session=True, close_fds=True,
            )
        finally:
            os.close(w)
        self.pid = self.proc.pid
        self.ctrl = r
        self.ready: dict[str, Any] | None = None
        self._frames = transfer.FrameReader()
        self._results: list[dict[str, Any]] = []
        self._stderr_tail = b""
        self._decoders = {1: OutputDecoder(), 2: OutputDecoder()}
        self._sel = selectors.DefaultSelector()
        assert self.proc.stdout is not None and self.proc.stderr is not None
        for f, tag in ((self.proc.stdout, 1), (self.proc.stderr, 2), (r, 3)):
            os.set_blocking(f if isinstance(f, int) else f.fileno(), False)
            self._sel.register(f, selectors.EVENT_READ, tag)

    # ---------------------------------------------------------------- state
    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def submit(self, job: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        transfer.send(self.proc.stdin, job)

    # ---------------------------------------------------------------- output
    def poll(self, timeout: float | None, out: Sink, err: Sink) -> dict[str, Any] | None:
        """Forward what the worker wrote; return its result message when one arrives.

        Raises WorkerCrashed when every pipe is closed without a result.
        """
        if self._results:
            return self._results.pop(0)
        if not self._sel.get_map():
            raise WorkerCrashed(self._exit_status(), self._stderr_tail.decode(errors="replace"))
        for key, _ in self._sel.select(timeout):
            self._read(key, out, err)
        if self._results:
            result = self._results.pop(0)
            self._drain(out, err)  # the worker flushed before it answered: take the rest now
            return result
        return None

    def _drain(self, out: Sink, err: Sink) -> None:
        """Forward what output already arrived, without waiting."""
        while self._sel.get_map():
            ready = self._sel.select(0)
            if not ready:
                break
            for key, _ in ready:
                self._read(key, out, err)

    def _read(self, key: selectors.SelectorKey, out: Sink, err: Sink) -> None:
        fd = key.fd
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        if not data:
            self._sel.unregister(key.fileobj)
            if key.data == 3:
                os.close(fd)
            return
        if key.data == 3:
            for msg in self._frames.feed(data):
                if msg.get("type") == "ready":
                    self.ready = msg
                else:
                    self._results.append(msg)
            return
        if key.data == 2:
            self._stderr_tail = (self._stderr_tail + data)[-4000:]
        text = self._decoders[key.data].decode(data)
        if text:
            (out if key.data == 1 else err)(text)

    def _exit_status(self) -> int | None:
        try:
            return self.proc.wait(5)
        except subprocess.TimeoutExpired:
            return None

    # ---------------------------------------------------------------- stopping
    def interrupt(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGINT)

    def kill(self, grace: float = 2.0) -> None:
        """SIGTERM the worker's process group, SIGKILL after ``grace`` seconds."""
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, sig)
            try:
                self.proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        self.close()

    def wait_exit(self, timeout: float = 5.0) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill(0.5)
            return self.proc.returncode

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if self.proc.stdin:
                self.proc.stdin.close()
        keys = self._sel.get_map()  # None once closed: close() may run twice (kill, then the run's end)
        for key in list(keys.values()) if keys is not None else []:
            self._sel.unregister(key.fileobj)
            if key.data == 3:
                with contextlib.suppress(OSError):
                    os.close(key.fd)
        self._sel.close()
        for f in (self.proc.stdout, self.proc.stderr):
            with contextlib.suppress(Exception):
                f.close()  # type: ignore[union-attr]


class WarmPool:
    """Keeps ``size`` pre-started, single-use workers with the preloaded modules imported.

    A worker taken for a cell is replaced after the cell (``fill(delay)``), not while it runs: starting an
    interpreter would take a core from the cell and the kernel's answer. A new worker is also told what to hold
    (``fastpath.hold_message``): memory for the next cell's large inputs and results, faulted in while it waits.
    """

    def __init__(self, python: str | None = None, preload: list[str] | None = None, size: int = 1) -> None:
        self.python, self.preload, self.size = python, list(preload or []), size
        self._idle: list[LocalWorker] = []
        self._lock = threading.Lock()
        self._filling = False

    def take(self) -> tuple[LocalWorker, bool]:
        """A worker (warm if one is ready, else a cold one without preloads). Returns (worker, was_warm)."""
        with self._lock:
            while self._idle:
                w = self._idle.pop(0)
                if w.alive():
                    return w, True
                w.close()
        return LocalWorker(self.python), False  # cold: nothing preloaded on the critical path

    def fill(self, delay: float = 0.0) -> None:
        """Start workers until ``size`` wait, in the background, after ``delay`` seconds."""
        with self._lock:
            if self.size <= 0 or self._filling or len(self._idle) >= self.size:
                return
            self._filling = True
        fastpath.later(self._refill, delay)  # a thread that is already running: starting one would hold up the cell's answer

    def _refill(self, delay: float) -> None:
        try:
            if delay > 0:
                time.sleep(delay)
            while True:
                with self._lock:
                    if len(self._idle) >= self.size:
                        return
                w = LocalWorker(self.python, self.preload)
                hold = fastpath.hold_message()
                if hold is not None:
                    w.submit(hold)
                with self._lock:
                    self._idle.append(w)
        except Exception:
            return
        finally:
            self._filling = False

    def shutdown(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for w in idle:
            w.kill(0.5)


class LocalExecutor(Executor):
    """Workers on this host (a lease without a placement): single-use ones from the warm pool, when the
    magics keep one (``GpuMagics.warm_workers``), session ones started for the session."""

    kind = "local"

    def __init__(self, pool: WarmPool | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pool = pool

    def start(self, lease: LeaseView | None = None, python: str | None = None, preload: list[str] | None = None,
              session: bool = False) -> LocalWorker:
        if self.pool is not None and not session:
            return self.pool.take()[0]
        return LocalWorker(python, preload, session=session)

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()
