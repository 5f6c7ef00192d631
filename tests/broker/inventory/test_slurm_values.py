"""Values between a kernel and a Slurm step on a node that sees the shared artifact root and on one that does not.

A real local Slurm of its own (tests/slurm_cluster.py) whose node ``n2`` runs its slurmd, and so every step there,
in a private mount namespace: the kernel's artifact root and /dev/shm are an empty tmpfs on n2; ``n1`` shares them.
The kernel writes a marker into the lease's directory; the step's relay reads it or not
(``executors.base.RootCheck``): values then travel through the shared root, or through the direct channel between
the kernel and the relay (``executors.slurm_bulk``: TCP, a key sent on srun's stdin, every frame authenticated).
Needs root; skipped with the reason otherwise.
"""

from __future__ import annotations

import ast
import functools
import os
import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import waiting
from broker_process import BrokerProcess
from ray_cluster import private_mounts_missing
from remote_fixtures import (
    buffer_files_made,
    hidden_dir,
    kernel_of,
    released_client,
    running,
    slurm_broker,
)
from slurm_cluster import LocalSlurmCluster, local_slurm_cluster, slurm_missing

from jupyter_gpulease.client import BrokerClient
from jupyter_gpulease.executors import slurm_bulk

pytestmark = [
    pytest.mark.skipif(bool(slurm_missing()), reason=slurm_missing() or "slurm installed"),
    pytest.mark.skipif(bool(private_mounts_missing()), reason=private_mounts_missing() or "root"),
    pytest.mark.timeout(300),
]

T = 60.0
wait_for = functools.partial(waiting.wait_for, timeout=T, interval=0.05)


@pytest.fixture(scope="module")
def hidden() -> Iterator[str]:
    """The directory above the kernel's artifact root: an empty tmpfs on n2."""
    with hidden_dir("gpulease-unshared-") as d:
        yield d


@pytest.fixture(scope="module")
def cluster(hidden: str) -> Iterator[LocalSlurmCluster]:
    with local_slurm_cluster(private={"n2": [hidden]}) as c:
        yield c


