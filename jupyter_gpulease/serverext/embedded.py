"""An embedded per-user broker: a `lease-broker` subprocess owned by this Jupyter server.

Started only when no broker is configured and none answers; it serves real GPUs when an NVIDIA
driver is present (``--inventory=auto``), else simulated ones, which the broker labels simulated.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

from gpulease_protocol.private import private_dir

from ..client import BrokerClient, BrokerError


class EmbeddedBrokerError(RuntimeError):
    pass


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
        """Start the broker and wait until it answers; return the inventory it serves ('nvml' or 'simulated')."""
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
        cmd = [sys.executable, "-m", "lease_broker", f"--socket={self.socket_path}",
               f"--db={os.path.join(self.workdir, 'leases.db')}", *args]
        env = {k: v for k, v in os.environ.items() if k != "GPULEASE_BROKER"}
        start_at = os.path.getsize(self.log_path) if os.path.exists(self.log_path) else 0
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, cwd=self.workdir, start_new_session=True)
        client = BrokerClient(self.url, timeout=2.0)
        deadline = time.monotonic() + self.startup_timeout
        try:
            while time.monotonic() < deadline:
                code = self.proc.poll()
                if code is not None:
                    output = self._log_since(start_at)
                    if "--inventory=auto" in args and ("NVIDIA driver" in output or "no_driver" in output):
                        self.log.info("No NVIDIA driver on this host: the embedded broker serves %d simulated GPUs",
                                      self.gpus)
                        return False
                    raise EmbeddedBrokerError(
                        f"The embedded lease broker exited with code {code}: {output.strip()[-800:]} "
                        "(set GpuLease.broker_url to use another broker, or GpuLease.embedded_broker=False)"
                    )
                if os.path.exists(self.socket_path):
                    try:
                        client.info()
                        return True
                    except BrokerError:
                        pass
                time.sleep(0.05)
        finally:
            client.close()
        self.stop()
        raise EmbeddedBrokerError(
            f"The embedded lease broker did not answer at {self.url} within {self.startup_timeout:g} s; "
            f"see {self.log_path}"
        )

    def _log_since(self, offset: int) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

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
