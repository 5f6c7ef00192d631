"""Warm Ray cells: what a trivial single-use ``%%gpu`` cell on a Ray lease adds to an inline cell, with the node's
warm worker (``RayExecutor.warm``, the default) and without it (a new actor per cell), and a kernel's first Ray cell.

One run, one real local Ray cluster (head 127.0.0.2 with 4 GPUs, 127.0.0.3 with 2: tests/ray_cluster.py), one real
broker with ``--inventory=ray``, real kernels (tests/kernels.py) that join the cluster as drivers on the head. The
peers run in the same kernel, round by round with the ``%%gpu`` cells (drift hits them all alike): ipyparallel's
trivial ``%%px`` on one warm engine (benchmarks/cell_peers.py), and a call of a warm Ray actor on the same cluster
(what a cell could at best cost through Ray). A kernel's first Ray cell is timed in a new kernel each time (Ray's
driver connection, the lease, a worker of the node's warm host; the GPU IDs of the lease's group come from the lease
view, which the broker fills once the group is placed); apart from it, the first cell of the first kernel on the new
cluster, which starts the node's warm host (shared by every later kernel: executors/ray.py, WarmHost), and the CPU an
``import ray`` costs a fresh Python (each Ray worker process's start) against the kernel's (its IRI grammar deferred)
and a Ray worker's of a node started with the site directory (executors/ray_lazy_import.py). Then, on a second
cluster whose raylets have that directory first on PYTHONPATH (the admin guide's deployment), a kernel's first and
second Ray cells again.
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

from . import cell_peers
from .backends import TESTS
from .report import Figure, figure

TITLE = "Warm Ray cells: a trivial remote cell's added time and a kernel's first Ray cell"

ACTOR_SETUP = ("import ray as _ray\n"
               "@_ray.remote(num_cpus=0)\n"
               "class _Warm:\n"
               "    def call(self):\n"
               "        return None\n"
               "_warm = _Warm.remote()\n"
               "_ray.get(_warm.call.remote(), timeout=120)\n")
ACTOR_CALL = "_ray.get(_warm.call.remote())"


def _timed(kernel: Any, code: str, timeout: float = 300) -> float:
    t0 = time.perf_counter()
    r = kernel.run(code, timeout=timeout)
    took = (time.perf_counter() - t0) * 1000
    if r.status != "ok":
        raise RuntimeError(f"the cell failed: {code[:40]!r}: {r.outputs}")
    return took


def _connected(kernel: Any, timeout: float = 120) -> None:
    """Wait (polling, bounded) until the kernel's background start joined the Ray cluster (RayExecutor.prepare)."""
    deadline = time.monotonic() + timeout
    while kernel.run("import sys\n_c = 'ray' in sys.modules and sys.modules['ray'].is_initialized()\n_c").result != "True":
        if time.monotonic() > deadline:
            raise RuntimeError(f"the kernel did not join the Ray cluster within {timeout:g} s")
        time.sleep(0.2)


IMPORT_RAY = "import ray"
#: what the kernel does before its first ``import ray`` (executors/ray_lazy_import.py)
IMPORT_RAY_DEFERRED = ("from jupyter_gpulease.executors.ray_lazy_import import defer_iri_grammar\n"
                       "defer_iri_grammar()\nimport ray")


def _import_cpu(code: str, site: bool = False) -> float:
    """CPU seconds (user + system, in ms) of a fresh Python that runs ``code``: what each Ray worker process pays
    at its start for ``import ray``, and the kernel at its background join. ``site``: started as the Ray workers of
    a node whose ``ray start`` has the site directory first on PYTHONPATH (ray_lazy_import.site_dir)."""
    import resource
    import subprocess

    from jupyter_gpulease.executors.ray_lazy_import import site_dir

    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    if site:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (site_dir(), env.get("PYTHONPATH", "")) if p)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime) * 1000


def _first_two(k: Any, samples: dict[str, list[float]], tag: str) -> None:
    """A new kernel's first and second Ray cells right after its start (and one inline cell), into ``samples``
    (``<tag>first``, ``<tag>second``); then the kernel stops."""
    try:
        _timed(k, "pass")
        samples.setdefault(f"{tag}first", []).append(_timed(k, "%%gpu 1\npass"))
        samples.setdefault(f"{tag}second", []).append(_timed(k, "%%gpu 1\npass"))
    finally:
        k.stop()


