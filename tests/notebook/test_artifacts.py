"""A lease's artifact directory on a remote (fsspec) root: everything arrives, ``meta.json`` last."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from jupyter_gpulease import artifacts


class RecordingMemory(MemoryFileSystem):
    """fsspec's in-memory filesystem, which also records the order files arrive in."""

    protocol = "glrec"
    arrived: list[str] = []

    def put_file(self, lpath: Any, rpath: Any, *args: Any, **kwargs: Any) -> None:
        super().put_file(lpath, rpath, *args, **kwargs)
        RecordingMemory.arrived.append(self._strip_protocol(rpath))


@pytest.fixture
def recording() -> Iterator[type[RecordingMemory]]:
    fsspec.register_implementation("glrec", RecordingMemory, clobber=True)
    RecordingMemory.arrived = []
    yield RecordingMemory
    MemoryFileSystem.store.clear()
    MemoryFileSystem.pseudo_dirs[:] = [""]


def test_a_remote_root_gets_every_file_and_meta_json_last(recording: type[RecordingMemory]) -> None:
    d = artifacts.ArtifactDir("glrec://arts", "L1")
    d.log("hello\n")
    os.makedirs(os.path.join(d.local, "ckpt", "empty"))
    with open(os.path.join(d.local, "ckpt", "w.bin"), "wb") as f:
        f.write(b"\0" * 10)
    with open(os.path.join(d.local, "z.txt"), "w") as f:  # after meta.json by name, too
        f.write("z")
    staged = d.local
    d.finish({"status": "ok"})

    assert not os.path.exists(staged), "the local staging directory is removed after the upload"
    arrived = [p.rsplit("/arts/L1/", 1)[1] for p in recording.arrived]
    assert sorted(arrived) == ["ckpt/w.bin", "meta.json", "output.log", "z.txt"]
    assert arrived[-1] == "meta.json", arrived
    a = artifacts.load("L1", "glrec://arts")
    assert a.meta["status"] == "ok" and a.log == "hello\n"
    assert a.files == ["ckpt/w.bin", "meta.json", "output.log", "z.txt"]
    assert a.open("ckpt/w.bin").read() == b"\0" * 10
    fs, path = fsspec.core.url_to_fs("glrec://arts/L1/ckpt/empty")
    assert fs.isdir(path), "an empty directory the cell made is kept"


def test_a_cell_without_output_still_lands_with_its_meta(recording: type[RecordingMemory]) -> None:
    d = artifacts.ArtifactDir("glrec://arts", "L2")
    d.finish({"status": "error"})
    assert [p.rsplit("/", 1)[1] for p in recording.arrived] == ["output.log", "meta.json"]
    a = artifacts.load("L2", "glrec://arts")
    assert a.meta["status"] == "error" and a.log == ""
