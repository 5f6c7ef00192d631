"""A real `lease-broker` process on a Unix socket, for tests and benchmarks."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from jupyter_gpulease.client import BrokerClient, BrokerError


class BrokerProcess:
    """Start, kill -9 and restart a real broker with a simulated (or any) inventory."""

    def __init__(self, workdir: Path, gpus: int = 4, nodes: int = 1, args: list[str] | None = None,
                 env: dict[str, str] | None = None, socket_path: str | None = None,
                 preexec_fn: Callable[[], None] | None = None) -> None:
        self.preexec_fn = preexec_fn  # run in the broker's process before it starts (e.g. a lower limit of open files)
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        # Unix socket paths are limited to 107 bytes: keep it short
        self.socket = socket_path or str(self.workdir / "b.sock")
        if len(self.socket) > 100:
            import tempfile

            self.socket = os.path.join(tempfile.mkdtemp(prefix="gl"), "b.sock")
        self.db = str(self.workdir / "leases.db")
        self.url = "unix://" + self.socket
        chosen = any(a.startswith(("--inventory=", "--LeaseBroker.inventory_class=")) for a in args or [])
        self.args = [*([] if chosen else ["--inventory=simulated"]), f"--gpus={gpus}", f"--nodes={nodes}", *(args or [])]
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.workdir / "broker.log"

    def start(self, timeout: float = 20.0) -> "BrokerProcess":
        cmd = [sys.executable, "-m", "lease_broker", f"--socket={self.socket}", f"--db={self.db}",
               "--log-level=DEBUG", *self.args]
        log = open(self.log_path, "ab")
        env = {**os.environ, **(self.env or {})}
        env.pop("GPULEASE_BROKER", None)
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.workdir,
                                     start_new_session=True, preexec_fn=self.preexec_fn)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"broker exited with {self.proc.returncode}:\n{self.log()}")
            if os.path.exists(self.socket):
                try:
                    BrokerClient(self.url, timeout=2).info()
                    return self
                except BrokerError as e:
                    if e.reason != "unreachable":  # answering, e.g. 401 to no token with identity 'hub'
                        return self
                except Exception:
                    pass
            time.sleep(0.02)
        raise RuntimeError(f"broker did not start within {timeout} s:\n{self.log()}")

    def client(self, **kw: object) -> BrokerClient:
        return BrokerClient(self.url, **kw)  # type: ignore[arg-type]

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-5000:]
        except FileNotFoundError:
            return ""

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None:
            self._account()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def _account(self) -> None:
        """For BENCHMARKS.md's reliability section (``GPULEASE_ATTACK_LOG``, set by ``make soak``): what this broker
        answered with 5xx, the tracebacks it logged, and whether it died of a signal before it was stopped."""
        path = os.environ.get("GPULEASE_ATTACK_LOG")
        if not path or self.proc is None:
            return
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        import re

        record = {"test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0],
                  # 503 is the broker's designed answer while what it needs (the Hub, the store) is away: apart
                  "answers_5xx": len(re.findall(r"^\[\S+ W [^\]]*\] 5(?!03)\d\d (?:GET|POST|PUT|PATCH|DELETE) ",
                                                text, re.M)),
                  "answers_503": len(re.findall(r"^\[\S+ W [^\]]*\] 503 (?:GET|POST|PUT|PATCH|DELETE) ", text, re.M)),
                  "tracebacks": text.count("Traceback (most recent call last)"),
                  # died of a signal nobody sent (a refusal to start exits 1 or 2, with no traceback)
                  "crashed": int(self.proc.poll() is not None and self.proc.returncode < 0
                                 and self.proc.returncode not in (-9, -15))}
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def restart(self) -> "BrokerProcess":
        self.stop()
        return self.start()


def scrape_metrics(socket_path: str) -> str:
    """GET /metrics over the broker's Unix socket (Prometheus text)."""

    class Conn(http.client.HTTPConnection):
        def connect(self) -> None:
            self.sock = socket.socket(socket.AF_UNIX)
            self.sock.connect(socket_path)

    conn = Conn("localhost")
    conn.request("GET", "/metrics")
    return conn.getresponse().read().decode()


def raw_request(sock_path: str, data: bytes) -> tuple[int, dict]:
    s = socket.socket(socket.AF_UNIX)
    s.connect(sock_path)
    s.sendall(data)
    buf = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        buf += chunk
        if b"\r\n\r\n" in buf:
            head, _, body = buf.partition(b"\r\n\r\n")
            length = int([h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")][0])
            if len(body) >= length:
                break
    s.close()
    head, _, body = buf.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def free_port() -> int:
    """A TCP port free on the loopback now (for a broker's --port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def issue_token(db: str, user: str, *args: str) -> str:
    """A broker token for ``user`` (``lease-broker token create``; ``args``: e.g. ``--admin``) in the store ``db``."""
    return subprocess.run([sys.executable, "-m", "lease_broker", "token", "create", user, *args, f"--db={db}"],
                          capture_output=True, text=True, check=True).stdout.strip()