def _site_firsts(tmp: str, firsts: int, samples: dict[str, list[float]]) -> None:
    """A kernel's first and second Ray cells on a cluster whose raylets start their worker processes with the site
    directory first on PYTHONPATH (ray_lazy_import), as the admin guide's deployment says."""
    from broker_process import BrokerProcess
    from kernels import Kernel
    from ray_cluster import HEAD, local_ray_cluster

    from jupyter_gpulease.executors.ray_lazy_import import site_dir

    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (site_dir(), before or "") if p)  # the raylets inherit it
    try:
        with local_ray_cluster() as c:
            broker = None
            try:
                broker = BrokerProcess(Path(tmp) / "broker-site", args=[
                    "--inventory=ray", f"--RayInventory.address={c.address}", f"--RayInventory.node_ip={HEAD}",
                    "--tick=0.1", "--LeasePolicy.heartbeat_timeout=0"], env=c.env).start(timeout=120)
                env = {**c.env, "GPULEASE_RAY_NODE_IP": HEAD}
                _first_two(Kernel(broker.url, os.path.join(tmp, "artifacts-site-host"), env), samples, "site_host_")
                for i in range(firsts):
                    _first_two(Kernel(broker.url, os.path.join(tmp, f"artifacts-site{i}"), env), samples, "site_")
            finally:
                if broker is not None:
                    broker.stop()
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before


