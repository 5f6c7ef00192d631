"""Broker benchmarks: grant latency and throughput over the Unix socket, the scheduler, memory, restart.

Every figure runs against a real ``lease-broker`` process with a simulated inventory (the client is a
minimal asyncio HTTP/1.1 client on the broker's Unix socket), except the scheduler figures, which call the
pure ``lease_broker.core.scheduler.schedule`` directly.
"""

from __future__ import annotations

import asyncio
import math
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

from .broker_process import Broker, Conn, cpu_seconds, create_leases, fill_store
from .report import Figure, figure

TITLE = "Lease broker"


# ---------------------------------------------------------------------------------------------- figures
async def grant_latency(path: str, rounds: int) -> tuple[list[float], list[float], list[float]]:
    """ms per grant of a free GPU (POST /leases answered granted), per release of it, and per ``GET /info``
    (the baseline), on one keep-alive connection."""
    conn = await Conn.open(path)
    grants, releases, infos = [], [], []
    try:
        for _ in range(min(20, rounds // 10)):  # warm up
            await conn.call("GET", "/api/v1/info")
        for _ in range(rounds):
            t0 = time.perf_counter()
            status, lease = await conn.call("POST", "/api/v1/leases", {"gpus": 1, "heartbeat": False})
            if status != 201 or lease["state"] != "granted":
                raise RuntimeError(f"not granted at once: {status} {lease}")
            t1 = time.perf_counter()
            status, _ = await conn.call("POST", f"/api/v1/leases/{lease['id']}/release", {})
            if status != 200:
                raise RuntimeError(f"release failed: {status}")
            t2 = time.perf_counter()
            await conn.call("GET", "/api/v1/info")
            t3 = time.perf_counter()
            grants.append((t1 - t0) * 1000)
            releases.append((t2 - t1) * 1000)
            infos.append((t3 - t2) * 1000)
    finally:
        conn.close()
    return grants, releases, infos


async def throughput(path: str, clients: int, seconds: float, windows: int, pid: int = 0,
                     kinds: tuple[str, ...] = ("grant", "info")) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Per window and kind: operations/s with ``clients`` concurrent connections, the kinds' windows alternating;
    also the broker's (``pid``) CPU use over each kind's windows, as a fraction of one core. Kinds: ``grant`` (a
    grant, then its release: one operation of 2 requests), ``info`` (GET /info), ``noop`` (two no-op POSTs of
    ``benchmarks.noop_broker``: a pair's HTTP alone)."""

    async def run(kind: str) -> float:
        stop = time.perf_counter() + seconds
        done = 0

        async def client() -> None:
            nonlocal done
            conn = await Conn.open(path)
            try:
                while time.perf_counter() < stop:
                    if kind == "info":
                        await conn.call("GET", "/api/v1/info")
                        done += 1
                    elif kind == "noop":
                        await conn.call("POST", "/api/v1/noop", {"gpus": 1, "heartbeat": False})
                        await conn.call("POST", "/api/v1/noop/l-0/release", {})
                        done += 1
                    else:
                        status, lease = await conn.call("POST", "/api/v1/leases", {"gpus": 1, "heartbeat": False})
                        if status in (201, 202):
                            await conn.call("POST", f"/api/v1/leases/{lease['id']}/release", {})
                            done += status == 201
            finally:
                conn.close()

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        return done / (time.perf_counter() - t0)

    rates: dict[str, list[float]] = {kind: [] for kind in kinds}
    busy = dict.fromkeys(kinds, 0.0)
    for _ in range(windows):
        for kind in kinds:
            c0, t0 = cpu_seconds(pid) if pid else 0.0, time.perf_counter()
            rates[kind].append(await run(kind))
            if pid:
                busy[kind] += (cpu_seconds(pid) - c0) / (time.perf_counter() - t0) / windows
    return rates, busy


def scheduler_rates(gpus: int, queued: int, reps: int) -> tuple[list[float], list[float]]:
    """Decisions/s of one ``schedule`` pass (queued requests considered per second) and of ``queue_order``."""
    from lease_broker.core.lease import LeaseRequest
    from lease_broker.core.scheduler import Pending, SchedulerPolicy, Slot, queue_order, schedule

    now = 1_000_000.0
    per_node = 8
    slots = [Slot(id=f"g{i}", node=f"n{i // per_node}", index=i % per_node, link_group=f"n{i // per_node}/{i % 8 // 4}",
                  memory_total=80 << 30) for i in range(gpus)]
    for i, s in enumerate(slots):  # 90 % held by exclusive leases ending over the next 8 h
        if i % 10:
            s.exclusive, s.free_at = True, now + 60 + (i * 97) % 28800
    sizes = [1, 1, 1, 2, 4, 8]
    users = [f"u{i}" for i in range(50)]
    pending = [Pending(f"l-{i}", users[i % 50], LeaseRequest(min_gpus=sizes[i % 6], max_gpus=sizes[i % 6],
                                                             priority=("low", "normal", "high")[i % 3]),
                       i, 600.0 + (i * 37) % 7200) for i in range(queued)]
    policy = SchedulerPolicy()
    held = {u: 10.0 for u in users}
    rates, base = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        schedule(pending, slots, held, policy, now)
        rates.append(queued / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        queue_order(pending, policy)
        base.append(queued / (time.perf_counter() - t0))
    return rates, base


def run(opts: Any) -> list[Figure]:
    quick = bool(opts.quick)
    figures: list[Figure] = []
    tmp = tempfile.mkdtemp(prefix="glbench")
    try:
        # --- 1,000 active leases on 1,100 simulated GPUs (8 per node)
        active, gpus = (50, 150) if quick else (1000, 1100)
        b = Broker(os.path.join(tmp, "grant"), gpus=gpus, nodes=math.ceil(gpus / 8))
        os.makedirs(b.workdir)
        b.start()
        try:
            t0 = time.perf_counter()
            asyncio.run(create_leases(b.socket, active))
            setup = time.perf_counter() - t0
            rounds = 20 if quick else 600
            grants, releases, infos = asyncio.run(grant_latency(b.socket, rounds))
            figures.append(figure(
                f"grant of a free GPU, {active} active leases", "ms", grants, "GET /api/v1/info round trip",
                infos, bar=("p99", "<=", 10.0),
                note=f"{gpus} simulated GPUs on {math.ceil(gpus / 8)} nodes; {active} granted 1-GPU leases "
                     f"(heartbeat false, 8 h) created in {setup:.1f} s; each sample is POST /leases answered "
                     "granted (a scheduling pass included) on one keep-alive Unix-socket connection; the lease is "
                     "then released (next figure) so the same GPU is free again.",
            ))
            figures.append(figure(
                f"release, {active} active leases", "ms", releases, "GET /api/v1/info round trip", infos,
                note="POST /leases/ID/release of the lease just granted (the lease ends, its GPU is offered to the "
                     "queue in the same pass).",
            ))
            clients = 8 if quick else 64
            seconds, windows = (0.3, 2) if quick else (2.0, 5)
            assert b.proc is not None
            per_kind, busy = asyncio.run(throughput(b.socket, clients, seconds, windows, b.proc.pid))
            rates, base = per_kind["grant"], per_kind["info"]
            rt = sorted(g + r for g, r in zip(grants, releases, strict=True))[len(grants) // 2]
            figures.append(figure(
                f"grants/s, {clients} concurrent clients", "grants/s", rates, "GET /api/v1/info requests/s",
                base, bar=None,
                note=f"{clients} asyncio connections in one client process (on the same cores as the broker), "
                     f"{windows} windows of {seconds:g} s each, grant windows and GET /info windows alternating; a "
                     f"grant counts once it is granted and released (2 requests); {active} other leases stay active. "
                     f"The broker is one process: it used {100 * busy['grant']:.0f} % of a core during the grant "
                     f"windows and {100 * busy['info']:.0f} % during the GET /info windows, so /info's rate is about "
                     f"what one core of this machine serves for the cheapest request. The requests of one event-loop "
                     f"iteration share one scheduling pass and one SQLite transaction (group commit); every answer "
                     f"waits for its commit (median sequential grant + release above: {rt:.1f} ms).",
            ))
            figures.append(figure(
                f"grant+release pairs/s per GET /info request/s, {clients} clients", "ratio",
                [g / i for g, i in zip(rates, base, strict=True)], "the ceiling: a pair is two requests", [0.5],
                bar=("median", ">=", 0.4),
                note="each sample: a grant window's pairs/s divided by the next GET /info window's requests/s (the "
                     "same run, so the machine's speed cancels out).",
            ))
        finally:
            b.stop()

        # --- what the ratio is made of: a pair's HTTP alone (two no-op POSTs), the lease work, GET /info
        b = Broker(os.path.join(tmp, "floor"), gpus=gpus, nodes=math.ceil(gpus / 8), module="benchmarks.noop_broker")
        os.makedirs(b.workdir)
        b.start()
        try:
            asyncio.run(create_leases(b.socket, active))
            assert b.proc is not None
            per_kind, busy = asyncio.run(throughput(b.socket, clients, seconds, windows, b.proc.pid,
                                                    kinds=("info", "noop", "grant")))
            cpu = {k: 1e6 * busy[k] / statistics.median(per_kind[k]) for k in per_kind}  # µs of broker CPU per op
            figures.append(figure(
                f"no-op POST pairs/s per GET /info request/s, {clients} clients", "ratio",
                [n / i for n, i in zip(per_kind["noop"], per_kind["info"], strict=True)],
                "grant+release pairs/s per GET /info request/s, same windows",
                [g / i for g, i in zip(per_kind["grant"], per_kind["info"], strict=True)], bar=None,
                note=f"the HTTP floor of a pair: two POSTs to benchmarks.noop_broker's no-op endpoint (the lease "
                     f"endpoints' handler base: JSON body, identity, waiting for the iteration, a lease-sized JSON "
                     f"answer), on a broker like the one above, its windows alternating with GET /info and "
                     f"grant+release windows. Broker CPU per operation: GET /info {cpu['info']:.0f} µs, no-op pair "
                     f"{cpu['noop']:.0f} µs, grant+release pair {cpu['grant']:.0f} µs, so a pair's lease work (3 "
                     f"durable transitions, their events, a scheduling pass, 2 lease views) is "
                     f"{cpu['grant'] - cpu['noop']:.0f} µs. A ratio of 0.4 needs a pair within 2.5 GET /info = "
                     f"{2.5 * cpu['info']:.0f} µs, so lease work within {2.5 * cpu['info'] - cpu['noop']:.0f} µs.",
            ))
        finally:
            b.stop()

        # --- the pure scheduler
        n_gpus = 100 if quick else 1000
        for queued in ((100, 1000) if quick else (100, 1000, 10000)):
            reps = 3 if quick or queued < 10000 else 5
            rates, base = scheduler_rates(n_gpus, queued, reps)
            figures.append(figure(
                f"scheduler decisions/s, {n_gpus} GPUs, {queued} queued", "decisions/s", rates,
                "queue_order (sort only) of the same queue", base,
                note=f"one schedule() pass over {queued} queued requests (sizes 1,1,1,2,4,8; 3 priorities; 50 users) "
                     f"with 90 % of the GPUs held; decisions/s = queued / pass time (a pass of the median took "
                     f"{queued / sorted(rates)[len(rates) // 2] * 1000:.1f} ms). The broker runs a pass on every "
                     "request, release and tick.",
            ))

        # --- memory and restart with 10,000 live leases on 10,100 simulated GPUs
        many = 300 if quick else 10000
        n_gpus = many + 100
        b = Broker(os.path.join(tmp, "many"), gpus=n_gpus, nodes=math.ceil(n_gpus / 8))
        os.makedirs(b.workdir)
        b.start()
        time.sleep(0.5)
        idle = [b.rss_bytes() / 2**20]
        b.stop()
        t0 = time.perf_counter()
        fill_store(b.db, n_gpus, math.ceil(n_gpus / 8), many)
        setup = time.perf_counter() - t0
        b.start()
        try:
            time.sleep(1.0)
            loaded = [b.rss_bytes() / 2**20]
            grants, _releases, infos = asyncio.run(grant_latency(b.socket, 20 if quick else 100))
        finally:
            b.stop()
        figures.append(figure(
            f"broker RSS, {many} live leases", "MiB", loaded, f"RSS of the same broker idle ({n_gpus} GPUs, no lease)",
            idle, bar=("max", "<=", 150.0 / 1.048576),
            note=f"{many} granted 1-GPU leases (heartbeat false, 8 h) over {n_gpus} simulated GPUs, written to the "
                 f"broker's store with lease_broker.store.lease_store.Store in {setup:.1f} s while it was stopped (creating them "
                 "through the API is too slow at this size: see the next figure), then restored by the broker; "
                 "VmRSS from /proc 1 s after it serves. Bar: 150 MB = 143 MiB.",
        ))
        figures.append(figure(
            f"grant of a free GPU, {many} active leases", "ms", grants, "GET /api/v1/info round trip", infos,
            note=f"as the first figure, with {many} live leases on {n_gpus} GPUs: no bar at this size (the bar is for "
                 "1,000), shown to compare: the GPU table keeps the scheduler's view current lease by lease, so a "
                 "grant should not grow with the number of live leases.",
        ))
        reps = 2 if quick else 5
        restarts = []
        for _ in range(reps):
            restarts.append(b.start())
            b.stop()
        empty = Broker(os.path.join(tmp, "empty"), gpus=n_gpus, nodes=math.ceil(n_gpus / 8))
        os.makedirs(empty.workdir)
        baseline = []
        for _ in range(reps):
            baseline.append(empty.start())
            empty.stop()
        figures.append(figure(
            f"restart to serving, {many} live leases", "s", restarts, "restart with an empty store", baseline,
            bar=("max", "<=", 1.0),
            note="from process start (python -m lease_broker) to the first 200 of GET /api/v1/info, polled every "
                 "2 ms; the broker restores and reconciles every live lease first.",
        ))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return figures
