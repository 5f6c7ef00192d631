"""Values between a kernel and a Ray worker on a node that sees the shared artifact root and on one that does not.

The session's real local Ray cluster (head 127.0.0.2 with 4 GPUs, 127.0.0.3 with 2) gains a third raylet,
127.0.0.4 with 2 GPUs, in its own mount namespace (``ray_cluster.PrivateRayNode``): the kernel's artifact root and
/dev/shm are an empty tmpfs there. The kernel writes a marker into the lease's directory; the node's actor reads it
or not (``executors.base.RootCheck``): values then travel through the shared root, or through Ray's object store.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import waiting
from broker_process import BrokerProcess
from ray_cluster import HEAD, SECOND, LocalRayCluster, private_mounts_missing, ray_missing, start_private_node
from remote_fixtures import (
    buffer_files_made,
    hidden_dir,
    kernel_of,
    ray_broker,
    ray_env,
    released_client,
    running,
)

from jupyter_gpulease.client import BrokerClient

pytestmark = [
    pytest.mark.skipif(bool(ray_missing()), reason=ray_missing() or "ray installed"),
    pytest.mark.skipif(bool(private_mounts_missing()), reason=private_mounts_missing() or "root"),
    pytest.mark.timeout(600),
]

T = 60.0
PRIVATE = "127.0.0.4"
wait_for = functools.partial(waiting.wait_for, timeout=T, interval=0.2)


@pytest.fixture(scope="module")
def hidden() -> Iterator[str]:
    """The directory above the kernel's artifact root: an empty tmpfs on the private node."""
    with hidden_dir("gpulease-unshared-") as d:
        yield d


@pytest.fixture(scope="module")
def cluster(ray_cluster: LocalRayCluster, hidden: str) -> Iterator[LocalRayCluster]:
    node = start_private_node(ray_cluster.address, PRIVATE, gpus=2, hide=[hidden])
    try:
        yield ray_cluster
    finally:
        node.stop()
        import ray

        wait_for(lambda: not any(n["Alive"] and n["NodeManagerAddress"] == PRIVATE for n in ray.nodes()),
                 what="the private raylet to leave the cluster")


