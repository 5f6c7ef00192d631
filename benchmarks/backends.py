"""Lease grant and release latency through each backend, next to the single-host broker, in one run.

Every backend is a real ``lease-broker`` process (its own inventory) driven through its Unix socket by the
same client. A sample counts until the *engine* agrees, not just the broker:

- grant: ``POST /leases`` (granted at once) until the backend holds the GPU. Single host: the grant itself.
  Ray: the lease's placement group is placed (``PlacementGroup.wait``, asked by this process, a driver of
  the same cluster).
- release: ``POST /release`` until the GPU is free again. Single host: the broker lists it free. Ray:
  ``ray.available_resources()`` counts it again.
- worker ready: from the granted lease to a ``%%gpu`` worker that has said it is ready on the lease's
  GPUs. Single host: a cold local worker process. Ray: the worker as an actor (``num_cpus=0``) in the
  lease's placement group (what the kernel does, see ``jupyter_gpulease.executors.ray``).

Slurm: grant until the broker reports the lease's allocation granted (``salloc`` said so); release until
``squeue`` no longer lists the lease's job as running or completing; worker ready: ``srun --jobid --overlap``
starting the relay and the worker in the allocation (``jupyter_gpulease.executors.slurm``).

Another engine is one more :class:`Backend` subclass listed in ``BACKENDS``; each adds its rows with the
single host as their baseline.
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

from .report import Figure, figure

TITLE = "Backends: lease grant and release latency (single host, Ray, Slurm)"
TESTS = os.path.join(os.path.dirname(__file__), "..", "tests")


def wait_until(cond: Any, timeout: float = 60.0, what: str = "") -> None:
    deadline = time.perf_counter() + timeout
    while not cond():
        if time.perf_counter() > deadline:
            raise RuntimeError(f"timed out after {timeout} s: {what}")
        time.sleep(0.001)


def p95(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


class Backend:
    """One way the broker gets its GPUs. Subclass, then list the class in ``BACKENDS``.

    Lifecycle: ``missing()`` ("" when it can run here), ``start(workdir)`` (the engine, if any),
    ``broker_args()``/``broker_env()`` for ``lease-broker``, then per sample ``held(lease)`` and
    ``freed(lease)`` (block until the engine agrees), ``worker(lease)`` (a ready ``%%gpu`` worker, or None
    if not measured), and ``stop()``.
    """

    name = "?"
    what_held = ""  # what "held" means for this backend, for the notes
    what_freed = ""
    reference_what = ""  # what reference() starts, for the notes

    def missing(self) -> str:
        return ""

    def start(self, workdir: str) -> None:
        pass

    def broker_args(self) -> list[str]:
        raise NotImplementedError

    def broker_env(self) -> dict[str, str]:
        return {}

    def held(self, lease: dict[str, Any]) -> None:
        pass

    def freed(self, lease: dict[str, Any]) -> None:
        pass

    def worker(self, lease: dict[str, Any]) -> Any:
        return None

    def reference(self, n: int) -> list[float]:
        """ms of the engine's own bare unit of work starting on a GPU (for the notes); [] if none."""
        return []

    def stop(self) -> None:
        pass


class SingleHost(Backend):
    """The single-host broker (simulated inventory: the broker's own code path, no engine). The baseline."""

    name = "single host"
    what_held = "the broker's grant"
    what_freed = "GET /gpus lists the GPU free"

    def broker_args(self) -> list[str]:
        return ["--inventory=simulated"]  # 6 GPUs on 2 nodes, as the Ray cluster has

    def bind(self, client: Any) -> None:
        self.client = client

    def freed(self, lease: dict[str, Any]) -> None:
        gpu = lease["devices"][0]["id"]
        wait_until(lambda: any(g["id"] == gpu and g["state"] == "free" for g in self.client.gpus()["gpus"]),
                   what="GPU free in the broker")

    def worker(self, lease: dict[str, Any]) -> Any:
        from jupyter_gpulease.executors.local import LocalWorker

        w = LocalWorker()
        _ready(w)
        return w


