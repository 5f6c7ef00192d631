"""Load and soak: 1,000 concurrent clients requesting and releasing leases against a real broker.

``python -m benchmarks --only load`` (``make soak``: 60 s) or ``python -m benchmarks.load --seconds 10``.

Each client is one keep-alive HTTP/1.1 connection in one asyncio process: half of them on the broker's
Unix socket (identified by SO_PEERCRED), half over TCP on 127.0.0.1 with bearer tokens of 100 users
(written into the broker's store before it starts). A client loops until the deadline: request a lease
(1, 2 or 4 GPUs, or a 0.25/0.5 share; a queued one waits with ``GET /leases/ID?wait=5``), hold it
0.1–1 s (a heartbeat on half of them), release it, think 0.5–5 s (clients arrive over the first 5 s). At the deadline queued requests are
cancelled. Nothing is retried: every non-2xx answer, timeout or broken connection is an error.

Double grants are looked for twice, independently:

* **by the clients**: a client holds a GPU from the moment it reads the grant until it sends the release,
  a sub-interval of the broker's; a grant of a GPU that another client still holds (exclusively, or
  shares over 1) is a double grant the broker made;
* **in the store** after the broker stopped: the transitions replayed in the order they were written.

"Nothing lost": every lease a client was answered for is in the store, in the end state the client saw.

The broker and the clients are in :mod:`benchmarks.load_driver`; the result and both checks in
:mod:`benchmarks.load_checks`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .load_checks import LoadResult, Witness, check_store
from .load_driver import TIMEOUT, WAIT, Conn, LoadBroker, LoadConfig, _drive, _raise_fd_limit
from .report import Figure, figure

__all__ = ["LAST", "TIMEOUT", "TITLE", "WAIT", "Conn", "LoadBroker", "LoadConfig", "LoadResult",
           "Witness", "check_store", "main", "run", "run_load", "soak_cells"]

TITLE = "Load and soak"

LAST: LoadResult | None = None  # the last run of run(), for the reliability module of the same invocation


def run_load(cfg: LoadConfig, workdir: str | None = None) -> LoadResult:
    """Start a broker, drive ``cfg.clients`` clients for ``cfg.seconds``, stop it, check everything."""
    own = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="glload")
    _raise_fd_limit(cfg.clients * 2 + 256)
    r = LoadResult(config=asdict(cfg))
    seen: dict[str, str] = {}
    broker = LoadBroker(workdir, cfg)
    broker.start()
    cpu0 = time.process_time()
    try:
        asyncio.run(_drive(cfg, broker, r, seen))
        r.driver_cpu_s = time.process_time() - cpu0
        r.broker_cpu_s = broker.cpu_seconds()
    finally:
        broker.stop()
    try:
        check_store(broker.db, r, seen)
        r.broker_log_errors = [line for line in broker.log().splitlines()
                               if " E " in line or "Traceback" in line or "double_grant" in line][:20]
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)
    return r


# ---------------------------------------------------------------------------------------------- %%gpu soak
def soak_cells(kernels: int, gpus: int, seconds: float) -> dict[str, Any]:
    """``kernels`` real kernels run a short ``%%gpu`` cell in a loop on ``gpus`` GPUs for ``seconds``."""
    import threading

    from .broker_process import Broker
    from .cell import _Kernel

    tmp = tempfile.mkdtemp(prefix="glsoak")
    b = Broker(os.path.join(tmp, "b"), gpus=gpus, nodes=1)
    os.makedirs(b.workdir)
    b.start()
    out: dict[str, Any] = {"kernels": kernels, "gpus": gpus, "cells": 0, "errors": [], "cell_ms": []}
    ks: list[_Kernel] = []
    try:
        ks = [_Kernel(b.socket, os.path.join(tmp, "artifacts")) for _ in range(kernels)]
        lock = threading.Lock()
        deadline = time.monotonic() + seconds

        def loop(k: _Kernel, n: int) -> None:
            i = 0
            while time.monotonic() < deadline:
                i += 1
                try:
                    took = k.run(f"%%gpu\nimport os\nx = {n} * {i}\nassert os.environ['GPULEASE_LEASE_ID']")
                    with lock:
                        out["cells"] += 1
                        out["cell_ms"].append(took * 1000)
                except Exception as e:  # a failed cell is an error of the soak, not a crash of it
                    with lock:
                        out["errors"].append(f"kernel {n}: {e}")

        threads = [threading.Thread(target=loop, args=(k, n)) for n, k in enumerate(ks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(seconds + 600)
        from jupyter_gpulease.client import BrokerClient

        c = BrokerClient("unix://" + b.socket)
        settle = time.monotonic() + 5  # a release may still be on its way when the last cell's reply came
        while (left := [x for x in c.leases(everyone=True) if x["phase"] != "ended"]) and time.monotonic() < settle:
            time.sleep(0.1)
        out["leases_left"] = len(left)
        out["left"] = [f"{x['id']} {x['state']} {x['labels'].get('cell', '')}" for x in left]
        out["free_at_end"] = c.info()["summary"]["free"]
    finally:
        for k in ks:
            k.stop()
        b.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# ---------------------------------------------------------------------------------------------- the module
def run(opts: Any) -> list[Figure]:
    quick = bool(getattr(opts, "quick", False))
    seconds = float(os.environ.get("GPULEASE_SOAK_SECONDS", 5 if quick else 60))
    cfg = LoadConfig(clients=100 if quick else 1000, seconds=seconds)
    if quick:
        cfg.gpus, cfg.nodes = 64, 8
    r = run_load(cfg)
    global LAST
    LAST = r
    s = r.summary()
    Path(os.environ.get("GPULEASE_LOAD_JSON", os.devnull)).write_text(json.dumps(s, indent=2))
    held = (f"{cfg.clients} clients ({cfg.tcp_share:.0%} over TCP with tokens of {cfg.users} users, the rest on the "
            f"Unix socket) for {r.elapsed:.0f} s on {cfg.gpus} simulated GPUs ({cfg.nodes} nodes): {r.requests:,} "
            f"requests, {r.granted:,} grants ({r.granted_at_once:,} at once), {r.released:,} releases, "
            f"{r.cancelled} cancelled at the deadline, {r.heartbeats:,} heartbeats; at most {r.max_queued} queued "
            f"and {r.max_held_gpus:g} GPUs held at once (as the clients saw them)")
    by_size = ", ".join(f"{k} GPU: p50 {v['median']:,.0f} ms, p99 {v['p99']:,.0f} ms (n {v['n']})"
                        for k, v in s["grant_ms_by_size"].items())
    checks = (f"errors {len(r.errors)}, double grants {len(r.client_double_grants)} (clients) and "
              f"{len(r.store_double_grants)} (store: {r.store_transitions:,} transitions of {r.store_leases:,} "
              f"leases replayed), leases lost or in another state than the client saw {len(r.lost)}, broker "
              f"log errors {len(r.broker_log_errors)}")
    figures = [
        figure("grant latency, request → granted (queueing included)", "ms", r.grant_ms,
               "GET /api/v1/info round trip under the same load", r.info_ms,
               note=f"{held}. A queued request waits in the broker (GET /leases/ID?wait=5). At this load the "
                    "broker's single event loop is saturated (a profiler finds it running at every sample, though "
                    "/proc charges it about half a core of this shared 2-vCPU VM: see the CPU seconds below), so these "
                    "latencies are mostly the backlog of requests it has not read yet: GET /info waits as long. "
                    f"By request size: {by_size}."),
        figure("POST /leases answered (granted or queued)", "ms", r.answer_ms,
               "GET /api/v1/info round trip under the same load", r.info_ms,
               note=f"{r.granted_at_once:,} of {r.requests:,} answered granted at once. CPU seconds over the run: "
                    f"broker {r.broker_cpu_s:.1f}, clients {r.driver_cpu_s:.1f} (one process each, "
                    f"{os.cpu_count()} cores)."),
        figure("release round trip", "ms", r.release_ms, "GET /api/v1/info round trip under the same load",
               r.info_ms),
        figure("grants/s", "grants/s", r.grants_per_s, "none", [],
               note="one sample per second of the run, counted by the clients."),
        figure("errors + double grants + leases lost", "count",
               [float(len(r.errors) + len(r.client_double_grants) + len(r.store_double_grants) + len(r.lost)
                      + len(r.broker_log_errors))], "none", [], bar=("max", "<=", 0.0), note=checks),
    ]
    if not quick or os.environ.get("GPULEASE_SOAK_CELLS"):
        k = soak_cells(kernels=4, gpus=2, seconds=min(seconds, 60.0))
        figures.append(figure(
            "%%gpu soak: cell round trip", "ms", k["cell_ms"], "none", [],
            note=f"{k['kernels']} real kernels running a short %%gpu cell in a loop on {k['gpus']} GPUs for "
                 f"{min(seconds, 60.0):g} s: {k['cells']} cells, {len(k['errors'])} errors, {k['leases_left']} "
                 f"leases left at the end {k['left']}, {k['free_at_end']}/{k['gpus']} GPUs free."))
        figures.append(figure(
            "%%gpu soak: failed cells + leases left", "count", [float(len(k["errors"]) + k["leases_left"])],
            "none", [], bar=("max", "<=", 0.0), note="; ".join(k["errors"][:3])))
    return figures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.load", description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=1000)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--gpus", type=int, default=512)
    p.add_argument("--nodes", type=int, default=64)
    p.add_argument("--json", default="", help="write the summary here")
    a = p.parse_args(argv)
    r = run_load(LoadConfig(clients=a.clients, seconds=a.seconds, gpus=a.gpus, nodes=a.nodes))
    s = r.summary()
    text = json.dumps(s, indent=2)
    print(text)
    if a.json:
        Path(a.json).write_text(text)
    return 0 if r.ok else 1


if __name__ == "__main__":
    sys.exit(main())
