"""Parking a session worker's namespace (``worker.park``), as the worker does it, without a kernel: what is kept,
what is left out and named, and that every file of a parked state goes, also after a worker killed mid-park."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jupyter_gpulease.kernel.sessions import sweep_orphans
from jupyter_gpulease.worker import park


def test_a_namespace_parks_and_comes_back_with_its_shared_references(tmp_path: Path, capsys) -> None:
    def double(x: int) -> int:
        return 2 * x

    big = np.arange(1 << 18, dtype="f8")  # 2 MiB: out of band, in the parked state's own buffer file
    ns = {"__builtins__": __builtins__, "__name__": "__main__", "big": big, "same": big, "double": double,
          "squares": (i * i for i in range(3))}
    to = str(tmp_path / "gpulease-park-1-ab")
    summary = park.park(ns, str(tmp_path), to)
    assert summary["names"] == ["big", "double", "same"] and list(summary["dropped"]) == ["squares"]
    assert "cannot pickle 'generator' object" in summary["dropped"]["squares"]
    assert sorted(os.listdir(tmp_path)) == ["gpulease-park-1-ab", "gpulease-park-1-ab.buf"]
    back = park.restore(to)
    assert back["same"] is back["big"] and back["big"].sum() == big.sum() and back["double"](21) == 42
    note = capsys.readouterr().out  # a note, not an error
    assert "3 parked variables" in note and "2.0 MiB" in note
    assert park.restore(to)["big"][-1] == big[-1]  # the files stay until the kernel removes them: a retry works
    park.discard(to)
    assert os.listdir(tmp_path) == []


def test_a_missing_state_is_a_restore_error(tmp_path: Path) -> None:
    with pytest.raises(park.RestoreError, match="is gone"):
        park.restore(str(tmp_path / "gpulease-park-1-none"))


def test_discard_and_the_sweep_remove_what_a_worker_killed_while_parking_left(tmp_path: Path) -> None:
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)
    mine = tmp_path / f"gpulease-park-{os.getpid()}-aa"
    gone = tmp_path / f"gpulease-park-{dead}-bb"
    for stem in (mine, gone):  # buffers written, manifest not yet renamed into place: the worker was killed
        Path(f"{stem}.buf").write_bytes(b"x" * 10)
        Path(f"{stem}.123.tmp").write_bytes(b"partial")
    other = tmp_path / "gpulease-0123.buf"  # not a parked state's: left alone
    other.write_bytes(b"")
    assert sweep_orphans(str(tmp_path)) == 2  # the dead kernel's two files; this (live) process's stay
    assert sorted(os.listdir(tmp_path)) == sorted([f"{mine.name}.buf", f"{mine.name}.123.tmp", other.name])
    park.discard(str(mine))
    assert os.listdir(tmp_path) == [other.name]