def run(opts: Any) -> list[Figure]:
    n = 3 if opts.quick else 20
    firsts = 1 if opts.quick else 3
    sys.path.insert(0, TESTS)
    from ray_cluster import ray_missing

    if ray_missing():
        print(f"   skipped: {ray_missing()}", flush=True)
        return []
    from broker_process import BrokerProcess
    from kernels import Kernel
    from ray_cluster import HEAD, local_ray_cluster

    tmp = tempfile.mkdtemp(prefix="glwarmray")
    samples: dict[str, list[float]] = {}
    for _ in range(firsts):
        samples.setdefault("import", []).append(_import_cpu(IMPORT_RAY))
        samples.setdefault("import_deferred", []).append(_import_cpu(IMPORT_RAY_DEFERRED))
        samples.setdefault("import_site", []).append(_import_cpu(IMPORT_RAY, site=True))
    missing: dict[str, str] = {}
    try:
        with local_ray_cluster() as c:
            broker = kernel = None
            try:
                broker = BrokerProcess(Path(tmp) / "broker", args=[
                    "--inventory=ray", f"--RayInventory.address={c.address}", f"--RayInventory.node_ip={HEAD}",
                    "--tick=0.1", "--LeasePolicy.heartbeat_timeout=0"], env=c.env).start(timeout=120)
                env = {**c.env, "GPULEASE_RAY_NODE_IP": HEAD}

                def new_kernel(name: str) -> Any:
                    ipython = os.path.join(tmp, f"ipython-{name}")
                    return Kernel(broker.url, os.path.join(tmp, f"artifacts-{name}"),
                                  {**env, **cell_peers.env(ipython)})

                # the first kernel on the cluster: its first cell there starts the node's warm host
                _first_two(new_kernel("host"), samples, "host_")
                for i in range(firsts):  # a kernel's first Ray cell: a new kernel each time
                    _first_two(new_kernel(f"first{i}"), samples, "")
                    k = new_kernel(f"connected{i}")  # the same, once the kernel's start joined the cluster
                    try:
                        _connected(k)
                        samples.setdefault("connected", []).append(_timed(k, "%%gpu 1\npass"))
                    finally:
                        k.stop()
                kernel = new_kernel("rounds")
                _timed(kernel, "%%gpu 1\npass")  # Ray's driver connected
                _timed(kernel, ACTOR_SETUP)
                missing = cell_peers.start(kernel, [cell_peers.PX])
                executor = "get_ipython().magics_manager.registry['GpuMagics'].executors['ray']"
                for _ in range(n):
                    samples.setdefault("inline", []).append(_timed(kernel, "pass"))
                    samples.setdefault("warm", []).append(_timed(kernel, "%%gpu 1\npass"))
                    samples.setdefault("actor", []).append(_timed(kernel, ACTOR_CALL))
                    if not missing:
                        samples.setdefault("px", []).append(_timed(kernel, cell_peers.PX.trivial))
                _timed(kernel, f"{executor}.warm = False")
                for _ in range(max(2, n // 4)):  # slow (an actor per cell): fewer rounds
                    samples.setdefault("inline_cold", []).append(_timed(kernel, "pass"))
                    samples.setdefault("cold", []).append(_timed(kernel, "%%gpu 1\npass"))
                _timed(kernel, f"{executor}.warm = True")
                cell_peers.stop(kernel, [cell_peers.PX])
            finally:
                if kernel is not None:
                    kernel.stop()
                if broker is not None:
                    broker.stop()
        _site_firsts(tmp, firsts, samples)
    finally:
        cell_peers.kill_leftovers(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
    inline = statistics.median(samples["inline"])
    inline_cold = statistics.median(samples["inline_cold"])
    load = f"Load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores."
    px = samples.get("px", [])
    px_name = cell_peers.PX.name + (f" (missing: {missing[cell_peers.PX.name]})" if missing else "") + \
        ", its whole cell"
    return [
        figure("trivial Ray %%gpu cell, added time (warm worker)", "ms", [s - inline for s in samples["warm"]],
               px_name, px, bar=("median", "<=", 100.0),
               note=f"a single-use `%%gpu 1` cell of `pass` (lease, the node's warm worker lent with the group's GPU "
                    f"IDs, release) less the median inline `pass` cell ({inline:.1f} ms) of the same rounds. {load}"),
        figure("trivial Ray %%gpu cell, added time (a new actor per cell)", "ms",
               [s - inline_cold for s in samples["cold"]],
               "a warm Ray actor's call from the same kernel, its whole cell", samples["actor"],
               note="RayExecutor.warm = False: the cell starts an actor (a Ray worker process) and an interpreter "
                    "in the lease's placement group, as every Ray cell did before the warm worker."),
        figure("a kernel's first Ray %%gpu cell", "ms", samples["first"],
               "its second Ray %%gpu cell", samples["second"], bar=("median", "<=", 3000.0),
               note="a new kernel each sample, its first Ray cell right after its start (and one inline cell): it "
                    "waits for the kernel's background join of the Ray cluster (import ray, ray.init: "
                    "RayExecutor.connect_early), takes a lease and borrows a worker of the node's warm host, which an "
                    "earlier kernel started (the next row) and this one finds by name: no Ray worker process of the "
                    "kernel's own job (the GPU IDs of the lease's group come from the lease view, "
                    "placement.bundles[i].gpu_ids, which the broker learns); the GPU nodes' Ray started plainly "
                    "(`ray start`)."),
        figure("the first kernel's first Ray %%gpu cell on a new cluster (it starts the node's warm host)", "ms",
               samples["host_first"], "its second Ray %%gpu cell", samples["host_second"],
               note="the first kernel on the cluster, once per node for the cluster's life (the host is detached and "
                    "shared): its first cell starts the node's warm host (one new Ray worker process, a new Python's "
                    "import ray: the import row below), then borrows its worker; the GPU nodes' Ray started plainly."),
        figure("a kernel's first Ray %%gpu cell, once the kernel joined the cluster", "ms", samples["connected"],
               "its first Ray %%gpu cell right after its start", samples["first"],
               note="a new kernel each sample, its first Ray cell once its background join of the cluster finished "
                    "(polled): the lease, a worker of the node's warm host, the cell."),
        figure("import ray in a fresh Python, CPU time", "ms", samples["import"],
               "the same, the kernel's way (the IRI grammar deferred)", samples["import_deferred"],
               note="user + system CPU of `python -c 'import ray'`: what every new Ray worker process (an actor, a "
                    "task's worker) pays at its start, a kernel's first cell on a node waits for one; most of it is "
                    "rfc3987_syntax building its IRI grammar at import (jsonschema's optional dependency, via "
                    "jupyter-events). The baseline: what the kernel's background join pays "
                    "(executors/ray_lazy_import.py)."),
        figure("a kernel's first Ray %%gpu cell, its GPU nodes' Ray started with the site directory", "ms",
               samples["site_first"], "its second Ray %%gpu cell", samples["site_second"], bar=("median", "<=", 3000.0),
               note="as the first row, on a cluster whose raylets have `python -m "
                    "jupyter_gpulease.executors.ray_lazy_import` first on PYTHONPATH, as the admin guide's deployment "
                    "for Ray says (Multi-node with Ray): each Ray worker process starts without the IRI grammar."),
        figure("the first kernel's first Ray %%gpu cell on a new cluster, its GPU nodes' Ray started with the site "
               "directory", "ms", samples["site_host_first"], "its second Ray %%gpu cell", samples["site_host_second"],
               note="as the row of the first kernel above, on the cluster with the site directory: the node's warm "
                    "host starts without the IRI grammar."),
        figure("import ray in a fresh Python, CPU time", "ms", samples["import"],
               "the same, started with the Ray worker site directory first on PYTHONPATH", samples["import_site"],
               note="what each Ray worker process of a GPU node pays at its start when its `ray start` has "
                    "`python -m jupyter_gpulease.executors.ray_lazy_import` first on PYTHONPATH (admin guide, "
                    "Multi-node with Ray): its sitecustomize defers the IRI grammar, then runs the site's own."),
    ]
