"""The checkpoint's host memory faulted in ahead (``worker/ckpt_pool``): the library built into a private cache, a
real process with it preloaded whose next large anonymous mapping is served already resident, and a real worker
that prepares and gives back its region on the kernel's job. The CUDA driver's own mapping is the one thing not
here (no GPU); ``make gpu-check`` measures it on a real one (docs/gpu-checks.md)."""

from __future__ import annotations

import ctypes
import json
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from fake_cuda import FakeCuda, build, compiler
from waiting import largest_anonymous_rss

from jupyter_gpulease.executors.local import LocalWorker
from jupyter_gpulease.worker import ckpt_pool, suspend

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C compiler (cc) to build the checkpoint pool library")

MIB = 1 << 20

#: a process with the library preloaded: prepares a region, then maps like the driver does (mmap.mmap: libc mmap,
#: anonymous and private) and reports how much of each mapping was resident before anything touched it
PROBE = r"""
import json, mmap, sys
from jupyter_gpulease.worker import ckpt_pool

def resident(m):
    import ctypes
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    text = open("/proc/self/smaps").read().splitlines()
    for i, line in enumerate(text):
        if line.split("-")[0] == format(addr, "x"):
            for l in text[i + 1:]:
                if l.startswith("Rss:"):
                    return int(l.split()[1]) * 1024
    return None

out = {"prepare": ckpt_pool.prepare(int(sys.argv[1])), "region": ckpt_pool.region()}
first = mmap.mmap(-1, int(sys.argv[2]), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
out["first_resident"] = resident(first)
import ctypes
out["first_address"] = ctypes.addressof(ctypes.c_char.from_buffer(first))
out["region_after"] = ckpt_pool.region()
second = mmap.mmap(-1, int(sys.argv[2]), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
out["second_resident"] = resident(second)
out["handed"] = ckpt_pool.handed()
first[:4] = b"data"
out["first_writable"] = first[:4] == b"data"
print(json.dumps(out))
"""


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("GPULEASE_CKPT_POOL", raising=False)
    ckpt_pool.library.cache_clear()
    yield tmp_path / "cache" / "jupyter-gpulease"
    ckpt_pool.library.cache_clear()


def _probe(lib: str, pool: int, mapping: int) -> dict:
    env = {**os.environ, "LD_PRELOAD": lib, "PYTHONPATH": str(Path(__file__).parents[3])}
    r = subprocess.run([sys.executable, "-c", PROBE, str(pool), str(mapping)], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_the_library_is_built_once_into_a_private_cache(cache: Path) -> None:
    path, why = ckpt_pool.library()
    assert path and not why and Path(path).parent == cache
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700 and not Path(path).stat().st_mode & 0o077
    built = Path(path).stat().st_mtime_ns
    ckpt_pool.library.cache_clear()
    assert ckpt_pool.library() == (path, "") and Path(path).stat().st_mtime_ns == built  # not rebuilt



def test_threads_that_ask_for_the_library_at_once_get_one_whole_build(cache: Path) -> None:
    """A kernel's first two workers start together (the warm pool's refill and a session's worker), each asking for
    the library: both builds wrote the same temporary file, and the one that lost the rename answered "could not be
    built", so its worker started without the library (the CI failure: "not preloaded in this worker")."""
    from concurrent.futures import ThreadPoolExecutor

    start = threading.Barrier(4)

    def ask(_: int) -> tuple[str | None, str]:
        start.wait()
        return ckpt_pool.library.__wrapped__()  # each thread its own call, as concurrent misses of the cache are

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, range(4)))
    assert all(path for path, _ in answers) and len(set(answers)) == 1, answers
    assert sorted(p.name for p in cache.iterdir()) == [Path(answers[0][0]).name]  # no temporary file left
    assert hasattr(ctypes.CDLL(answers[0][0]), "gpulease_pool_prepare")  # whole: it loads

def test_the_next_large_mapping_is_served_already_resident_and_only_once(cache: Path) -> None:
    lib, _ = ckpt_pool.library()
    assert lib
    out = _probe(lib, 320 * MIB, 300 * MIB)
    assert out["prepare"]["ok"] and out["prepare"]["bytes"] == 320 * MIB, out
    assert out["handed"] == 1 and out["first_writable"]
    assert out["first_resident"] >= 300 * MIB, out  # faulted in before the "driver" wrote a byte
    assert out["second_resident"] == 0, out  # every later mapping passes through: fresh pages, as before
    assert out["region"] == [out["first_address"], 320 * MIB], out  # the region, until the mapping took it
    assert out["region_after"] == [0, 0], out


def test_a_region_smaller_than_the_mapping_is_not_used(cache: Path) -> None:
    lib, _ = ckpt_pool.library()
    assert lib
    out = _probe(lib, 260 * MIB, 300 * MIB)
    assert out["handed"] == 0 and out["first_resident"] == 0, out


def test_a_region_larger_than_the_hosts_free_memory_is_refused_before_any_page_is_touched(cache: Path) -> None:
    lib, _ = ckpt_pool.library()
    assert lib
    env = {**os.environ, "LD_PRELOAD": lib, "PYTHONPATH": str(Path(__file__).parents[3])}
    r = subprocess.run([sys.executable, "-c", "import json; from jupyter_gpulease.worker import ckpt_pool; "
                        "print(json.dumps(ckpt_pool.prepare(1 << 50)))"], env=env, capture_output=True, text=True,
                       timeout=60)
    reply = json.loads(r.stdout)
    assert reply["ok"] is False and reply["why"].startswith("host memory is short"), reply


def test_without_the_library_preloaded_or_when_turned_off_nothing_changes(cache: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    assert ckpt_pool.prepare(64 * MIB) == {"ok": False,
                                           "why": "the checkpoint pool library is not preloaded in this worker"}
    monkeypatch.setenv("GPULEASE_CKPT_POOL", "0")
    ckpt_pool.library.cache_clear()
    assert ckpt_pool.library() == (None, "GPULEASE_CKPT_POOL=0")


def test_a_worker_on_a_host_that_can_checkpoint_prepares_its_region_and_gives_it_back(
        cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The local executor preloads the library where the driver can checkpoint (here the fake libcuda); the worker
    faults in the region on the kernel's ckpt_pool job and gives it back when its next job comes."""
    build()
    for k, v in FakeCuda(tmp_path / "cuda").env().items():
        monkeypatch.setenv(k, v)
    assert suspend.capability().cuda
    w = LocalWorker(session=True)
    try:
        assert ckpt_pool.library()[0] in Path(f"/proc/{w.pid}/environ").read_bytes().decode(errors="replace")
        w.submit({"type": "ckpt_pool", "nbytes": 300 * MIB})
        reply = None
        deadline = time.monotonic() + 30
        while reply is None and time.monotonic() < deadline:
            msg = w.poll(0.5, lambda t: None, lambda t: None)
            reply = msg if msg is not None and msg.get("type") == "ckpt_pool" else None
        assert reply is not None and reply["ok"] and reply["bytes"] == 300 * MIB, reply
        assert largest_anonymous_rss(w.pid) >= 300 * MIB
        w.submit({"type": "hold", "nbytes": 1 << 20})  # any job
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and largest_anonymous_rss(w.pid) >= 300 * MIB:
            w.poll(0.2, lambda t: None, lambda t: None)
        assert largest_anonymous_rss(w.pid) < 300 * MIB  # given back at the next job
    finally:
        w.kill(0.5)
        w.close()
