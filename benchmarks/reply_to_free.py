"""From a ``%%gpu`` cell's reply to its GPU free, per executor (local, Ray, Slurm), in one run.

A real kernel (``tests/kernels.py``) runs trivial single-use cells (``%%gpu`` / ``pass``) against a real broker of
each backend (``backends.py``: the simulated single host, a local Ray cluster, a local Slurm). A sample starts when
the test process has the cell's reply (the kernel idle again) and ends when the broker shows the cell's lease
released (polled every millisecond); then, for the note, until the engine agrees the GPU is free (single host: the
broker lists it free; Ray: ``ray.available_resources()`` counts it; Slurm: ``squeue`` no longer lists the job).

Before the Slurm relay's fix every Slurm release came 0.97 s after the reply: the relay aborted (SIGABRT) a second
after its worker's end, and the step ended only then.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .backends import TESTS, Backend, RayBackend, SingleHost, SlurmBackend, p95
from .report import Figure, figure

TITLE = "Remote cells: from a cell's reply to its GPU free (local, Ray, Slurm)"


def _kernel_env(backend: Backend) -> dict[str, str]:
    if isinstance(backend, RayBackend):
        from ray_cluster import HEAD

        return {**backend.broker_env(), "GPULEASE_RAY_NODE_IP": HEAD}
    return backend.broker_env()


def _engine_free(backend: Backend, client: Any) -> None:
    """Block until the backend's engine agrees every GPU is free again."""
    from .backends import wait_until

    if isinstance(backend, RayBackend):
        backend.freed({})
    elif isinstance(backend, SlurmBackend):
        wait_until(lambda: not backend.cluster.jobs(), what="no Slurm job left")
    else:
        wait_until(lambda: client.gpus()["summary"]["free"] == 6, what="every GPU free in the broker")


def measure(backend: Backend, workdir: str, cells: int) -> dict[str, list[float]]:
    """ms from each cell's reply to its lease released in the broker, and to the GPU free in the engine."""
    sys.path.insert(0, TESTS)
    from broker_process import BrokerProcess
    from kernels import Kernel

    backend.start(workdir)
    broker = kernel = None
    try:
        broker = BrokerProcess(Path(workdir) / "broker", gpus=6, nodes=2, args=[*backend.broker_args(), "--tick=0.05"],
                               env=backend.broker_env()).start(timeout=120)
        client = broker.client(timeout=60)
        kernel = Kernel(broker.url, os.path.join(workdir, "artifacts"), _kernel_env(backend))
        out: dict[str, list[float]] = {"released": [], "free": []}
        for i in range(cells + 1):  # the first is warm-up (the kernel's first cell imports the executor)
            seen = {v["id"] for v in client.leases(ended=10_000)}
            r = kernel.run("%%gpu\npass", timeout=180)
            replied = time.perf_counter()
            if r.status != "ok":
                raise RuntimeError(f"{backend.name}: the cell failed: {r.outputs}")
            lease = next(v for v in client.leases(ended=10_000) if v["id"] not in seen)
            while client.lease(lease["id"])["phase"] != "ended":
                if time.perf_counter() - replied > 60:
                    raise RuntimeError(f"{backend.name}: lease {lease['id']} not released within 60 s of the reply")
                time.sleep(0.001)
            released = time.perf_counter()
            _engine_free(backend, client)
            free = time.perf_counter()
            if i:
                out["released"].append((released - replied) * 1000)
                out["free"].append((free - replied) * 1000)
        client.close()
        return out
    finally:
        if kernel is not None:
            kernel.stop()
        if broker is not None:
            broker.stop()
        backend.stop()


def run(opts: Any) -> list[Figure]:
    cells = 3 if opts.quick else 10
    tmp = tempfile.mkdtemp(prefix="glreply")
    try:
        base = SingleHost()
        b = measure(base, os.path.join(tmp, "single"), cells)
        figures: list[Figure] = [figure(
            "cell reply → lease released, local", "ms", b["released"], "cell reply → GPU free in the broker, local",
            b["free"], bar=("median", "<=", 100.0),
            note=f"a trivial single-use %%gpu cell on the single-host broker (simulated GPUs, local worker); p95 "
                 f"{p95(b['released']):.1f} ms.")]
        for cls in (RayBackend, SlurmBackend):
            eng = cls()
            why = eng.missing()
            if why:
                print(f"   {eng.name}: skipped ({why})", flush=True)
                continue
            m = measure(eng, os.path.join(tmp, cls.__name__), cells)
            figures.append(figure(
                f"cell reply → lease released, {eng.name}", "ms", m["released"], "cell reply → lease released, local",
                b["released"], bar=("median", "<=", 100.0),
                note=f"a trivial single-use %%gpu cell whose worker runs through the {eng.name} executor; then "
                     f"{'no Slurm job is left in squeue' if cls is SlurmBackend else eng.what_freed} after {statistics.median(m['free']):.1f} ms from the reply (median); p95 "
                     f"{p95(m['released']):.1f} ms. Load average at the end: {os.getloadavg()[0]:.1f} on "
                     f"{os.cpu_count()} cores."))
        return figures
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
