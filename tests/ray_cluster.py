"""A real local Ray cluster with declared (fake) GPUs on two loopback nodes, for tests and benchmarks.

Head 127.0.0.2 with 4 GPUs, worker 127.0.0.3 with 2 (never 127.0.0.1: Ray rewrites it to the
host's routable address). Usage statistics off, auth disabled, no dashboard, small object
stores, and a fast health check so a removed node is noticed within seconds.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# before `import ray`: the cluster's processes inherit these
RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
    "RAY_health_check_initial_delay_ms": "0",
}
OBJECT_STORE = 80 * 1024 * 1024
# what a fixed test cluster does without: the autoscaler's monitor and the log monitor (drivers here never
# ask for worker logs); each is a Python process that imports Ray, seconds of CPU on a 2-core machine
LEAN = {"object_store_memory": OBJECT_STORE, "include_log_monitor": False}
HEAD, SECOND = "127.0.0.2", "127.0.0.3"


def ray_missing() -> str:
    """Why the Ray tests cannot run here ('' when they can)."""
    try:
        import ray  # noqa: F401
    except ImportError:
        return "ray is not installed: pip install -e '.[ray]' (make venv does)"
    return ""


class LocalRayCluster:
    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster
        self.address: str = cluster.address
        self.nodes: dict[str, Any] = {}

    def add_node(self, ip: str, gpus: int, cpus: int = 1) -> Any:
        node = self.cluster.add_node(node_ip_address=ip, num_gpus=gpus, num_cpus=cpus, **LEAN)
        self.nodes[ip] = node
        return node

    def remove_node(self, ip: str) -> None:
        self.cluster.remove_node(self.nodes.pop(ip), allow_graceful=False)

    @property
    def env(self) -> dict[str, str]:
        """Environment for processes that join this cluster (broker, kernels)."""
        return {**RAY_ENV, "RAY_ADDRESS": self.address}


@contextmanager
def local_ray_cluster(connect: bool = True, object_store: int = OBJECT_STORE) -> Iterator[LocalRayCluster]:
    """``object_store``: each node's object store (bytes; a benchmark that moves 200 MB values wants more)."""
    os.environ.update(RAY_ENV)
    import ray
    from ray.cluster_utils import Cluster

    for attempt in range(3):
        # Ray gives a node 30 s (hard-coded) to register: on a saturated 2-core machine that can
        # pass, and then the whole cluster is started again
        cluster = Cluster()
        c = LocalRayCluster(cluster)
        try:
            lean = {**LEAN, "object_store_memory": object_store}
            c.nodes[HEAD] = cluster.add_node(node_ip_address=HEAD, num_cpus=2, num_gpus=4, include_dashboard=False,
                                             no_monitor=True, **lean)
            c.address = cluster.address
            c.add_node(SECOND, gpus=2)
            cluster.wait_for_nodes()
            break
        except Exception:
            cluster.shutdown()
            if attempt == 2:
                raise
    try:
        if connect:
            ray.init(address=cluster.address, _node_ip_address=HEAD, namespace="gpulease-tests",
                     log_to_driver=False)
        yield c
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()


def private_mounts_missing() -> str:
    """Why a node in a private mount namespace cannot be started here ('' when it can): it needs root and
    util-linux's ``unshare``."""
    if os.geteuid() != 0:
        return "a node in a private mount namespace needs root (unshare --mount, mount -t tmpfs)"
    import shutil

    if not shutil.which("unshare"):
        return "util-linux's unshare is not installed"
    return ""


def private_mounts(hide: list[str]) -> list[str]:
    """The command prefix that runs a program in its own mount namespace, with an empty tmpfs over each path of
    ``hide`` (an artifact root, /dev/shm): a node that does not see what this host keeps there."""
    mounts = " && ".join(f"mount -t tmpfs -o mode=1777 none '{p}'" for p in hide)
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", f'{mounts} && exec "$0" "$@"']


class PrivateRayNode:
    """A raylet (``ray start --block``) joined to ``address`` as node ``ip``, in its own mount namespace: the
    paths of ``hide`` (and /dev/shm, its object store included) are an empty tmpfs there. Stopped by its process
    group."""

    def __init__(self, address: str, ip: str, gpus: int, hide: list[str], object_store: int = OBJECT_STORE) -> None:
        import subprocess
        import sys

        self.ip = ip
        ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
        cmd = [*private_mounts([*hide, "/dev/shm"]), ray_cli, "start", f"--address={address}",
               f"--node-ip-address={ip}", f"--num-gpus={gpus}", "--num-cpus=1",
               f"--object-store-memory={object_store}", "--block", "--disable-usage-stats"]
        # a busy 2-core machine starts the node's agents slowly: the raylet would give up on them after 15 s
        env = {**os.environ, **RAY_ENV, "RAY_agent_register_timeout_ms": "120000"}
        import tempfile

        fd, self.log = tempfile.mkstemp(prefix=f"gpulease-raylet-{ip}-", suffix=".log")
        with os.fdopen(fd, "wb") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def log_tail(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()[-3000:]

    def alive_in_ray(self) -> bool:
        import ray

        return any(n["Alive"] and n["NodeManagerAddress"] == self.ip for n in ray.nodes())

    def stop(self) -> None:
        import signal
        import subprocess

        for sig, wait in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # what is left of its group (raylet, object manager, workers)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.unlink(self.log)
        except FileNotFoundError:
            pass


def start_private_node(address: str, ip: str, gpus: int, hide: list[str], timeout: float = 120.0,
                       object_store: int = OBJECT_STORE) -> PrivateRayNode:
    """A ``PrivateRayNode`` once it is alive in the cluster: started again (3 tries) when ``ray start`` gives up,
    which it does after 30 s (hard-coded) on a saturated machine."""
    import time

    for attempt in range(3):
        node = PrivateRayNode(address, ip, gpus, hide, object_store)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and node.proc.poll() is None:
            if node.alive_in_ray():
                return node
            time.sleep(0.2)
        tail = node.log_tail()
        node.stop()
        if attempt == 2:
            raise RuntimeError(f"the raylet {ip} in a private mount namespace did not join {address}:\n{tail}")
    raise AssertionError("unreachable")