@pytest.fixture(scope="module")
def broker(cluster: LocalRayCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    b = ray_broker(cluster, tmp_path_factory.mktemp("ray-values-broker"),
                   "--LeasePolicy.heartbeat_timeout=0", timeout=T)  # (held leases)
    with running(b):
        yield b


@pytest.fixture
def client(broker: BrokerProcess) -> Iterator[BrokerClient]:
    with released_client(broker, T) as c:
        yield c


@pytest.fixture(scope="module")
def kernel(cluster: LocalRayCluster, broker: BrokerProcess, hidden: str) -> Iterator[Any]:
    with kernel_of(broker, os.path.join(hidden, "artifacts"), ray_env(cluster)) as k:
        yield k


def _ready(c: BrokerClient, lease: dict[str, Any]) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        view = c.lease(lease["id"])
        return view if (view.get("placement") or {}).get("state") == "ready" else None

    return wait_for(check, what=f"placement group of {lease['id']} ready")


def _leave_free_only(client: BrokerClient, node: str) -> None:
    """Hold every GPU but those of ``node`` (2), so that the next 2-GPU cell lands there."""
    held = [_ready(client, client.request_lease(4, wait=T))]
    held += [_ready(client, client.request_lease(2, wait=T)) for _ in range(2)]
    assert sorted(v["node"] for v in held) == sorted([HEAD, SECOND, PRIVATE])
    client.release(next(v for v in held if v["node"] == node)["id"])


LARGE = (
    "%%gpu 2 --in x --out y,where\n"
    "import os\n"
    "x[0] = 0.0  # writable, as a local cell's\n"
    "y = x * 2\n"
    "where = os.environ['GPULEASE_NODE_IP']\n"
)


def _large_values_both_ways(kernel: Any, node: str) -> None:
    r = kernel.run("import numpy as np\nx = np.arange(1 << 21, dtype='float64')  # 16 MiB")
    assert r.status == "ok", r.outputs
    r = kernel.run(LARGE, timeout=T * 2)
    assert r.status == "ok", (r.outputs, r.reply)
    assert kernel.run("where").result == repr(node)
    assert kernel.run("bool((y == x * 2).all()), y.nbytes").result == f"(True, {8 << 21})"


def test_large_values_on_a_node_that_shares_the_artifact_root(kernel: Any, client: BrokerClient,
                                                              hidden: str) -> None:
    _leave_free_only(client, SECOND)
    made = buffer_files_made(kernel, lambda: _large_values_both_ways(kernel, SECOND))
    root = Path(hidden, "artifacts")
    assert list(root.glob("*/.oob")) and not list(root.glob("*/.oob/*"))  # through the shared root, read there
    assert made and all("/.oob/" in path for path in made)  # the inputs' file, written there at once


def test_large_values_on_a_node_with_an_unshared_root_go_through_the_object_store(
        kernel: Any, client: BrokerClient, hidden: str) -> None:
    _leave_free_only(client, PRIVATE)
    seen = {v["id"] for v in client.leases(ended=100)}
    made = buffer_files_made(kernel, lambda: _large_values_both_ways(kernel, PRIVATE))
    assert made == []  # the inputs went packed into the message (Ray's object store): no file of them here, ever
    lease = next(v for v in client.leases(ended=100) if v["id"] not in seen and v["node"] == PRIVATE)
    assert not os.path.exists(os.path.join(hidden, "artifacts", lease["id"], ".oob"))  # not through the shared root


WRITE = ("%%gpu 2\nimport os\nos.makedirs(os.path.join(os.environ['GPULEASE_ARTIFACTS'], 'ckpt'))\n"
         "open(os.path.join(os.environ['GPULEASE_ARTIFACTS'], 'ckpt', 'model.pt'), 'w').write('weights')\n")


def test_unshared_root_files_the_cell_wrote_come_back_to_the_artifact_directory(kernel: Any, client: BrokerClient,
                                                                                hidden: str) -> None:
    _leave_free_only(client, PRIVATE)
    seen = {v["id"] for v in client.leases(ended=100)}
    r = kernel.run(WRITE, timeout=T * 2)
    assert r.status == "ok", (r.outputs, r.reply)
    lease = next(v for v in client.leases(ended=100) if v["id"] not in seen)
    assert lease["node"] == PRIVATE
    here = os.path.join(hidden, "artifacts", lease["id"])
    assert os.path.exists(os.path.join(here, ".gpulease-marker"))  # the kernel's marker, which the node could not read
    with open(os.path.join(here, "ckpt", "model.pt")) as f:  # copied back at the cell's end, where the summary says
        assert f.read() == "weights"
    assert here in r.stdout + r.stderr


def test_unshared_root_too_many_files_stay_named_with_the_node_and_the_fix(kernel: Any, client: BrokerClient,
                                                                           hidden: str) -> None:
    _leave_free_only(client, PRIVATE)
    assert kernel.run("%env GPULEASE_FILES_BACK_MAX=3").status == "ok"
    try:
        r = kernel.run(WRITE, timeout=T * 2)
    finally:
        kernel.run("%env GPULEASE_FILES_BACK_MAX=")
    assert r.status == "ok", (r.outputs, r.reply)
    line = next(s for s in r.stderr.splitlines() if "does not see the artifact root" in s)
    assert f"node {PRIVATE} " in line and os.path.join(hidden, "artifacts") in line and "GpuMagics.artifact_root" in line


def test_unshared_root_session_parking_fails_at_once_in_one_line(kernel: Any, client: BrokerClient,
                                                                hidden: str) -> None:
    """A session on a node without the shared root cannot park (its state would stay on the node): said when the
    session starts, in one line naming the node, the path and the fix; the session itself runs."""
    _leave_free_only(client, PRIVATE)
    r = kernel.run("%%gpu 2 --session far\nmodel = [1, 2]\nprint(len(model))", timeout=T * 2)
    try:
        assert r.status == "ok", (r.outputs, r.reply)
        line = next(s for s in r.stderr.splitlines() if "cannot be parked" in s)
        assert f"node {PRIVATE} does not see the artifact root" in line and os.path.join(hidden, "artifacts") in line
        assert "GpuMagics.artifact_root" in line
    finally:
        kernel.run("%gpu session stop far")
