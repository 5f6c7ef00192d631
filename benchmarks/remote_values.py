"""Large values to and from remote cells, on a node that sees the shared artifact root and on one that does not.

A real kernel (``tests/kernels.py``) and a real broker per engine: a local Ray cluster (head 127.0.0.2 with 4
GPUs, 127.0.0.3 with 2) with a third raylet, 127.0.0.4 with 2 GPUs, in a private mount namespace
(``ray_cluster.start_private_node``); a local Slurm whose n2 runs in one (``slurm_cluster``'s ``private``). There the
kernel's artifact root and /dev/shm are an empty tmpfs: the marker check fails and values go through the
executor's own channel (Ray's object store; the direct channel between the kernel and the Slurm relay, and, for
comparison on the same node, srun's own stdio), else through the shared root. Each sample is
one single-use cell's wall time in the kernel (``--in`` and ``--out``, lease and worker start included), the
baseline the same cell on a node that shares the root.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .backends import TESTS
from .report import Figure, figure

TITLE = "Remote cells: large values with and without a shared artifact root (Ray, Slurm)"

CELLS = {
    "200 MB in and out": ("x = np.ones(25_000_000)", "--in x --out y", "y = x"),
    "200 arrays of 0.88 MB in and out": ("xs = [np.ones(110_000) for _ in range(200)]", "--in xs --out ys", "ys = xs"),
}
STORE = 1 << 30  # each Ray node's object store: 200 MB values in and out fit (the tests' 80 MiB would spill)


def _cell(kernel: Any, gpus: int, name: str, node_var: str) -> tuple[float, str]:
    make, flags, body = CELLS[name]
    r = kernel.run(f"import numpy as np\n{make}\nnone = None", timeout=120)
    assert r.status == "ok", r.outputs
    t0 = time.perf_counter()
    r = kernel.run(f"%%gpu {gpus} {flags},where\nimport os\n{body}\nwhere = os.environ[{node_var!r}]\n", timeout=600)
    took = (time.perf_counter() - t0) * 1000
    print(f"   {name}, {gpus} GPUs: {took:.0f} ms", flush=True)
    if r.status != "ok":
        raise RuntimeError(f"the cell failed: {r.outputs}")
    return took, str(kernel.run("where").result)


def _ray(workdir: str, n: int) -> dict[str, dict[str, list[float]]]:
    from broker_process import BrokerProcess
    from kernels import Kernel
    from ray_cluster import HEAD, local_ray_cluster, start_private_node

    hidden = tempfile.mkdtemp(prefix="gpulease-unshared-", dir="/tmp")
    out: dict[str, dict[str, list[float]]] = {}
    try:
        with local_ray_cluster(object_store=STORE) as c:
            node = start_private_node(c.address, "127.0.0.4", 2, [hidden], object_store=STORE)
            broker = kernel = None
            try:
                broker = BrokerProcess(Path(workdir) / "broker", args=[
                    "--inventory=ray", f"--RayInventory.address={c.address}", f"--RayInventory.node_ip={HEAD}",
                    "--tick=0.1", "--LeasePolicy.heartbeat_timeout=0"], env=c.env).start(timeout=120)
                client = broker.client(timeout=120)
                kernel = Kernel(broker.url, os.path.join(hidden, "artifacts"), {**c.env, "GPULEASE_RAY_NODE_IP": HEAD})
                for where, gpus in (("shared", 4), ("unshared", 2)):
                    held: list[dict[str, Any]] = []
                    if where == "unshared":  # every GPU but the private node's
                        held = [client.request_lease(4, wait=120), client.request_lease(2, wait=120),
                                client.request_lease(2, wait=120)]
                        for lease in held:
                            _placed(client, lease)
                        free = next(v for v in (client.lease(h["id"]) for h in held) if v["node"] == "127.0.0.4")
                        client.release(free["id"])
                    for name in CELLS:
                        for _ in range(n):
                            ms, at = _cell(kernel, gpus, name, "GPULEASE_NODE_IP")
                            assert at == repr(HEAD if where == "shared" else "127.0.0.4"), at
                            out.setdefault(name, {}).setdefault(where, []).append(ms)
                    for lease in held:
                        if client.lease(lease["id"])["phase"] != "ended":
                            client.release(lease["id"])
            finally:
                if kernel is not None:
                    kernel.stop()
                if broker is not None:
                    broker.stop()
                node.stop()
    finally:
        shutil.rmtree(hidden, ignore_errors=True)
    return out


def _placed(client: Any, lease: dict[str, Any]) -> None:
    deadline = time.monotonic() + 120
    while (client.lease(lease["id"]).get("placement") or {}).get("state") != "ready":
        if time.monotonic() > deadline:
            raise RuntimeError(f"lease {lease['id']} was not placed within 120 s")
        time.sleep(0.1)


def _slurm(workdir: str, n: int) -> dict[str, dict[str, list[float]]]:
    from broker_process import BrokerProcess
    from kernels import Kernel
    from slurm_cluster import local_slurm_cluster

    hidden = tempfile.mkdtemp(prefix="gpulease-unshared-", dir="/tmp")
    out: dict[str, dict[str, list[float]]] = {}
    try:
        with local_slurm_cluster(private={"n2": [hidden]}) as c:
            broker = kernel = None
            try:
                broker = BrokerProcess(Path(workdir) / "broker", args=[
                    "--inventory=slurm", "--tick=0.1", "--SlurmInventory.placement_timeout=10"],
                    env=c.env).start(timeout=120)
                kernel = Kernel(broker.url, os.path.join(hidden, "artifacts"), c.env)
                for where, gpus, node in (("shared", 4, "n1"), ("unshared", 2, "n2"), ("stdio", 2, "n2")):
                    if where == "stdio":  # the same node, values through srun's stdio (the direct channel off)
                        r = kernel.run("get_ipython().magics_manager.registry['GpuMagics'].executors['slurm']"
                                       ".direct_channel = False")
                        assert r.status == "ok", r.outputs
                    for name in CELLS:
                        for _ in range(n):
                            ms, at = _cell(kernel, gpus, name, "GPULEASE_NODE")
                            assert at == repr(node), at
                            out.setdefault(name, {}).setdefault(where, []).append(ms)
            finally:
                if kernel is not None:
                    kernel.stop()
                if broker is not None:
                    broker.stop()
                c.cancel_all()
    finally:
        shutil.rmtree(hidden, ignore_errors=True)
    return out


def run(opts: Any) -> list[Figure]:
    n = 1 if opts.quick else 3
    sys.path.insert(0, TESTS)
    from ray_cluster import private_mounts_missing, ray_missing
    from slurm_cluster import slurm_missing

    if private_mounts_missing():
        print(f"   skipped: {private_mounts_missing()}", flush=True)
        return []
    tmp = tempfile.mkdtemp(prefix="glvalues")
    figures: list[Figure] = []
    try:
        for engine, missing, measure, channel in (
                ("Ray", ray_missing(), _ray, "Ray's object store (the actor writes the inputs to a file on its node; "
                                             "results come back in the actor's replies)"),
                ("Slurm", slurm_missing(), _slurm, "the direct channel between the kernel and the relay (TCP, "
                                                   "HMAC-SHA256 on every frame)")):
            if missing:
                print(f"   {engine}: skipped ({missing})", flush=True)
                continue
            m = measure(os.path.join(tmp, engine), n)
            for name, by in m.items():
                if "stdio" in by:
                    figures.append(figure(
                        f"{name}, {engine}, node without the shared root: direct channel", "ms", by["unshared"],
                        f"{name}, {engine}, node without the shared root: srun's stdio", by["stdio"],
                        note="the same cell on the same node: through the direct channel (a TCP connection from the "
                             "relay to the kernel, HMAC-SHA256 on every frame), against srun's own stdio (base64 "
                             "lines through slurmstepd; SlurmExecutor.direct_channel = False)"))
                figures.append(figure(
                    f"{name}, {engine}, node without the shared root", "ms", by["unshared"],
                    f"{name}, {engine}, node that shares the root", by["shared"],
                    note=f"one single-use %%gpu cell (lease, worker start, values both ways); without the shared "
                         f"root through {channel}. Load average at the end: {os.getloadavg()[0]:.1f} on "
                         f"{os.cpu_count()} cores."))
        return figures
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
