"""Kernel side of a GPU worker: start it, send it a job, forward its output live, stop it.

A worker is a fresh Python process in its own session (so the kernel's interrupt does
not reach it unasked). Its stdout and stderr are pipes the kernel forwards chunk by
chunk (``\\r`` progress bars intact); a third pipe carries framed results. Its stdin
is its lifeline: if the kernel dies, the pipe closes and the worker kills itself.
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
from collections.abc import Callable
from typing import Any

from . import transfer

# What a worker must not inherit from a kernel (see notes: unbuffered output splits
# every print, the inline matplotlib backend does not exist outside the kernel).
_DROP_ENV = ("PYTHONUNBUFFERED", "MPLBACKEND", "JPY_PARENT_PID", "JPY_SESSION_NAME", "PYDEVD_USE_FRAME_EVAL",
             "FORCE_COLOR", "CLICOLOR", "CLICOLOR_FORCE", "TERM")

Sink = Callable[[str], None]


class WorkerCrashed(Exception):
    """The worker process ended without handing back a result."""

    def __init__(self, status: int | None, stderr_tail: str) -> None:
        self.status, self.stderr_tail = status, stderr_tail
        how = _describe_status(status)
        tail = f"\nLast lines of its stderr:\n{stderr_tail.rstrip()}" if stderr_tail.strip() else ""
        super().__init__(f"The GPU worker {how} before the cell finished.{tail}")


class RelayedPoll:
    """``poll()`` for workers whose output and results reach the kernel through a relay that reads the
    worker's pipes in separate threads (a Ray actor, a Slurm step): the worker flushed its output before it
    answered, so what is still on the way is taken before the result, and the cell's last lines never
    arrive after it (in the next cell)."""

    _results: list[dict[str, Any]]

    def _ended(self) -> bool:
        raise NotImplementedError

    def _crashed(self) -> WorkerCrashed:
        raise NotImplementedError

    def _fetch(self, timeout: float, out: Sink, err: Sink) -> int:
        """Relay what arrived within ``timeout``; returns how many chunks of output it brought."""
        raise NotImplementedError

    def poll(self, timeout: float | None, out: Sink, err: Sink) -> dict[str, Any] | None:
        if not self._results:
            if self._ended():
                raise self._crashed()
            self._fetch(0.5 if timeout is None else timeout, out, err)
        if not self._results:
            return None
        for _ in range(20):  # settle: at most ~50 ms once nothing more comes
            if self._ended() or not self._fetch(0.05, out, err):
                break
        return self._results.pop(0)


def _describe_status(status: int | None) -> str:
    if status is None:
        return "vanished"
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = f"signal {-status}"
        return f"was killed by {name}"
    return f"exited with status {status}"


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _DROP_ENV}
    env["MPLBACKEND"] = "Agg"
    env["CUDA_VISIBLE_DEVICES"] = ""  # nothing visible until a lease says which GPUs
    env.update(extra or {})
    return env


class Worker:
    """A worker process on this host. Other executors (e.g. a Ray actor on another node) offer the
    same methods: submit, poll, drain, interrupt, kill, wait_exit, alive, close, returncode."""

    local = True  # a process of this host, child of the kernel: attached to the lease by pid

    def __init__(self, python: str | None = None, preload: list[str] | None = None, session: bool = False) -> None:
        r, w = os.pipe()
        env = worker_env({"GPULEASE_CTRL_FD": str(w)})
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
        self.started = time.monotonic()
        self._frames = transfer.FrameReader()
        self._results: list[dict[str, Any]] = []
        self._stderr_tail = b""
        self._decoders = {1: _Decoder(), 2: _Decoder()}
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
            self.drain(out, err)  # the worker flushed before it answered: take the rest now
            return result
        return None

    def drain(self, out: Sink, err: Sink) -> None:
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


class _Decoder:
    """UTF-8 across chunk boundaries."""

    def __init__(self) -> None:
        import codecs

        self._d = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def decode(self, data: bytes) -> str:
        return self._d.decode(data)


class WarmPool:
    """Keeps ``size`` pre-started, single-use workers with the preloaded modules imported."""

    def __init__(self, python: str | None = None, preload: list[str] | None = None, size: int = 1) -> None:
        self.python, self.preload, self.size = python, list(preload or []), size
        self._idle: list[Worker] = []
        self._lock = threading.Lock()
        self._filling = False

    def take(self) -> tuple[Worker, bool]:
        """A worker (warm if one is ready); refills in the background. Returns (worker, was_warm)."""
        with self._lock:
            while self._idle:
                w = self._idle.pop(0)
                if w.alive():
                    self._refill_later()
                    return w, True
                w.close()
        self._refill_later()
        return Worker(self.python), False  # cold: nothing preloaded on the critical path

    def _refill_later(self) -> None:
        if self.size <= 0 or self._filling:
            return
        self._filling = True
        threading.Thread(target=self._refill, name="gpulease-warm-pool", daemon=True).start()

    def _refill(self) -> None:
        try:
            while True:
                with self._lock:
                    if len(self._idle) >= self.size:
                        return
                w = Worker(self.python, self.preload)
                with self._lock:
                    self._idle.append(w)
        except Exception:
            return
        finally:
            self._filling = False

    def fill(self) -> None:
        self._refill_later()

    def shutdown(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for w in idle:
            w.kill(0.5)
