"""The load test's machinery: a real broker, keep-alive HTTP clients, a monitor (see ``benchmarks.load``).

Each client is one keep-alive HTTP/1.1 connection in one asyncio process, on the broker's Unix socket or
over TCP with a bearer token; what they saw goes into a :class:`~benchmarks.load_checks.LoadResult`.
"""

from __future__ import annotations

import asyncio
import os
import random
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import broker_process
from .load_checks import LoadResult, Witness

TIMEOUT = 60.0  # seconds for one request; more is an error
WAIT = 5.0  # a queued request waits with GET /leases/ID?wait=WAIT, again and again until granted


@dataclass
class LoadConfig:
    clients: int = 1000
    seconds: float = 60.0
    gpus: int = 512
    nodes: int = 64
    users: int = 100  # token users over TCP (the Unix-socket half is this process's user)
    tcp_share: float = 0.5
    hold_ms: tuple[float, float] = (100.0, 1000.0)
    think_ms: tuple[float, float] = (500.0, 5000.0)
    seed: int = 1


# ---------------------------------------------------------------------------------------------- broker
class LoadBroker:
    """A real broker with a simulated inventory on a Unix socket and a TCP port, with token users."""

    def __init__(self, workdir: str, cfg: LoadConfig) -> None:
        self.workdir = workdir
        os.makedirs(workdir, exist_ok=True)
        self.socket = os.path.join(workdir, "b.sock")
        self.db = os.path.join(workdir, "leases.db")
        self.log_path = os.path.join(workdir, "broker.log")
        self.port = _free_port()
        self.tokens = self._tokens(cfg.users)
        self.args = ["--inventory=simulated", f"--gpus={cfg.gpus}", f"--nodes={cfg.nodes}",
                     f"--socket={self.socket}", f"--db={self.db}", f"--port={self.port}", "--log-level=INFO",
                     "--tick=0.5"]
        self.proc: subprocess.Popen[bytes] | None = None

    def _tokens(self, users: int) -> dict[str, str]:
        from lease_broker.core.identity import hash_secret, new_token
        from lease_broker.store.lease_store import Store

        store = Store(self.db)
        tokens = {}
        for u in range(users):
            token = new_token()
            store.add_token(hash_secret(token), f"load{u:03d}", False, time.time(), "load test")
            tokens[f"load{u:03d}"] = token
        store.db.close()
        return tokens

    def start(self, timeout: float = 60.0) -> None:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "lease_broker", *self.args], stdout=log,
                                     stderr=subprocess.STDOUT, cwd=self.workdir, start_new_session=True)
        deadline = time.monotonic() + timeout
        from .broker_process import probe_info

        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"broker exited with {self.proc.returncode}: {self.log()[-2000:]}")
            if os.path.exists(self.socket) and probe_info(self.socket):
                return
            time.sleep(0.02)
        raise RuntimeError(f"broker did not serve within {timeout} s")

    def cpu_seconds(self) -> float:
        assert self.proc is not None
        return broker_process.cpu_seconds(self.proc.pid)

    def log(self) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self) -> None:
        broker_process.stop_process(self.proc)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _raise_fd_limit(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = need if hard == resource.RLIM_INFINITY else min(need, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))  # the broker inherits it


# ---------------------------------------------------------------------------------------------- HTTP
class Conn(broker_process.Conn):
    """One keep-alive HTTP/1.1 connection (Unix socket, or TCP with a bearer token); every call times out."""

    @classmethod
    async def connect(cls, unix: str | None, port: int, token: str | None) -> "Conn":
        if unix is not None:
            reader, writer = await asyncio.open_unix_connection(unix, limit=1 << 22)
        else:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 22)
        return cls(reader, writer, token)

    async def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        return await asyncio.wait_for(super().call(method, path, body), TIMEOUT)


# ---------------------------------------------------------------------------------------------- the clients
def _request_body(rng: random.Random, heartbeat: bool) -> dict[str, Any]:
    x = rng.random()
    gpus: Any = 1 if x < 0.75 else 2 if x < 0.85 else 4 if x < 0.90 else rng.choice([0.25, 0.5])
    return {"gpus": gpus, "heartbeat": heartbeat, "duration_seconds": 600, "labels": {"source": "load"}}


async def _client(i: int, cfg: LoadConfig, broker: LoadBroker, deadline: float, r: LoadResult, w: Witness,
                   seen: dict[str, str], gate: asyncio.Semaphore) -> None:
    rng = random.Random(cfg.seed * 100003 + i)
    tcp = (i % 20) < cfg.tcp_share * 20 and broker.tokens  # interleaved: clients arrive mixed
    token = broker.tokens[sorted(broker.tokens)[i % len(broker.tokens)]] if tcp else None
    async with gate:  # connect in a ramp: at most 50 handshakes at once
        try:
            conn = await asyncio.wait_for(Conn.connect(None if tcp else broker.socket, broker.port, token), TIMEOUT)
        except (OSError, asyncio.TimeoutError) as e:
            r.errors.append(f"client {i}: connect: {e!r}")
            return
    try:
        await asyncio.sleep(rng.uniform(0, cfg.think_ms[1]) / 1000)  # clients arrive over the first seconds
        while time.monotonic() < deadline:
            if not await _one_lease(conn, rng, cfg, deadline, r, w, seen):
                return
            await asyncio.sleep(min(rng.uniform(*cfg.think_ms) / 1000, max(0.0, deadline - time.monotonic())))
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError, ValueError) as e:
        r.errors.append(f"client {i}: {type(e).__name__}: {e}")
    finally:
        conn.close()


