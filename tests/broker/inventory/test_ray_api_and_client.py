"""The Python API (``lease``, ``on_gpu``, ``map``) through the executor of the lease's placement, and a notebook host
without a Ray node: a REAL local Ray cluster (tests/ray_cluster.py), a REAL broker with ``--inventory=ray``, a REAL
kernel (tests/kernels.py), and for the host without a raylet a REAL Python process in its own PID namespace
(``unshare --pid``: it sees none of this host's raylets, as a notebook host that runs no Ray node).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import waiting
from broker_process import BrokerProcess
from ray_cluster import HEAD, SECOND, LocalRayCluster, ray_missing
from remote_fixtures import ray_cell_fixtures, ray_env

from jupyter_gpulease.client import BrokerClient

pytestmark = [
    pytest.mark.skipif(bool(ray_missing()), reason=ray_missing() or "ray installed"),
    pytest.mark.timeout(600),
]

T = 60.0  # generous: on a busy 2-core machine an actor may take seconds to start

wait_for = functools.partial(waiting.wait_for, timeout=T, interval=0.05)


broker, client, kernel = ray_cell_fixtures("ray-api", timeout=T)


def _hold_head(client: BrokerClient) -> dict[str, Any]:
    """Hold the head's 4 GPUs, so that the next lease lands on the second node."""
    lease = client.request_lease(4, wait=T)
    lease = wait_for(lambda: (v := client.lease(lease["id"]))["state"] in ("granted", "active", "idle") and v,
                     what="the head's lease")
    assert lease["node"] == HEAD
    return lease


WHERE = ("import os, jupyter_gpulease\n"
         "def where(x):\n"
         "    return os.environ.get('GPULEASE_NODE_IP'), bool(os.environ.get('GPULEASE_RAY_ACTOR_ID')), os.getpid(), x * 2\n")


def test_api_lease_runs_its_calls_on_the_ray_node_of_the_lease(kernel: Any, client: BrokerClient) -> None:
    _hold_head(client)
    r = kernel.run(WHERE + "with jupyter_gpulease.lease(2) as held:\n"
                   "    a = held.run(where, 1)\n    b = held.run(where, 2)\n    kind = held.info.placement['kind']\n"
                   "print(kind, a[0], a[1], a[3], b[3], a[2] != b[2], a[2] != os.getpid())\n", timeout=T * 3)
    assert r.status == "ok", r.outputs
    assert r.stdout.split() == ["ray", SECOND, "True", "2", "4", "True", "True"], r.stdout
    mine = [v for v in client.leases(ended=20) if v["labels"].get("source") == "api"]
    assert mine and all(v["phase"] == "ended" for v in mine)


def test_api_on_gpu_and_map_run_on_the_ray_node(kernel: Any, client: BrokerClient) -> None:
    _hold_head(client)
    r = kernel.run(WHERE + "print('one', *jupyter_gpulease.on_gpu(1)(where)(5)[:2])\n"
                   "res = jupyter_gpulease.map(where, [1, 2, 3], gpus_per_call=1, max_gpus=2)\n"
                   "print('map', {n for n, _, _, _ in res}, [v for _, _, _, v in res])\n", timeout=T * 4)
    assert r.status == "ok", r.outputs
    assert f"one {SECOND} True" in r.stdout, r.stdout
    assert f"map {{'{SECOND}'}} [2, 4, 6]" in r.stdout, r.stdout
    wait_for(lambda: not [v for v in client.leases() if v["phase"] != "ended" and v["node"] != HEAD],
             what="the API's leases released")


# ------------------------------------------------------------------------------ a notebook host without a raylet
def _no_raylet_missing() -> str:
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return "a process that sees no raylet of this host needs root and util-linux's unshare (unshare --pid)"
    return ""


def _run_without_raylet(broker: BrokerProcess, cluster: LocalRayCluster, tmp_path: Path, code: str,
                        env: dict[str, str] | None = None, timeout: float = T * 3) -> subprocess.CompletedProcess[str]:
    """``code`` in a Python process of its own PID namespace (it sees none of this host's raylets), as a client of
    ``broker``."""
    script = tmp_path / "no_raylet.py"
    script.write_text(textwrap.dedent(code))
    full = {k: v for k, v in os.environ.items() if not k.startswith(("GPULEASE_", "RAY_ADDRESS"))}
    full.update({**cluster.env, "GPULEASE_BROKER": broker.url, "GPULEASE_ARTIFACT_ROOT": str(tmp_path / "art"),
                 "PYTHONPATH": os.pathsep.join(sys.path), **(env or {})})
    full.pop("RAY_ADDRESS", None)
    return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, str(script)], env=full,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(bool(_no_raylet_missing()), reason=_no_raylet_missing() or "unshare usable")
