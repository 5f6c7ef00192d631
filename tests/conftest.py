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
def broker(broker_factory) -> BrokerProcess:
    """A real broker process with 4 simulated GPUs on a Unix socket, fast ticks."""
    return broker_factory(gpus=4, args=["--tick=0.1"])


@pytest.fixture
def client(broker: BrokerProcess) -> Iterator[BrokerClient]:
    c = broker.client()
    yield c
    c.close()


# pytest-jupyter's fixtures (jp_fetch, jp_serverapp, ...) for the server extension tests
pytest_plugins = ["pytest_jupyter.jupyter_server"]