class RayBackend(Backend):
    """A local Ray cluster (two loopback nodes, 4 + 2 declared GPUs) as the broker's inventory."""

    name = "Ray"
    what_held = "its placement group is placed (PlacementGroup.wait)"
    what_freed = "ray.available_resources() counts the GPU again"
    reference_what = "a bare 1-GPU Ray actor (num_cpus=0, no broker, no worker process)"

    def missing(self) -> str:
        sys.path.insert(0, TESTS)
        from ray_cluster import ray_missing

        return ray_missing()

    def start(self, workdir: str) -> None:
        from ray_cluster import local_ray_cluster

        self._cm = local_ray_cluster()  # this process joins as a driver
        self.cluster = self._cm.__enter__()
        import ray

        self.ray: Any = ray
        self.total = float(self.ray.cluster_resources().get("GPU", 0.0))

    def broker_args(self) -> list[str]:
        from ray_cluster import HEAD

        return ["--inventory=ray", f"--RayInventory.address={self.cluster.address}", f"--RayInventory.node_ip={HEAD}"]

    def broker_env(self) -> dict[str, str]:
        return dict(self.cluster.env)

    def _pg(self, lease: dict[str, Any]) -> Any:
        from ray._raylet import PlacementGroupID
        from ray.util.placement_group import PlacementGroup

        return PlacementGroup(PlacementGroupID(bytes.fromhex(lease["placement"]["placement_group_id"])))

    def held(self, lease: dict[str, Any]) -> None:
        if not self._pg(lease).wait(60):
            raise RuntimeError(f"placement group of {lease['id']} not placed within 60 s")

    def freed(self, lease: dict[str, Any]) -> None:
        wait_until(lambda: self.ray.available_resources().get("GPU", 0.0) >= self.total, what="GPUs free in Ray")

    def worker(self, lease: dict[str, Any]) -> Any:
        from jupyter_gpulease.client import LeaseView
        from jupyter_gpulease.executors.ray import RayExecutor

        w = RayExecutor().start(LeaseView.from_json(dict(lease)))
        _ready(w)
        return w

    def reference(self, n: int) -> list[float]:
        """A bare 1-GPU actor (num_cpus=0) started and answering, then killed: Ray alone, no broker."""
        ray = self.ray

        @ray.remote(num_cpus=0, num_gpus=1)
        class Bare:
            def ping(self) -> int:
                return 1

        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            a = Bare.remote()  # type: ignore[attr-defined]
            ray.get(a.ping.remote())
            out.append((time.perf_counter() - t0) * 1000)
            ray.kill(a)
        return out

    def stop(self) -> None:
        self._cm.__exit__(None, None, None)


class SlurmBackend(Backend):
    """A local Slurm (slurmctld and two slurmd, 4 + 2 fake GPUs, under a temporary directory; needs root)."""

    name = "Slurm"
    what_held = "the broker reports the lease's allocation granted (salloc said 'Granted job allocation')"
    what_freed = "squeue says the lease's job is no longer running or completing"
    reference_what = "a bare 1-GPU allocation (`salloc --no-shell --gres=gpu:1`, no broker)"

    def missing(self) -> str:
        sys.path.insert(0, TESTS)
        from slurm_cluster import slurm_missing

        return slurm_missing()

    def start(self, workdir: str) -> None:
        from slurm_cluster import local_slurm_cluster

        self._cm = local_slurm_cluster()
        self.cluster = self._cm.__enter__()
        self._saved = {k: os.environ.get(k) for k in self.cluster.env}
        os.environ.update(self.cluster.env)  # the %%gpu worker's srun runs from this process

    def broker_args(self) -> list[str]:
        return ["--inventory=slurm", "--SlurmInventory.placement_timeout=60"]

    def broker_env(self) -> dict[str, str]:
        return dict(self.cluster.env)

    def bind(self, client: Any) -> None:
        self.client = client

    def held(self, lease: dict[str, Any]) -> None:
        def granted() -> bool:
            self.lease = self.client.lease(lease["id"])
            return bool((self.lease.get("placement") or {}).get("state") == "ready")

        wait_until(granted, what="Slurm allocation granted")

    def freed(self, lease: dict[str, Any]) -> None:
        from lease_broker.inventory.slurm_cli import LIVE_STATES

        job = self.lease["placement"]["job_id"]
        wait_until(lambda: self.cluster.run("squeue", "--noheader", f"--jobs={job}", "--states=all", "--format=%T",
                                            check=False).strip() not in LIVE_STATES, what="Slurm job gone")

    def worker(self, lease: dict[str, Any]) -> Any:
        from jupyter_gpulease.client import LeaseView
        from jupyter_gpulease.executors.slurm import SlurmExecutor

        w = SlurmExecutor().start(LeaseView.from_json(dict(self.lease)))
        _ready(w)
        return w

    def reference(self, n: int) -> list[float]:
        """salloc alone (no broker): the allocation granted, then scancel'ed."""
        import re
        import subprocess

        env = {**os.environ, **self.cluster.env}
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            p = subprocess.run(["salloc", "--no-shell", "--immediate", "--gres=gpu:1", "--time=5",
                                "--job-name=bare"], capture_output=True, text=True, env=env, check=True)
            out.append((time.perf_counter() - t0) * 1000)
            m = re.search(r"Granted job allocation (\d+)", p.stderr)
            assert m, p.stderr
            subprocess.run(["scancel", m.group(1)], env=env, check=True)
        return out

    def stop(self) -> None:
        self._cm.__exit__(None, None, None)
        for k, v in self._saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