def test_no_raylet_on_the_notebook_host_fails_at_once_naming_the_option(
        ray_cluster: LocalRayCluster, broker: BrokerProcess, client: BrokerClient, tmp_path: Path) -> None:
    r = _run_without_raylet(broker, ray_cluster, tmp_path, """
        import time, jupyter_gpulease
        t = time.monotonic()
        import ray  # what any first Ray cell pays (seconds on a busy 2-core machine): not the wait measured here
        print('IMPORT', round(time.monotonic() - t, 1))
        with jupyter_gpulease.lease(1) as held:
            t0 = time.monotonic()
            try:
                held.run(print, 'never')
            except Exception as e:
                print('ERROR', type(e).__name__, round(time.monotonic() - t0, 1), str(e), sep='|')
    """)
    assert r.returncode == 0, r.stderr
    line = next((x for x in r.stdout.splitlines() if x.startswith("ERROR|")), "")
    assert line, (r.stdout, r.stderr)
    _, name, took, text = line.split("|", 3)
    assert name == "RayStartError" and "RayExecutor.client_address" in text and "ray://" in text, line
    assert float(took) < 5, took  # not ray.init's 60 s wait for a local node
    print(f"no raylet: the cell failed {took} s after its lease was granted (import ray before: "
          f"{r.stdout.split('IMPORT ')[1].split()[0]} s)")
    assert "never" not in r.stdout
    wait_for(lambda: not [v for v in client.leases() if v["phase"] != "ended"], what="the lease released")


def test_joining_the_cluster_off_the_main_thread_says_nothing_in_the_cell(ray_cluster: LocalRayCluster,
                                                                           tmp_path: Path) -> None:
    """The kernel joins the Ray cluster in the background at its start (``RayExecutor.prepare``); Ray warned then
    that it set no SIGTERM handler off the main thread, on stderr, in whatever cell ran meanwhile."""
    code = ("import threading\nfrom jupyter_gpulease.executors.ray import _connect\n"
            f"t = threading.Thread(target=_connect, args=({{'address': {ray_cluster.address!r}, "
            "'namespace': 'gpulease-join'},))\nt.start()\nt.join()\nimport ray\nprint('joined', ray.is_initialized())\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env={**os.environ, **ray_env(ray_cluster)})
    assert r.returncode == 0 and "joined True" in r.stdout, (r.stdout, r.stderr)
    assert "SIGTERM handler" not in r.stderr, r.stderr


def _ray_client_missing() -> str:
    try:
        import grpc  # noqa: F401
    except ImportError:
        return "Ray Client needs grpcio (pip install 'ray[client]')"
    return _no_raylet_missing()


@pytest.fixture(scope="module")
def ray_client_server(ray_cluster: LocalRayCluster) -> Iterator[str]:
    """Ray's own Ray Client server (``ray.util.client.server``) on the head node, in its single-driver mode: ``ray start
    --head`` runs it on port 10001 as a proxy that starts one such server per client, which needs the runtime-env
    agent that this lean test cluster does without."""
    import socket

    with socket.socket() as s:
        s.bind((HEAD, 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "ray.util.client.server", f"--address={ray_cluster.address}",
                             f"--host={HEAD}", f"--port={port}", "--mode=legacy"],
                            env={**os.environ, **ray_cluster.env}, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def listening() -> bool:
        with socket.socket() as s:
            return s.connect_ex((HEAD, port)) == 0

    try:
        wait_for(listening, what="the Ray Client server")
        yield f"ray://{HEAD}:{port}"
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait(5)


@pytest.mark.skipif(bool(_ray_client_missing()), reason=_ray_client_missing() or "Ray Client usable")
def test_ray_client_runs_cells_from_a_host_without_a_raylet(
        ray_cluster: LocalRayCluster, broker: BrokerProcess, client: BrokerClient, ray_client_server: str,
        tmp_path: Path) -> None:
    _hold_head(client)
    t0 = time.monotonic()
    r = _run_without_raylet(broker, ray_cluster, tmp_path, """
        import os, jupyter_gpulease
        def where(x):
            return os.environ.get('GPULEASE_NODE_IP'), os.environ.get('CUDA_VISIBLE_DEVICES'), x * 2
        with jupyter_gpulease.lease(2) as held:
            print('RESULT', *held.run(where, 21))
    """, env={"GPULEASE_RAY_CLIENT_ADDRESS": ray_client_server})
    assert r.returncode == 0, (r.stdout, r.stderr[-3000:])
    assert f"RESULT {SECOND} " in r.stdout and r.stdout.split()[-1] == "42", r.stdout
    print(f"a call through Ray Client from a host without a raylet: {time.monotonic() - t0:.1f} s")
    wait_for(lambda: not [v for v in client.leases() if v["phase"] != "ended" and v["node"] != HEAD],
             what="the lease released")
