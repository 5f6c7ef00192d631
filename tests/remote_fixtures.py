"""What the tests of remote cells share (Ray and Slurm): a broker on the local cluster, a client that leaves nothing
held, a kernel for the cluster, a directory that one node does not see."""

from __future__ import annotations

import ast
import contextlib
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from broker_process import BrokerProcess

from jupyter_gpulease.client import BrokerClient, BrokerError


def ray_broker(cluster: Any, workdir: Path, *args: str, timeout: float) -> BrokerProcess:
    """A broker whose inventory is the local Ray cluster (tests/ray_cluster.py)."""
    from ray_cluster import HEAD

    return BrokerProcess(
        workdir,
        args=["--inventory=ray", f"--RayInventory.address={cluster.address}", f"--RayInventory.node_ip={HEAD}",
              "--tick=0.2", "--LeaseBroker.sample_seconds=0.5", *args],
        env=cluster.env,
    ).start(timeout=timeout)


def slurm_broker(cluster: Any, workdir: Path, *args: str, timeout: float) -> BrokerProcess:
    """A broker whose inventory is the local Slurm cluster (tests/slurm_cluster.py)."""
    return BrokerProcess(
        workdir,
        args=["--inventory=slurm", "--tick=0.2", "--LeaseBroker.sample_seconds=0.3",
              "--SlurmInventory.placement_timeout=10", *args],
        env=cluster.env,
    ).start(timeout=timeout)


@contextlib.contextmanager
def running(broker: BrokerProcess, then: Callable[[], object] | None = None) -> Iterator[BrokerProcess]:
    """``broker`` until the block ends, then stopped (and ``then()``: e.g. cancel what Slurm still holds for it)."""
    try:
        yield broker
    finally:
        broker.stop()
        if then is not None:
            then()


def release_all(client: BrokerClient) -> None:
    """Leave nothing held for the next test (a lease that its kernel released meanwhile is no error)."""
    for lease in client.leases():
        if lease["phase"] != "ended":
            with contextlib.suppress(BrokerError):
                client.release(lease["id"])


@contextlib.contextmanager
def released_client(broker: BrokerProcess, timeout: float) -> Iterator[BrokerClient]:
    """A test's client of ``broker``: at the end of the block, every lease it left held is released."""
    c = broker.client(timeout=timeout)
    try:
        yield c
    finally:
        release_all(c)
        c.close()


def placed(client: BrokerClient, lease: dict[str, Any], timeout: float) -> dict[str, Any]:
    """The lease's view once its Ray placement group is placed."""
    import waiting

    def ready() -> dict[str, Any] | None:
        view = client.lease(lease["id"])
        return view if (view.get("placement") or {}).get("state") == "ready" else None

    return waiting.wait_for(ready, timeout=timeout, interval=0.05, what=f"the group of {lease['id']} placed")


def ray_env(cluster: Any) -> dict[str, str]:
    """A kernel's environment for the local Ray cluster: its address, and the head as the kernel's node."""
    from ray_cluster import HEAD

    return {**cluster.env, "GPULEASE_RAY_NODE_IP": HEAD}


def ray_cell_fixtures(name: str, kernel_env: dict[str, str] | None = None, timeout: float = 60.0) -> tuple[Any, ...]:
    """The fixtures of a module whose cells run on the session's Ray cluster (``ray_cluster``, tests/conftest.py):
    ``broker`` (one for the module, ``--inventory=ray``), ``client`` (one per test, releasing what the test left
    held) and ``kernel`` (one for the module, with ``kernel_env`` added to ``ray_env``). ``name`` names their
    temporary directories. Use: ``broker, client, kernel = ray_cell_fixtures("ray-warm")``."""
    import pytest

    @pytest.fixture(scope="module")
    def broker(ray_cluster: Any, tmp_path_factory: Any) -> Iterator[BrokerProcess]:
        with running(ray_broker(ray_cluster, tmp_path_factory.mktemp(f"{name}-broker"), timeout=timeout)) as b:
            yield b

    @pytest.fixture
    def client(broker: BrokerProcess) -> Iterator[BrokerClient]:
        with released_client(broker, timeout) as c:
            yield c

    @pytest.fixture(scope="module")
    def kernel(ray_cluster: Any, broker: BrokerProcess, tmp_path_factory: Any) -> Iterator[Any]:
        with kernel_of(broker, tmp_path_factory.mktemp(f"{name}-artifacts"),
                       {**ray_env(ray_cluster), **(kernel_env or {})}) as k:
            yield k

    return broker, client, kernel


@contextlib.contextmanager
def kernel_of(broker: BrokerProcess, artifacts: str | Path, env: dict[str, str]) -> Iterator[Any]:
    """A real kernel with the extension, on ``broker``, stopped when the block ends."""
    from kernels import Kernel

    k = Kernel(broker.url, str(artifacts), env)
    try:
        yield k
    finally:
        k.stop()


@contextlib.contextmanager
def hidden_dir(prefix: str) -> Iterator[str]:
    """A directory under /tmp, removed when the block ends: a private node mounts an empty tmpfs over it."""
    d = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


# Files of values the kernel makes (O_CREAT opens of ``*.buf``, as Python's own audit hook sees them): a node
# without the shared root must cost none (its values go packed into the message itself, ``dumps(inline=True)``).
_WATCH_FILES = (
    "import os as _os, sys as _sys\n"
    "if '_gpulease_made' not in globals():\n"
    "    _gpulease_made = []\n"
    "    _sys.addaudithook(lambda ev, a, made=_gpulease_made: made.append(str(a[0])) if ev == 'open' and "
    "isinstance(a[2], int) and a[2] & _os.O_CREAT and str(a[0]).endswith('.buf') else None)\n"
    "_gpulease_made.clear()\n"
)


def buffer_files_made(kernel: Any, cell: Callable[[], object]) -> list[str]:
    """The buffer files of values the kernel created on its host while ``cell()`` ran."""
    assert kernel.run(_WATCH_FILES).status == "ok"
    cell()
    r = kernel.run("list(_gpulease_made)")
    return list(ast.literal_eval(r.result))