async def _one_lease(conn: Conn, rng: random.Random, cfg: LoadConfig, deadline: float, r: LoadResult, w: Witness,
                     seen: dict[str, str]) -> bool:
    heartbeat = rng.random() < 0.5
    t0 = time.perf_counter()
    status, lease = await conn.call("POST", "/api/v1/leases", _request_body(rng, heartbeat))
    r.requests += 1
    if status not in (201, 202):
        r.errors.append(f"POST /leases: {status} {lease}")
        return False
    lid = lease["id"]
    seen[lid] = lease["state"]
    r.answer_ms.append((time.perf_counter() - t0) * 1000)
    r.granted_at_once += status == 201
    while lease["state"] == "queued" and time.monotonic() < deadline:
        status, lease = await conn.call("GET", f"/api/v1/leases/{lid}?wait={WAIT:g}")
        if status != 200:
            r.errors.append(f"GET /leases/{lid}?wait: {status} {lease}")
            return False
    seen[lid] = lease["state"]
    if lease["state"] == "queued":  # the deadline passed: cancel (it may be granted meanwhile: then released)
        status, lease = await conn.call("DELETE", f"/api/v1/leases/{lid}")
        if status != 200 or lease["state"] not in ("cancelled", "released"):
            r.errors.append(f"DELETE /leases/{lid}: {status} {lease}")
            return False
        seen[lid] = lease["state"]
        r.cancelled += lease["state"] == "cancelled"
        r.released += lease["state"] == "released"
        return False
    if lease["phase"] != "holding":
        r.errors.append(f"lease {lid} ended while waiting: {lease['state']} {lease.get('reason')}")
        return False
    r.granted += 1
    r.grant_ms.append((time.perf_counter() - t0) * 1000)
    r.grant_ms_by_size.setdefault(f"{float(lease.get('fraction') or 1) * len(lease['devices']):g}", []).append(
        r.grant_ms[-1])
    w.take(lease)
    hold = rng.uniform(*cfg.hold_ms) / 1000
    if heartbeat:
        await asyncio.sleep(hold / 2)
        status, beat = await conn.call("POST", f"/api/v1/leases/{lid}/heartbeat", {"active": True})
        r.heartbeats += 1
        if status != 200 or beat["phase"] != "holding":
            r.errors.append(f"heartbeat {lid}: {status} {beat}")
        await asyncio.sleep(hold / 2)
    else:
        await asyncio.sleep(hold)
    w.give(lease)
    t1 = time.perf_counter()
    status, ended = await conn.call("POST", f"/api/v1/leases/{lid}/release", {})
    r.release_ms.append((time.perf_counter() - t1) * 1000)
    if status != 200 or ended["state"] != "released":
        r.errors.append(f"release {lid}: {status} {ended}")
        return False
    seen[lid] = "released"
    r.released += 1
    return True


async def _monitor(broker: LoadBroker, deadline: float, r: LoadResult) -> None:
    conn = await Conn.connect(broker.socket, 0, None)
    last, last_t = 0, time.monotonic()
    try:
        while time.monotonic() < deadline:
            await asyncio.sleep(1.0)
            t0 = time.perf_counter()
            status, info = await conn.call("GET", "/api/v1/info")
            r.info_ms.append((time.perf_counter() - t0) * 1000)
            if status != 200:
                r.errors.append(f"GET /info: {status}")
                continue
            r.max_queued = max(r.max_queued, int(info.get("summary", {}).get("queued", 0)))
            now = time.monotonic()
            r.grants_per_s.append((r.granted - last) / (now - last_t))
            last, last_t = r.granted, now
    except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError) as e:
        r.errors.append(f"monitor: {e!r}")
    finally:
        conn.close()


async def _drive(cfg: LoadConfig, broker: LoadBroker, r: LoadResult, seen: dict[str, str]) -> None:
    gate = asyncio.Semaphore(50)
    w = Witness(r)
    start = time.monotonic()
    deadline = start + cfg.seconds
    tasks = [asyncio.create_task(_client(i, cfg, broker, deadline, r, w, seen, gate)) for i in range(cfg.clients)]
    tasks.append(asyncio.create_task(_monitor(broker, deadline, r)))
    await asyncio.gather(*tasks)
    r.elapsed = time.monotonic() - start
