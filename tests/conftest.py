from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from broker_process import BrokerProcess

from jupyter_gpulease.client import BrokerClient


@pytest.fixture
def broker_factory(tmp_path: Path) -> Iterator:
    """Start real brokers: ``broker_factory(gpus=4, nodes=1, args=[...])``."""
    started: list[BrokerProcess] = []

    def make(gpus: int = 4, nodes: int = 1, args: list[str] | None = None, name: str = "broker",
             env: dict[str, str] | None = None, socket_path: str | None = None) -> BrokerProcess:
        b = BrokerProcess(tmp_path / name, gpus=gpus, nodes=nodes, args=args, env=env,
                          socket_path=socket_path).start()
        started.append(b)
        return b

    yield make
    for b in started:
        b.stop()


@pytest.fixture
def broker(broker_factory, request) -> BrokerProcess:
    """A real broker process with 4 simulated GPUs on a Unix socket, fast ticks; a test may add broker
    arguments with ``@pytest.mark.parametrize("broker", [[...]], indirect=True)``."""
    return broker_factory(gpus=4, args=["--tick=0.1", *getattr(request, "param", [])])


@pytest.fixture
def client(broker: BrokerProcess) -> Iterator[BrokerClient]:
    c = broker.client()
    yield c
    c.close()


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator:
    """A real local Ray cluster (head 127.0.0.2 with 4 declared GPUs, 127.0.0.3 with 2), started once and
    shared by every test that uses Ray (tests/broker/inventory/test_ray.py, the inventory contract)."""
    from ray_cluster import local_ray_cluster, ray_missing

    why = ray_missing()
    if why:
        pytest.skip(why)
    with local_ray_cluster() as c:
        yield c


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator:
    """A real Slurm (munged, slurmctld, slurmd n1 with 4 fake GPUs and n2 with 2) under a temporary directory,
    started once and shared by every test that uses Slurm (tests/broker/inventory/test_slurm.py, the inventory contract)."""
    from slurm_cluster import local_slurm_cluster, slurm_missing

    why = slurm_missing()
    if why:
        pytest.skip(why)
    with local_slurm_cluster() as c:
        yield c


# pytest-jupyter's fixtures (jp_fetch, jp_serverapp, ...) for the server extension tests; the browser tests' lab
# and page (tests/browser_support.py)
pytest_plugins = ["pytest_jupyter.jupyter_server", "browser_support"]
