"""Real kernels through jupyter_client for the cell tests, each against a real broker."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from kernels import Kernel


@pytest.fixture
def kernel_factory(tmp_path: Path) -> Iterator:
    """Start kernels: ``kernel_factory(broker_or_url, **env)``; all stopped at the end of the test."""
    started: list[Kernel] = []

    def make(broker, **env: str) -> Kernel:  # type: ignore[no-untyped-def]
        url = broker if isinstance(broker, str) else broker.url
        k = Kernel(url, str(tmp_path / "artifacts"), env)
        started.append(k)
        return k

    yield make
    for k in started:
        k.stop()


@pytest.fixture
def kernel(broker, kernel_factory) -> Kernel:  # type: ignore[no-untyped-def]
    return kernel_factory(broker)
