"""One broker per store (issue 30, item 5): two brokers on one store both started and granted four exclusive leases
on two GPUs. The broker now holds an exclusive lock beside its store for its whole life; a second one refuses to
start, naming the first one's pid and the store."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from broker_process import BrokerProcess

from lease_broker.store.lock import StoreLock, StoreLocked

pytestmark = pytest.mark.attack  # each test is an attack that must fail (BENCHMARKS.md: Reliability)


def test_a_second_broker_on_the_same_store_refuses_to_start_naming_the_first(tmp_path: Path) -> None:
    first = BrokerProcess(tmp_path / "first", gpus=2).start()
    try:
        assert first.proc is not None
        held = first.client().request_lease(2, heartbeat=False)
        assert held["state"] == "granted"
        second_socket = str(tmp_path / "second.sock")
        out = subprocess.run([sys.executable, "-m", "lease_broker", "--inventory=simulated", "--gpus=2",
                              f"--socket={second_socket}", f"--db={first.db}"],
                             capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert out.returncode != 0
        assert f"pid {first.proc.pid}" in out.stderr and first.db in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
        assert not os.path.exists(second_socket)  # it never served: no second owner of the two GPUs
        assert first.client().lease(held["id"])["state"] == "granted"  # the first goes on, its lease untouched
    finally:
        first.stop()
    # once the first has stopped, a new broker starts on the store and finds the lease it left
    again = first.start()
    try:
        assert again.client().lease(held["id"])["state"] == "granted"
        again.kill9()  # the kernel drops the lock of a killed broker too: never a stale lock
        assert again.start().client().info()
    finally:
        again.stop()


def test_the_lock_names_its_holder_and_is_free_again_after_release(tmp_path: Path) -> None:
    db = str(tmp_path / "leases.db")
    mine = StoreLock(db)
    mine.acquire()
    assert Path(db + ".lock").read_text().strip() == str(os.getpid())
    assert os.stat(db + ".lock").st_mode & 0o777 == 0o600
    with pytest.raises(StoreLocked) as e:
        StoreLock(db).acquire()  # (flock: another open file description conflicts, in one process too)
    assert f"pid {os.getpid()}" in e.value.message and db in e.value.message
    mine.release()
    assert Path(db + ".lock").read_text() == ""  # the file stays (see store/lock.py), without a pid
    other = StoreLock(db)
    other.acquire()
    other.release()


def test_a_lock_file_replaced_by_a_link_is_refused(tmp_path: Path) -> None:
    db = str(tmp_path / "leases.db")
    target = tmp_path / "elsewhere"
    target.write_text("")
    os.symlink(target, db + ".lock")
    with pytest.raises(StoreLocked) as e:
        StoreLock(db).acquire()
    assert db + ".lock" in e.value.message
