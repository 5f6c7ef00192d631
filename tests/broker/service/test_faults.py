"""Faults with real components: a broker killed -9 under load, kernels and workers that die,
a store that is corrupt, locked or out of space, and clients that stall.

No timed assertions: conditions are polled with generous bounds; latencies go to BENCHMARKS.md.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from broker_process import BrokerProcess
from kernels import Kernel
from waiting import wait_for

from jupyter_gpulease.client import BrokerClient, BrokerError

HOLDING = ("granted", "active", "idle")


def record(**fields: object) -> None:
    """A figure for BENCHMARKS.md's reliability section (``make soak`` sets GPULEASE_RELIABILITY_LOG)."""
    path = os.environ.get("GPULEASE_RELIABILITY_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(fields) + "\n")


def _holding(c: BrokerClient) -> list[dict]:
    return [x for x in c.leases() if x["state"] in HOLDING]


@pytest.fixture
def kernel_factory(tmp_path: Path) -> Iterator:
    started: list[Kernel] = []

    def make(broker: BrokerProcess, **env: str) -> Kernel:
        k = Kernel(broker.url, str(tmp_path / "artifacts"), env)
        started.append(k)
        return k

    yield make
    for k in started:
        k.stop()


# ----------------------------------------------------------------------------- broker kill -9
def test_kill9_with_50_granted_and_50_queued_loses_nothing(broker_factory, kernel_factory) -> None:
    b = broker_factory(gpus=50, args=["--tick=0.1", "--heartbeat-timeout=5"], name="k9")
    c = b.client()
    # a %%gpu session worker in a real kernel holds one GPU across the restart
    k = kernel_factory(b)
    k.run("%config GpuMagics.heartbeat_interval = 0.5")
    r1 = k.run("%%gpu --session s --idle 10m\nimport os\nstate = ['warm']\nprint(os.getpid(), os.environ['GPULEASE_LEASE_ID'])")
    assert r1.status == "ok", r1.outputs
    worker_pid, session_lease = r1.stdout.split()[:2]
    # a plain holder that heartbeats before and after the restart
    beating = c.request_lease(1)
    assert beating["state"] == "granted"
    stop = threading.Event()
    beats: list[tuple[float, object]] = []

    def heartbeat() -> None:
        hc = b.client(timeout=2)
        while not stop.is_set():
            try:
                beats.append((time.monotonic(), hc.heartbeat(beating["id"])["state"]))
            except BrokerError as e:
                beats.append((time.monotonic(), e.reason))
            stop.wait(0.3)

    hb = threading.Thread(target=heartbeat, daemon=True)
    hb.start()
    granted = [c.request_lease(1, heartbeat=False) for _ in range(48)]  # + session + heartbeating = 50
    queued = [c.request_lease(1 + i % 2, heartbeat=False) for i in range(50)]
    assert all(g["state"] == "granted" for g in granted) and all(q["state"] == "queued" for q in queued)
    before = {x["id"]: x for x in c.leases()}
    assert len(before) == 100
    order = [q["lease_id"] for q in c.queue()]
    assert len(order) == 50

    b.kill9()
    killed_at = time.monotonic()
    b.start()
    c = b.client()
    after = {x["id"]: x for x in c.leases()}
    assert set(after) == set(before)
    for lid, x in before.items():
        y = after[lid]
        if lid == session_lease:  # its worker's activity may move it between active and idle
            x = {**x, "state": y["state"]} if y["state"] in HOLDING else x
        assert (y["state"], y["devices"], y["user"], y["created_at"]) == (x["state"], x["devices"], x["user"],
                                                                         x["created_at"]), lid
    devices = [d["id"] for x in after.values() if x["state"] in HOLDING for d in x["devices"]]
    assert len(devices) == len(set(devices)) == 50  # no GPU granted twice
    assert [q["lease_id"] for q in c.queue()] == order  # queue order kept
    record(fault="broker kill -9, 50 granted + 50 queued", leases_before=len(before), leases_after=len(after),
           double_grants=len(devices) - len(set(devices)), kill_to_serving_s=round(time.monotonic() - killed_at, 2))
    # the heartbeating holder keeps its lease: beats fail while the broker is down, then work again
    wait_for(lambda: [s for t, s in beats if t > killed_at and s in HOLDING], 15, "a heartbeat after the restart")
    time.sleep(6)  # longer than the heartbeat timeout: still held because it kept beating
    assert c.lease(beating["id"])["state"] in HOLDING
    stop.set()
    hb.join(5)
    # the session worker survived: its next cell runs in the same process on the same lease
    r2 = k.run("%%gpu --session s\nstate.append('again')\nprint(os.getpid(), os.environ['GPULEASE_LEASE_ID'], state)")
    assert r2.status == "ok", r2.outputs
    assert r2.stdout.startswith(f"{worker_pid} {session_lease} ['warm', 'again']"), r2.stdout
    assert c.lease(session_lease)["state"] in HOLDING
    k.run("%gpu session stop s")


# ----------------------------------------------------------------------------- kernel and worker deaths
def test_kernel_killed_mid_cell_hands_the_gpu_to_the_next_kernel(broker_factory, kernel_factory) -> None:
    b = broker_factory(gpus=1, args=["--tick=0.1", "--heartbeat-timeout=2"], name="kk")
    k1, k2 = kernel_factory(b), kernel_factory(b)
    m1 = k1.submit("%%gpu\nimport os, time\nprint('worker', os.getpid(), flush=True)\ntime.sleep(600)")
    part = k1.collect(m1, until=lambda outs: any("worker " in o["content"].get("text", "") for o in outs))
    pid = int(part.stdout.split("worker ")[1].split()[0])
    c = b.client()
    first = _holding(c)[0]["id"]
    m2 = k2.submit("%%gpu\nimport os\nprint('second ran on', os.environ['GPULEASE_LEASE_ID'])")
    wait_for(lambda: c.queue(), 20, "the second kernel's cell to queue")
    k1.kill9()
    killed = time.monotonic()

    def worker_gone() -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().split(") ")[1][0] == "Z"
        except FileNotFoundError:
            return True

    wait_for(worker_gone, 10, "the dead kernel's worker to exit")
    gone_s = time.monotonic() - killed
    wait_for(lambda: c.lease(first)["ended_at"], 15, "the dead kernel's lease to end")
    ended_s = time.monotonic() - killed
    r2 = k2.collect(m2, timeout=60)
    assert r2.status == "ok", r2.outputs
    assert "second ran on l-" in r2.stdout and first not in r2.stdout
    lease = c.lease(first)
    assert lease["state"] == "revoked" and lease["reason"] == "holder_exited"  # its kernel process exited (issue 31)
    record(fault="kernel kill -9 mid-cell", worker_gone_s=round(gone_s, 3), lease_ended_s=round(ended_s, 3),
           heartbeat_timeout_s=2, next_in_queue_ran=True)


@pytest.mark.parametrize(
    "body,ename,expect",
    [
        ("raise MemoryError('cannot allocate 80 GiB')", "MemoryError", "cannot allocate 80 GiB"),
        ("import ctypes\nctypes.string_at(0)", "WorkerCrashed", "SIGSEGV"),
        ("os._exit(3)", "WorkerCrashed", "exited with status 3"),
        ("os.abort()", "WorkerCrashed", "SIGABRT"),
    ],
    ids=["memoryerror", "segfault", "os_exit_3", "abort"],
)
def test_worker_dies_mid_cell_clear_error_and_lease_released(broker_factory, kernel_factory, body, ename, expect):
    b = broker_factory(gpus=1, args=["--tick=0.1"], name="wc")
    k = kernel_factory(b)
    c = b.client()
    code = ("%%gpu\nimport os, sys\nprint('lease', os.environ['GPULEASE_LEASE_ID'], flush=True)\n"
            "print('last words before the crash', file=sys.stderr, flush=True)\n" + body)
    r = k.run(code)
    t_end = time.monotonic()
    assert r.status == "error" and r.error is not None, (r.stdout, r.stderr, r.reply, k.stray[-5:])
    assert r.error["ename"] == ename, r.error
    shown = r.error["evalue"] + "\n".join(r.error["traceback"])
    assert expect in shown, shown
    if ename == "WorkerCrashed":
        assert "last words before the crash" in r.error["evalue"]  # the tail of its stderr
    lease_id = r.stdout.split("lease ")[1].split()[0]
    lease = wait_for(lambda: (x := c.lease(lease_id))["ended_at"] and x, 10, "the lease to end")
    # the figure the issue asks for (within a second) is measured, not asserted: print it for the log
    print(f"{ename}: lease {lease['state']} {time.monotonic() - t_end:.3f} s after the cell returned")
    record(fault=f"worker dies: {body.splitlines()[-1]}", error=ename,
           lease_released_s_after_cell=round(time.monotonic() - t_end, 3))
    assert lease["state"] == "released"
    wait_for(lambda: c.gpus()["summary"]["free"] == 1, 10, "the GPU to be free again")
    assert k.run("%%gpu\nprint('next cell ok')").stdout.startswith("next cell ok")


# ----------------------------------------------------------------------------- the store
def _start_fails(b: BrokerProcess) -> str:
    with pytest.raises(RuntimeError) as e:
        b.start(timeout=20)
    return str(e.value)


def test_corrupt_store_refuses_to_start_and_forgets_nothing(broker_factory) -> None:
    b = broker_factory(gpus=2, args=["--tick=0.1"], name="corrupt")
    c = b.client()
    ids = {c.request_lease(1, heartbeat=False)["id"] for _ in range(3)}
    b.stop()
    good = Path(b.db).read_bytes()
    for garbage_at in (0, 4096):  # the header, then a page in the middle
        data = bytearray(good)
        data[garbage_at:garbage_at + 512] = os.urandom(512)
        Path(b.db).write_bytes(bytes(data))
        msg = _start_fails(b)
        assert "Cannot open the lease store" in msg and "--db" in msg, msg
        assert Path(b.db).exists()  # never replaced by an empty store
    Path(b.db).write_bytes(good)  # the operator restores the file
    b.start()
    after = {x["id"]: x["state"] for x in b.client().leases()}
    assert set(after) == ids and sorted(after.values()) == ["granted", "granted", "queued"]
    record(fault="store corrupt (header, then a middle page)", refused_to_start=True, leases_before=len(ids),
           leases_after_restore=len(after))


LOCKER = """
import sqlite3, sys, time
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
sys.stdin.readline()
db.execute("ROLLBACK")
"""


def test_locked_store_gives_503_with_the_fix_and_loses_nothing(broker_factory) -> None:
    b = broker_factory(gpus=2, args=["--tick=0.1"], name="locked")
    c = b.client()
    first = c.request_lease(1, heartbeat=False)
    locker = subprocess.Popen([sys.executable, "-c", LOCKER, b.db], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert locker.stdout is not None and locker.stdout.readline() == b"locked\n"
        with pytest.raises(BrokerError) as e:
            c.request_lease(1, heartbeat=False)
        assert e.value.status == 503 and e.value.reason == "store_unavailable"
        assert "other process" in e.value.message
        with pytest.raises(BrokerError) as e:
            c.release(first["id"])
        assert e.value.status == 503
        assert [x["id"] for x in c.leases()] == [first["id"]]  # nothing stored half-way, nothing lost
        assert c.lease(first["id"])["state"] == "granted"
        assert c.info()["summary"]["free"] == 1  # still serving reads
    finally:
        assert locker.stdin is not None
        locker.stdin.write(b"\n")
        locker.stdin.close()
        locker.wait(10)
    second = c.request_lease(1, heartbeat=False)
    assert second["state"] == "granted"
    b.kill9()
    b.start()
    assert {x["id"] for x in b.client().leases()} == {first["id"], second["id"]}
    record(fault="store locked by another process", answer=503, leases_lost=0)


@pytest.fixture
def tiny_disk() -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tiny tmpfs (CI runs as root)")
    d = Path(tempfile.mkdtemp(prefix="gl-full"))
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(d)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(f"root but cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)
        shutil.rmtree(d, ignore_errors=True)


def test_full_disk_gives_503_and_loses_nothing(tiny_disk: Path, tmp_path: Path) -> None:
    b = BrokerProcess(tiny_disk / "b", gpus=2, args=["--tick=0.1"], socket_path=str(tmp_path / "s.sock"))
    b.log_path = tmp_path / "broker.log"  # the log is not on the full disk
    b.start()
    try:
        c = b.client()
        held = [c.request_lease(1, heartbeat=False) for _ in range(3)]
        filler = tiny_disk / "filler"
        with open(filler, "wb", buffering=0) as f:  # unbuffered: nothing left to write (and fail) at close
            try:
                while True:
                    f.write(b"\0" * 65536)
            except OSError:
                pass
        refused = 0
        for _ in range(50):  # SQLite may still fit a few rows in pages it already has
            try:
                c.request_lease(1, heartbeat=False, labels={"pad": "x" * 1000})
            except BrokerError as e:
                assert e.status == 503, e
                assert e.reason == "store_unavailable" and "Free disk space" in e.message
                refused += 1
                break
        assert refused == 1
        stored_during = {x["id"] for x in c.leases()}
        filler.unlink()
        c.request_lease(1, heartbeat=False)
        b.kill9()
        b.start()
        after = {x["id"] for x in b.client().leases()}
        assert {h["id"] for h in held} <= after and stored_during <= after
        assert len(after) == len(stored_during) + 1
        record(fault="store's disk full", answer=503, leases_lost=len(stored_during - after))
    finally:
        b.stop()


# ----------------------------------------------------------------------------- stalled clients
def _answer(s: socket.socket) -> bytes:
    """One HTTP answer read from ``s`` (headers and a Content-Length body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += s.recv(65536)
    return head.split(b"\r\n")[0] + b" " + body


def test_a_body_sent_slowly_within_the_deadline_is_served(broker_factory) -> None:
    """The body deadline (tornado's ``body_timeout``, ``LeaseBroker.request_timeout``) cuts off only bodies that are
    overdue: one that comes in pieces, or chunked, within ``request_timeout`` is answered, and the keep-alive
    connection serves the next request, however long it then stays idle."""
    b = broker_factory(gpus=2, args=["--tick=0.1", "--LeaseBroker.request_timeout=2"], name="slowbody")
    s = socket.socket(socket.AF_UNIX)
    s.connect(b.socket)
    s.settimeout(20)
    body = b'{"gpus": 1, "heartbeat": false}'
    s.sendall(b"POST /api/v1/leases HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body[:5])
    time.sleep(1.0)  # half the deadline: a real process sending slowly
    s.sendall(body[5:])
    first = _answer(s)
    assert first.startswith(b"HTTP/1.1 201"), first
    lease_id = json.loads(first.split(b" ", 3)[3])["id"]
    time.sleep(3.0)  # idle between requests for longer than the body deadline: the connection is kept
    release = b'{"reason": "done"}'
    s.sendall(b"POST /api/v1/leases/%s/release HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
              % lease_id.encode() + b"%x\r\n%s\r\n" % (len(release), release))
    time.sleep(1.0)
    s.sendall(b"0\r\n\r\n")
    second = _answer(s)
    assert second.startswith(b"HTTP/1.1 200") and json.loads(second.split(b" ", 3)[3])["state"] == "released", second
    s.close()


def test_stalled_clients_do_not_block_others_and_are_timed_out(broker_factory) -> None:
    b = broker_factory(gpus=2, args=["--tick=0.1", "--LeaseBroker.request_timeout=1"], name="slow")
    half_header = socket.socket(socket.AF_UNIX)
    half_header.connect(b.socket)
    half_header.sendall(b"POST /api/v1/leases HTTP/1.1\r\nHost: x\r\nContent-Le")
    half_body = socket.socket(socket.AF_UNIX)
    half_body.connect(b.socket)
    half_body.sendall(b"POST /api/v1/leases HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"gpus\": 1")
    no_reader = socket.socket(socket.AF_UNIX)
    no_reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    no_reader.connect(b.socket)
    no_reader.setblocking(False)
    try:  # pipeline requests and never read an answer
        for _ in range(2000):
            no_reader.send(b"GET /api/v1/openapi.json HTTP/1.1\r\nHost: x\r\n\r\n")
    except BlockingIOError:
        pass
    # meanwhile other clients are served
    c = b.client(timeout=10)
    latencies = []
    for _ in range(20):
        t0 = time.monotonic()
        lease = c.request_lease(1, heartbeat=False)
        c.release(lease["id"])
        latencies.append(time.monotonic() - t0)
    print(f"request+release while 3 clients stall: max {max(latencies) * 1000:.1f} ms")
    assert c.leases() == []

    def closed(s: socket.socket) -> bool:
        s.settimeout(0.1)
        try:
            return s.recv(1) == b""
        except TimeoutError:
            return False
        except OSError:
            return True

    wait_for(lambda: closed(half_body), 15, "the half-sent body to be timed out")
    wait_for(lambda: closed(half_header), 30, "the half-sent header to be timed out")
    assert c.leases() == []  # the half-sent request stored nothing
    for s in (half_header, half_body, no_reader):
        s.close()
    assert c.info()["summary"]["free"] == 2
    record(fault="3 stalled clients", others_max_ms=round(max(latencies) * 1000, 1), stalled_closed=True)
