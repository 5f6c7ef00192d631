"""An embedded per-user broker: a `lease-broker` subprocess owned by this Jupyter server.

Started only when no broker is configured and none answers; it serves real GPUs when an NVIDIA
driver is present (``--inventory=auto``), else simulated ones, which the broker labels simulated.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys

from gpulease_protocol.private import private_dir


class EmbeddedBrokerError(RuntimeError):
    """The embedded broker did not start: its exit ``code`` (None: still running, stopped) and ``reason`` slug."""

    def __init__(self, message: str, code: int | None = None, reason: str = "startup") -> None:
        super().__init__(message)
        self.code, self.reason = code, reason


class EmbeddedBroker:
    """Start and stop one broker subprocess on a Unix socket."""

    def __init__(self, socket_path: str, gpus: int, log: logging.Logger, startup_timeout: float = 30.0) -> None:
        self.socket_path = socket_path
        self.gpus = gpus
        self.log = log
        self.startup_timeout = startup_timeout
        self.workdir = os.path.dirname(socket_path)
        self.log_path = os.path.join(self.workdir, "broker.log")
        self.proc: subprocess.Popen[bytes] | None = None
        self.inventory = ""

    @property
    def url(self) -> str:
        return "unix://" + self.socket_path

    def start(self) -> str:
        """Start the broker and wait until it says it serves; return the inventory it serves ('nvml' or 'simulated')."""
        try:  # the per-user directory: 0700 and ours, never one another user made first (its log and store go there)
            private_dir(self.workdir)
        except OSError as e:
            raise EmbeddedBrokerError(str(e)) from e
        for inventory in ("auto", "simulated"):
            args = [f"--inventory={inventory}"]
            if inventory == "simulated":
                args.append(f"--gpus={self.gpus}")
            if self._start(args):
                self.inventory = inventory
                self.log.info("Embedded lease broker %s started at %s (pid %s, inventory %s; log %s)",
                              "simulated" if inventory == "simulated" else "", self.url, self.proc and self.proc.pid,
                              inventory, self.log_path)
                return inventory
        raise EmbeddedBrokerError("unreachable")  # pragma: no cover - _start raises on the last try

    def _start(self, args: list[str]) -> bool:
        """Start the broker with ``args`` and wait for the one JSON line it writes on ``--ready-fd`` (the
        ``LeaseBroker.ready_fd`` contract): True once it serves; False when ``--inventory=auto`` finds no NVIDIA
        driver (reason ``no_driver``); any other failure raises with the broker's exit code and reason."""
        read_end, write_end = os.pipe()
        cmd = [sys.executable, "-m", "lease_broker", f"--socket={self.socket_path}",
               f"--db={os.path.join(self.workdir, 'leases.db')}", f"--ready-fd={write_end}", *args]
        env = {k: v for k, v in os.environ.items() if k != "GPULEASE_BROKER"}
        try:
            with open(self.log_path, "ab") as out:
                self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             env=env, cwd=self.workdir, start_new_session=True, pass_fds=(write_end,))
        finally:
            os.close(write_end)
        with os.fdopen(read_end, "rb") as status_pipe:
            ready, _, _ = select.select([status_pipe], [], [], self.startup_timeout)
            line = status_pipe.readline() if ready else None
        if line is None:
            self.stop()
            raise EmbeddedBrokerError(f"The embedded lease broker did not start within {self.startup_timeout:g} s; "
                                      f"see {self.log_path}")
        try:
            status = json.loads(line) if line.strip() else {}
        except ValueError:
            status = {}
        if status.get("ready") is True:
            return True
        try:
            code = self.proc.wait(self.startup_timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            code = None
        if "--inventory=auto" in args and status.get("reason") == "no_driver":
            self.log.info("No NVIDIA driver on this host: the embedded broker serves %d simulated GPUs", self.gpus)
            return False
        raise EmbeddedBrokerError(
            f"The embedded lease broker exited with code {code}: "
            f"{status.get('message') or 'it gave no reason'} (reason {status.get('reason', 'unknown')}; log "
            f"{self.log_path}). Set GpuLease.broker_url to use another broker, or GpuLease.embedded_broker=False",
            code, status.get("reason", "unknown"))

    def stop(self, timeout: float = 10.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        self.log.info("Stopping the embedded lease broker (pid %s)", proc.pid)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.log.error("The embedded lease broker (pid %s) ignored SIGTERM; killing it", proc.pid)
            proc.kill()
            proc.wait(5)
