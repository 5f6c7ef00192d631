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
def local_ray_cluster(connect: bool = True) -> Iterator[LocalRayCluster]:
    os.environ.update(RAY_ENV)
    import ray
    from ray.cluster_utils import Cluster

    for attempt in range(3):
        # Ray gives a node 30 s (hard-coded) to register: on a saturated 2-core machine that can
        # pass, and then the whole cluster is started again
        cluster = Cluster()
        c = LocalRayCluster(cluster)
        try:
            c.nodes[HEAD] = cluster.add_node(node_ip_address=HEAD, num_cpus=2, num_gpus=4, include_dashboard=False,
                                             no_monitor=True, **LEAN)
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
