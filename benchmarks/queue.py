"""Scheduling with a deep queue: what one event (a request, a release, a tick) costs when thousands of requests
wait that cannot start, against the full pass over the same queue (what every event cost before the event
pass), and the grant of a free GPU through a real broker with 10,000 requests queued (by one user, and by 10,000
users each queued once at the same fair-share score) against the same broker with none.

The queued requests are 8-GPU gangs on 9 nodes of 8 simulated GPUs where every node has one GPU held for 8 h:
none can start, and the head of the queue holds reservations (backfill) for when the GPUs free.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from typing import Any

from .broker import grant_latency
from .broker_process import Broker
from .report import Figure, figure

TITLE = "Scheduling with a deep queue"
NODES, PER_NODE = 9, 8
GANG = {"gpus": 8, "heartbeat": False, "duration_seconds": 3600}
BLOCK = 50  # grants sampled from one broker before switching to the other (real-broker figures)


def fill_queue(db: str, count: int, user: str, uid: int, blockers: bool = False, users: bool = False) -> None:
    """Write ``count`` queued 8-GPU requests (and, with ``blockers``, one granted 8 h lease on the first GPU of
    every node) into a stopped broker's store, as the broker persists them; ``users``: each request by a user of
    its own (``user-<i>``, none with past usage: all at one fair-share score), not all by ``user``."""
    from lease_broker.core.identity import hash_secret
    from lease_broker.core.lease import Lease, LeaseRequest, LeaseState
    from lease_broker.inventory.simulated import SimulatedInventory
    from lease_broker.store.lease_store import Store

    store = Store(db)
    now = time.time()
    seq = store.next_seq()
    try:
        if blockers:
            for g in SimulatedInventory(gpus=NODES * PER_NODE, nodes=NODES).discover()[::PER_NODE]:
                lease = Lease(id=f"l-b{seq:010x}", user=user, uid=uid, request=LeaseRequest(heartbeat=False),
                              state=LeaseState.QUEUED, created_at=now, seq=seq, reason="requested",
                              duration_seconds=28800.0, last_heartbeat=now, last_activity=now)
                store.insert(lease, now)
                lease.state, lease.reason, lease.devices, lease.node = LeaseState.GRANTED, "granted", [g.id], g.node
                lease.granted_at, lease.expires_at = now, now + 28800.0
                store.transition(lease, LeaseState.QUEUED, now)
                seq += 1
        for i in range(count):
            lease = Lease(id=f"l-q{i:010x}", user=f"{user}-{i}" if users else user, uid=uid, request=LeaseRequest(min_gpus=8, max_gpus=8,
                                                                                          heartbeat=False),
                          state=LeaseState.QUEUED, created_at=now, seq=seq + i, reason="requested",
                          duration_seconds=3600.0, idle_timeout_seconds=0.0, last_heartbeat=now, last_activity=now,
                          secret_hash=hash_secret(f"q{i}"))
            store.insert(lease, now)
    finally:
        store.close()


def event_costs(queued: int, reps: int) -> tuple[list[float], list[float], list[float], int]:
    """ms of each event pass, of each whole event (a request granted at once, or its release: store writes and
    events included) and of full passes, in an in-process LeaseManager with ``queued`` requests waiting."""
    from lease_broker.core.clock import VirtualClock
    from lease_broker.core.identity import Identity
    from lease_broker.inventory.simulated import SimulatedInventory
    from lease_broker.manager.manager import LeaseManager
    from lease_broker.policy.lease_policy import LeasePolicy
    from lease_broker.store.lease_store import Store

    tmp = tempfile.mkdtemp(prefix="glqueue")
    try:
        db = os.path.join(tmp, "leases.db")
        fill_queue(db, queued, "bench", os.getuid(), blockers=True)
        policy = LeasePolicy(unix_groups=False, heartbeat_timeout=0, max_queued_per_user=0)  # (one user queues them all)
        m = LeaseManager(Store(db), SimulatedInventory(gpus=NODES * PER_NODE, nodes=NODES), policy,
                         clock=VirtualClock(time.time()))
        m.restore()
        who = Identity("bench", uid=os.getuid())
        passes: list[float] = []
        schedule = m.schedule

        def timed() -> int:
            t0 = time.perf_counter()
            try:
                return schedule()
            finally:
                passes.append((time.perf_counter() - t0) * 1000)

        m.schedule = timed  # type: ignore[method-assign]
        events, fulls = [], []
        for i in range(reps):
            t0 = time.perf_counter()
            lease, _ = m.request(who, {"gpus": 1, "heartbeat": False})
            t1 = time.perf_counter()
            m.release(lease.id, who)
            events += [(t1 - t0) * 1000, (time.perf_counter() - t1) * 1000]
            if i % max(1, reps // 5) == 0:
                m.replan()  # a full pass now, not timed as an event
                fulls.append(passes.pop())
        depth = len(m.state.queue)
        m.store.close()
        return passes, events, fulls, depth
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def interleaved_grants(tmp: str, deep: int, rounds: int, block: int) -> dict[str, tuple[list[float], list[float]]]:
    """Grant latencies and GET /info latencies (ms) of three real brokers running side by side, every node of each
    blocked by a held GPU: ``empty`` with nothing queued, ``deep`` with ``deep`` 8-GPU requests of one user queued
    and ``users`` with ``deep`` such requests of as many users (written to their stores before they start),
    sampled in blocks of ``block`` rounds, in turn (every other turn reversed). Returns name -> (grants, infos)."""
    from lease_broker.host.users import user_name

    brokers = {}
    for name, queued in (("empty", 0), ("deep", deep), ("users", deep)):
        b = brokers[name] = Broker(os.path.join(tmp, name), gpus=NODES * PER_NODE, nodes=NODES)
        b.args.append("--LeasePolicy.max_queued_per_user=0")  # (one user queues them all: no cap)
        os.makedirs(b.workdir)
        fill_queue(b.db, queued, user_name(os.getuid()), os.getuid(), blockers=True, users=name == "users")
    out: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in brokers}
    try:
        for b in brokers.values():
            b.start()
        order = list(brokers.items())
        for i in range(max(1, rounds // block)):
            for name, b in order if i % 2 == 0 else order[::-1]:
                grants, _, infos = asyncio.run(grant_latency(b.socket, block))
                out[name][0].extend(grants)
                out[name][1].extend(infos)
    finally:
        for b in brokers.values():
            if b.proc is not None:
                b.stop()
    return out


def run(opts: Any) -> list[Figure]:
    quick = bool(opts.quick)
    figures: list[Figure] = []
    for queued in ((100, 1000) if quick else (100, 10_000, 100_000)):
        passes, events, fulls, depth = event_costs(queued, 20 if quick else 200)
        whole = sorted(events)[len(events) // 2]
        figures.append(figure(
            f"scheduling cost per event, {queued:,} queued", "ms", passes,
            "a full pass over the same queue", fulls,
            note=f"an in-process LeaseManager (the real one: SQLite store on disk, virtual clock) on {NODES}x{PER_NODE} "
                 f"simulated GPUs with one GPU of each node held and {depth:,} 8-GPU requests queued that cannot "
                 "start; each sample is the scheduling pass of one event: a 1-GPU request granted in its own pass, "
                 f"or its release (the whole event, store writes and events included: median {whole:.2f} ms). "
                 "Baseline: a full pass (every request, fresh fair-share order, every estimate), which runs every "
                 "full_pass_seconds and which every event used to be.",
        ))
    tmp = tempfile.mkdtemp(prefix="glqueue")
    try:
        deep = 500 if quick else 10_000
        rounds = 30 if quick else 600
        block = 10 if quick else BLOCK
        runs = interleaved_grants(tmp, deep, rounds, block)
        empty, empty_infos = runs["empty"]
        for name, who in (("deep", "requests queued"), ("users", "users queued once each, at equal scores")):
            full, infos = runs[name]
            figures.append(figure(
                f"grant of a free GPU, {deep:,} {who}", "ms", full, "the same with no request queued", empty,
                bar=("p99", "<=", 10.0),
                note=f"a real broker on {NODES}x{PER_NODE} simulated GPUs, one GPU of each node held for 8 h, "
                     f"{deep:,} 8-GPU requests queued that cannot start (written to its store before it starts"
                     + ("; each by a user of its own, none with past usage, so every user ties on fair share"
                        if name == "users" else "; all by one user") + "); "
                     "each sample is POST /leases answered granted, then released, on one keep-alive Unix-socket "
                     "connection. Baseline: a broker, the same but with no request queued, running beside it; "
                     f"the brokers are sampled in turn in blocks of {block} grants, so drift on a shared machine "
                     "falls on all. GET /info medians: "
                     f"{sorted(empty_infos)[len(empty_infos) // 2]:.2f} ms empty, "
                     f"{sorted(infos)[len(infos) // 2]:.2f} ms queued.",
            ))
            ratio = [full[i] / empty[i] for i in range(min(len(full), len(empty)))]
            p99 = figures[-1]
            figures.append(figure(
                f"grant p99 with {deep:,} {who.split(' ')[0]} queued / with none", "ratio",
                [p99["p99"] / p99["baseline"]["p99"]], "per-sample ratio, median", [sorted(ratio)[len(ratio) // 2]],
                bar=("max", "<=", 2.0),
                note="the p99 of the figure above divided by its baseline's p99 (the issue's bar: at most 2x).",
            ))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return figures
