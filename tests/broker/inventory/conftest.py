"""Fixtures of the inventory tests: the fake libnvidia-ml.so.1 loaded in this process."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fake_nvml import FakeNvml
from nvml_helpers import use_fake_library, use_library


@pytest.fixture
def fake_driver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[int], FakeNvml]]:
    """``fake_driver(n)``: the fake driver with ``n`` GPUs, loaded through this process's pynvml (then unloaded)."""
    use_fake_library()

    def make(n: int) -> FakeNvml:
        state = FakeNvml.standard(tmp_path / "nvml.state", n)
        monkeypatch.setenv("FAKE_NVML_STATE", str(state.path))
        return state

    yield make
    use_library(None)