#: Engines measured next to the single host.
BACKENDS: list[type[Backend]] = [RayBackend, SlurmBackend]


def _ready(w: Any) -> None:
    def out(_text: str) -> None:
        pass

    deadline = time.perf_counter() + 120
    while w.ready is None:
        if w.poll(0.05, out, out) is not None or time.perf_counter() > deadline:
            raise RuntimeError("worker did not say it was ready")


def measure(backend: Backend, workdir: str, rounds: int, workers: int) -> dict[str, list[float]]:
    """Start the backend and its broker; ``rounds`` grant/release samples and ``workers`` worker starts (ms)."""
    sys.path.insert(0, TESTS)
    from pathlib import Path

    from broker_process import BrokerProcess

    backend.start(workdir)
    broker = None
    try:
        broker = BrokerProcess(Path(workdir) / "broker", gpus=6, nodes=2, args=[*backend.broker_args(), "--tick=0.05"],
                               env=backend.broker_env()).start(timeout=120)
        client = broker.client(timeout=60)
        if isinstance(backend, (SingleHost, SlurmBackend)):
            backend.bind(client)
        out: dict[str, list[float]] = {"grant": [], "release": [], "worker": []}
        for i in range(rounds + 2 + workers):  # the first two are warm-up
            t0 = time.perf_counter()
            lease = client.request_lease(1, heartbeat=False)
            if lease["state"] != "granted":
                raise RuntimeError(f"{backend.name}: not granted at once: {lease}")
            backend.held(lease)
            t1 = time.perf_counter()
            w = backend.worker(lease) if i >= rounds + 2 else None
            t2 = time.perf_counter()
            if w is not None:
                w.kill(0.5)
            t3 = time.perf_counter()
            client.release(lease["id"])
            backend.freed(lease)
            t4 = time.perf_counter()
            if 2 <= i < rounds + 2:
                out["grant"].append((t1 - t0) * 1000)
                out["release"].append((t4 - t3) * 1000)
            elif w is not None:
                out["worker"].append((t2 - t1) * 1000)
        client.close()
        out["reference"] = backend.reference(workers)
        return out
    finally:
        if broker is not None:
            broker.stop()
        backend.stop()


def run(opts: Any) -> list[Figure]:
    quick = bool(opts.quick)
    rounds, workers = (3, 1) if quick else (20, 10)
    tmp = tempfile.mkdtemp(prefix="glbackends")
    try:
        base = SingleHost()
        b = measure(base, os.path.join(tmp, "single"), rounds, workers)
        figures: list[Figure] = []
        for cls in BACKENDS:
            eng = cls()
            why = eng.missing()
            if why:
                print(f"   {eng.name}: skipped ({why})", flush=True)
                continue
            m = measure(eng, os.path.join(tmp, cls.__name__), rounds, workers)
            ref = (f"; for reference, {eng.reference_what} started and answered in "
                   f"{statistics.median(m['reference']):.0f} ms (median of {len(m['reference'])}) in this run"
                   if m.get("reference") else "")
            for key, label, bar, how in (
                ("grant", "lease grant", ("median", "<=", 400.0),
                 f"POST /leases until {eng.what_held} (single host: {base.what_held})"),
                ("release", "lease release", ("median", "<=", 100.0),
                 f"POST /release until {eng.what_freed} (single host: {base.what_freed})"),
                ("worker", "granted lease → %%gpu worker ready", None,
                 "a ready worker on the lease's GPU (single host: a cold local worker process)" + ref),
            ):
                if not m[key]:
                    continue
                figures.append(figure(
                    f"{label}, {eng.name}", "ms", m[key], f"{label}, single host", b[key], bar=bar,
                    note=f"{how}; p95 {p95(m[key]):.1f} ms (single host {p95(b[key]):.1f} ms); "
                         f"mean {statistics.fmean(m[key]):.1f} ms. 1-GPU leases through a real broker "
                         "(BrokerClient over its Unix socket), one at a time, 2 warm-up leases not counted. "
                         f"Load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores.",
                ))
        if not figures:  # no engine here: still report the single host
            figures.append(figure("lease grant, single host", "ms", b["grant"], "lease release, single host",
                                  b["release"], note="no multi-node backend could run here"))
        return figures
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
