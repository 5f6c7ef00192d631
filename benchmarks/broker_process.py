"""A real broker process on a Unix socket for the benchmarks, and a minimal asyncio HTTP/1.1 client for it (no
dependencies), with what several benchmark modules share: leases made through the API or written to a stopped
broker's store, and a process's CPU time."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = str(Path(__file__).resolve().parent.parent)  # so that ``python -m benchmarks.noop_broker`` is found


class Broker:
    """A real broker process on a Unix socket in a temporary directory."""

    def __init__(self, workdir: str, gpus: int, nodes: int, module: str = "lease_broker") -> None:
        """``module``: what ``python -m`` runs (``benchmarks.noop_broker``: the broker with a no-op endpoint)."""
        self.workdir = workdir
        self.module = module
        self.socket = os.path.join(workdir, "b.sock")
        self.db = os.path.join(workdir, "leases.db")
        self.args = ["--inventory=simulated", f"--gpus={gpus}", f"--nodes={nodes}", f"--socket={self.socket}",
                     f"--db={self.db}", "--log-level=WARN"]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 120.0) -> float:
        """Start; returns seconds from process start to the first successful ``GET /api/v1/info``."""
        log = open(os.path.join(self.workdir, "broker.log"), "ab")
        started = time.perf_counter()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
        self.proc = subprocess.Popen([sys.executable, "-m", self.module, *self.args], stdout=log,
                                     stderr=subprocess.STDOUT, cwd=self.workdir, start_new_session=True, env=env)
        while time.perf_counter() - started < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"broker exited with {self.proc.returncode}: see {self.workdir}/broker.log")
            if os.path.exists(self.socket) and probe_info(self.socket):
                return time.perf_counter() - started
            time.sleep(0.002)
        raise RuntimeError(f"broker did not serve within {timeout} s")

    def rss_bytes(self) -> int:
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def stop(self) -> None:
        stop_process(self.proc)


def probe_info(path: str) -> bool:
    import socket

    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(path)
            s.sendall(b"GET /api/v1/info HTTP/1.1\r\nHost: localhost\r\n\r\n")
            return s.recv(64).startswith(b"HTTP/1.1 200")
    except OSError:
        return False


class Conn:
    """One keep-alive HTTP/1.1 connection to the broker (asyncio, no dependencies); with a bearer token over
    TCP."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, token: str | None = None) -> None:
        self.reader, self.writer = reader, writer
        self.auth = f"Authorization: Bearer {token}\r\n" if token else ""

    @classmethod
    async def open(cls, path: str) -> "Conn":
        reader, writer = await asyncio.open_unix_connection(path, limit=1 << 24)
        return cls(reader, writer)

    async def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else b""
        head = f"{method} {path} HTTP/1.1\r\nHost: localhost\r\n{self.auth}Content-Length: {len(data)}\r\n"
        if data:
            head += "Content-Type: application/json\r\n"
        self.writer.write(head.encode() + b"\r\n" + data)
        raw = await self.reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        length = 0
        for line in lines[1:]:
            if line.lower().startswith("content-length:"):
                length = int(line.split(":", 1)[1])
        payload = await self.reader.readexactly(length) if length else b""
        return status, json.loads(payload) if payload else None

    def close(self) -> None:
        self.writer.close()


async def create_leases(path: str, count: int, concurrency: int = 8) -> list[str]:
    """``count`` granted 1-GPU leases without heartbeats and with long time limits."""
    ids: list[str] = []
    todo = iter(range(count))

    async def worker() -> None:
        conn = await Conn.open(path)
        try:
            for _ in todo:
                status, lease = await conn.call("POST", "/api/v1/leases",
                                                {"gpus": 1, "heartbeat": False, "duration_seconds": "8h",
                                                 "idle_timeout_seconds": "1h"})
                if status != 201:
                    raise RuntimeError(f"lease {len(ids)} not granted: {status} {lease}")
                ids.append(lease["id"])
        finally:
            conn.close()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ids


def fill_store(db: str, gpus: int, nodes: int, count: int) -> None:
    """Write ``count`` granted 1-GPU leases into a stopped broker's store, as the broker would persist them."""
    from lease_broker.core.identity import hash_secret
    from lease_broker.core.lease import Lease, LeaseRequest, LeaseState
    from lease_broker.host.users import user_name
    from lease_broker.inventory.simulated import SimulatedInventory
    from lease_broker.store.lease_store import Store

    devices = SimulatedInventory(gpus=gpus, nodes=nodes).discover()
    store = Store(db)
    now = time.time()
    seq = store.next_seq()
    uid = os.getuid()
    try:
        for i in range(count):
            g = devices[i]
            lease = Lease(id=f"l-{i:012x}", user=user_name(uid), uid=uid, request=LeaseRequest(heartbeat=False),
                          state=LeaseState.QUEUED, created_at=now, seq=seq + i, reason="requested",
                          duration_seconds=28800.0, idle_timeout_seconds=3600.0, last_heartbeat=now,
                          last_activity=now, secret_hash=hash_secret(f"s{i}"))
            store.insert(lease, now)
            lease.state, lease.reason, lease.devices, lease.node = LeaseState.GRANTED, "granted", [g.id], g.node
            lease.granted_at, lease.expires_at = now, now + 28800.0
            store.transition(lease, LeaseState.QUEUED, now)
    finally:
        store.close()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stop_process(proc: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM a broker process and wait for it; SIGKILL it if it has not exited within 30 s."""
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