@pytest.fixture(scope="module")
def broker(cluster: LocalSlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    with running(slurm_broker(cluster, tmp_path_factory.mktemp("slurm-values-broker"), timeout=T),
                 then=cluster.cancel_all) as b:
        yield b


@pytest.fixture
def client(broker: BrokerProcess) -> Iterator[BrokerClient]:
    with released_client(broker, T) as c:
        yield c


@pytest.fixture(scope="module")
def kernel(cluster: LocalSlurmCluster, broker: BrokerProcess, hidden: str) -> Iterator[Any]:
    with kernel_of(broker, os.path.join(hidden, "artifacts"), cluster.env) as k:
        yield k


def _large_values_both_ways(kernel: Any, gpus: int, node: str) -> None:
    r = kernel.run("import numpy as np\nx = np.arange(1 << 21, dtype='float64')  # 16 MiB")
    assert r.status == "ok", r.outputs
    r = kernel.run(f"%%gpu {gpus} --in x --out y,where\nimport os\nx[0] = 0.0\ny = x * 2\nwhere = os.environ['GPULEASE_NODE']\n",
                   timeout=T * 2)
    assert r.status == "ok", (r.outputs, r.reply)
    assert kernel.run("where").result == repr(node)  # n1: 4 GPUs; n2 (2 GPUs) is a 2-GPU lease's best fit
    assert kernel.run("bool((y == x * 2).all()), y.nbytes").result == f"(True, {8 << 21})"


def _moved(kernel: Any) -> dict[str, int]:
    """Bytes of jobs and results the kernel moved through the direct channel and through srun's stdio so far."""
    r = kernel.run("from jupyter_gpulease.executors.slurm import SlurmWorker\ndict(SlurmWorker.moved)")
    return dict(ast.literal_eval(r.result)) if r.result else {"direct": 0, "stdio": 0}


def test_large_values_on_a_node_that_shares_the_artifact_root(kernel: Any, client: BrokerClient,
                                                              hidden: str) -> None:
    before = _moved(kernel)
    made = buffer_files_made(kernel, lambda: _large_values_both_ways(kernel, 4, "n1"))
    root = Path(hidden, "artifacts")
    assert list(root.glob("*/.oob")) and not list(root.glob("*/.oob/*"))  # through the shared root, read there
    assert made and all("/.oob/" in path for path in made)  # the inputs' file, written there at once
    assert _moved(kernel)["direct"] == before["direct"]  # no direct channel where the root is shared


def test_large_values_on_a_node_with_an_unshared_root_go_through_the_direct_channel(
        kernel: Any, client: BrokerClient, hidden: str) -> None:
    seen = {v["id"] for v in client.leases(ended=100)}
    before = _moved(kernel)
    made = buffer_files_made(kernel, lambda: _large_values_both_ways(kernel, 2, "n2"))
    after = _moved(kernel)
    assert made == []  # the inputs went packed into the message: no file of them on the kernel's host, ever
    lease = next(v for v in client.leases(ended=100) if v["id"] not in seen and v["node"] == "n2")
    assert not os.path.exists(os.path.join(hidden, "artifacts", lease["id"], ".oob"))  # not through the shared root
    assert after["direct"] - before["direct"] >= 2 * (8 << 21)  # 16 MiB in, 16 MiB out: the direct channel
    assert after["stdio"] - before["stdio"] < 1 << 20  # srun's stdio: the small messages only


SWITCH = "get_ipython().magics_manager.registry['GpuMagics'].executors['slurm'].direct_channel = {}"


def test_large_values_unshared_root_through_srun_stdio_with_the_direct_channel_off(
        kernel: Any, client: BrokerClient, hidden: str) -> None:
    """``SlurmExecutor.direct_channel = False`` (and a node that cannot connect): srun's own stdio, same values."""
    _large_values_both_ways(kernel, 4, "n1")  # (the executor exists)
    assert kernel.run(SWITCH.format(False)).status == "ok"
    try:
        before = _moved(kernel)
        made = buffer_files_made(kernel, lambda: _large_values_both_ways(kernel, 2, "n2"))
        after = _moved(kernel)
    finally:
        assert kernel.run(SWITCH.format(True)).status == "ok"
    assert after["direct"] == before["direct"] and after["stdio"] - before["stdio"] >= 2 * (8 << 21)
    assert made == []


def test_large_values_direct_channel_refuses_a_wrong_key_and_an_altered_frame() -> None:
    """The kernel's end accepts only a connection that proves the key (one that does not is closed, and the relay
    that does is taken after it); a frame altered on the way is refused, and the channel closed."""
    listener = slurm_bulk.Listener("127.0.0.1")
    got: dict[str, Any] = {}

    def intruder_then_relay() -> None:
        try:
            slurm_bulk.connect("127.0.0.1", listener.port, slurm_bulk.new_key(), 5.0)
        except OSError as e:
            got["intruder"] = e
        got["relay"] = slurm_bulk.connect("127.0.0.1", listener.port, listener.key, 5.0)

    t = threading.Thread(target=intruder_then_relay)
    t.start()
    kernel_end = listener.accept(10.0)
    t.join(10)
    assert isinstance(got["intruder"], OSError)  # refused: the kernel closed it without proving itself
    relay_end: slurm_bulk.Channel = got["relay"]
    relay_end.send(b"results" * 1000)
    assert kernel_end.recv(5.0) == b"results" * 1000
    with pytest.raises(OSError):  # gone: the listener accepts one relay only
        socket.create_connection(("127.0.0.1", listener.port), timeout=2).recv(1)

    # a frame with the next sequence number and a length in bounds, but not signed with the key
    relay_end.sock.sendall(struct.pack("!QI", 1, 100) + b"x" * 100 + os.urandom(32))
    with pytest.raises(slurm_bulk.BulkError, match="does not authenticate"):
        kernel_end.recv(5.0)
    relay_end.close()


def test_large_values_direct_channel_refuses_an_oversized_or_replayed_frame() -> None:
    """Frames are bounded before anything is allocated for them, and numbered: one from the past is refused."""
    for head in (struct.pack("!QI", 0, slurm_bulk.MAX_FRAME + 1), struct.pack("!QI", 7, 10)):
        kernel_end, relay_end = _connected()
        relay_end.sock.sendall(head)
        with pytest.raises(slurm_bulk.BulkError, match="refused"):
            kernel_end.recv(5.0)
        relay_end.close()


def _connected() -> tuple[slurm_bulk.Channel, slurm_bulk.Channel]:
    """Both ends of a direct channel on this host: (the kernel's, the relay's)."""
    listener = slurm_bulk.Listener("127.0.0.1")
    got: list[slurm_bulk.Channel] = []
    t = threading.Thread(target=lambda: got.append(slurm_bulk.connect("127.0.0.1", listener.port, listener.key, 5.0)))
    t.start()
    kernel_end = listener.accept(10.0)
    t.join(10)
    return kernel_end, got[0]


def _given_back(client: BrokerClient) -> None:
    """Wait until the kernel's last cell gave its lease back (the kernel does that after the cell's reply): else a
    2-GPU cell goes to n1, which then has the free GPUs, not to n2 (the node without the shared root)."""
    wait_for(lambda: all(v["phase"] == "ended" for v in client.leases()), what="the last cell's lease given back")


WRITE = ("%%gpu 2\nimport os\nos.makedirs(os.path.join(os.environ['GPULEASE_ARTIFACTS'], 'ckpt'))\n"
         "open(os.path.join(os.environ['GPULEASE_ARTIFACTS'], 'ckpt', 'model.pt'), 'w').write('weights')\n")


def test_unshared_root_files_the_cell_wrote_come_back_to_the_artifact_directory(kernel: Any, client: BrokerClient,
                                                                                hidden: str) -> None:
    seen = {v["id"] for v in client.leases(ended=100)}
    _given_back(client)
    r = kernel.run(WRITE, timeout=T * 2)
    assert r.status == "ok", (r.outputs, r.reply)
    lease = next(v for v in client.leases(ended=100) if v["id"] not in seen)
    assert lease["node"] == "n2"
    here = os.path.join(hidden, "artifacts", lease["id"])
    assert os.path.exists(os.path.join(here, ".gpulease-marker"))  # the kernel's marker, which the node could not read
    with open(os.path.join(here, "ckpt", "model.pt")) as f:  # copied back at the cell's end, where the summary says
        assert f.read() == "weights"
    assert here in r.stdout + r.stderr


def test_unshared_root_too_many_files_stay_named_with_the_node_and_the_fix(kernel: Any, client: BrokerClient,
                                                                           hidden: str) -> None:
    assert kernel.run("%env GPULEASE_FILES_BACK_MAX=3").status == "ok"
    _given_back(client)
    try:
        r = kernel.run(WRITE, timeout=T * 2)
    finally:
        kernel.run("%env GPULEASE_FILES_BACK_MAX=")
    assert r.status == "ok", (r.outputs, r.reply)
    line = next(s for s in r.stderr.splitlines() if "does not see the artifact root" in s)
    assert "node n2 " in line and os.path.join(hidden, "artifacts") in line and "GpuMagics.artifact_root" in line


def test_unshared_root_session_parking_fails_at_once_in_one_line(kernel: Any, client: BrokerClient,
                                                                hidden: str) -> None:
    """A session on a node without the shared root cannot park (its state would stay on the node): said when the
    session starts, in one line naming the node, the path and the fix; the session itself runs."""
    _given_back(client)
    r = kernel.run("%%gpu 2 --session far\nmodel = [1, 2]\nprint(len(model))", timeout=T * 2)
    try:
        assert r.status == "ok", (r.outputs, r.reply)
        line = next(s for s in r.stderr.splitlines() if "cannot be parked" in s)
        assert "node n2 does not see the artifact root" in line and os.path.join(hidden, "artifacts") in line
        assert "GpuMagics.artifact_root" in line
    finally:
        kernel.run("%gpu session stop far")
