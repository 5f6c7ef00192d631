"""No user can starve the broker (issue 30, item 4): 4,300 idle connections from one uid against a 4,096-descriptor
limit made the broker unreachable for everyone while it wrote 208 MB of "Too many open files" tracebacks; one user
queued 20,000 requests in 9.8 s and the store's write-ahead log grew to 154 MB and stayed.

Here the same attacks, scaled down: a broker started with a limit of 256 open files and a flood of 300 connections
from the second real user; a per-user cap on queued requests; a burst of requests and releases against the WAL;
and a listener that runs out of descriptors."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest
from broker_process import BrokerProcess
from users import as_user, in_child, second_user  # noqa: F401  (fixture)
from waiting import wait_for

from jupyter_gpulease.client import BrokerClient, BrokerError
from lease_broker.core.errors import TooManyRequests
from lease_broker.policy.lease_policy import LeasePolicy

pytestmark = pytest.mark.attack  # each test is an attack that must fail (BENCHMARKS.md: Reliability)

NOFILE = 256  # the broker's limit of open files: 256 - 96 kept for itself = 160 connections, 80 per peer
FLOOD = 300
INFO = b"GET /api/v1/info HTTP/1.1\r\nHost: localhost\r\n\r\n"


def _few_files() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))


def _shared_socket() -> str:
    """A socket path the second user can reach (the test's tmp_path is root's, 0700)."""
    d = tempfile.mkdtemp(prefix="gl-flood")
    os.chmod(d, 0o755)
    return os.path.join(d, "b.sock")


def _answer(s: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Read one HTTP answer (status, headers, body) from ``s``; (0, {}, b"") if it closed without one."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        if not chunk:
            return 0, {}, b""
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    while len(body) < int(headers.get("content-length", 0)):
        chunk = s.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(lines[0].split()[1]), headers, body


def test_one_users_connection_flood_leaves_the_broker_to_everyone_else(tmp_path: Path, second_user) -> None:  # noqa: F811
    broker = BrokerProcess(tmp_path / "b", gpus=2, args=["--tick=0.1"], socket_path=_shared_socket(),
                           preexec_fn=_few_files).start()
    ready_r, ready_w = os.pipe()  # the flooder says when it holds its connections ...
    go_r, go_w = os.pipe()  # ... and waits for the word to let them go
    try:
        def flood() -> dict:
            conns = []
            for _ in range(FLOOD):  # idle connections first: the attack
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(10)
                s.connect(broker.socket)
                conns.append(s)
            seen: dict[str, int] = {}
            refusals = []
            for s in conns:  # then one request on each: those admitted answer it, the others were refused at once
                try:
                    s.sendall(INFO)
                except OSError:  # (a refused connection the broker has closed already: its answer is still there)
                    pass
                status, headers, body = _answer(s)
                seen[str(status)] = seen.get(str(status), 0) + 1
                if status != 200:
                    refusals.append({"retry_after": headers.get("retry-after"), "body": json.loads(body or b"{}")})
            os.write(ready_w, b"x")
            os.read(go_r, 1)
            for s in conns:
                s.close()
            return {"seen": seen, "refusals": refusals[:3], "refused": len(refusals)}

        result: dict = {}
        flooder = threading.Thread(target=lambda: result.update(as_user(second_user, flood)))
        flooder.start()
        try:
            assert os.read(ready_r, 1) == b"x"
            # everyone else (root here, another uid) is answered, each within a second, on new connections
            for _ in range(8):
                t0 = time.monotonic()
                assert BrokerClient(broker.url, timeout=1).info()["version"]
                assert time.monotonic() - t0 < 1.0
            lease = BrokerClient(broker.url, timeout=1).request_lease(1, heartbeat=False)
            assert lease["state"] == "granted"
        finally:
            os.write(go_w, b"x")
            flooder.join(30)
        seen = result["seen"]
        held = seen.get("200", 0)
        assert 0 < held <= 80, seen  # at most the limit per peer (half of the 160 connections the broker keeps)
        assert seen.get("429", 0) == FLOOD - held == result["refused"], seen  # every other one: the limit's answer
        for r in result["refusals"]:
            assert r["retry_after"] is not None and int(r["retry_after"]) > 0
            assert r["body"]["status"] == 429 and r["body"]["reason"] == "too_many_connections"
            assert "80" in r["body"]["message"]  # the limit it met
        # once the flooder let go, its uid is served again, and so is everyone
        wait_for(lambda: as_user(second_user, lambda: BrokerClient(broker.url, timeout=2).info()["version"]),
                 timeout=10, what="the second user served again")
        BrokerClient(broker.url).release(lease["id"])
        log = broker.log()
        assert "Traceback" not in log and "Too many open files" not in log
        assert len([line for line in log.splitlines() if "connections refused" in line or "Refused a connection" in line]) <= 4
    finally:
        broker.stop()
        for fd in (ready_r, ready_w, go_r, go_w):
            os.close(fd)


def test_a_listener_out_of_descriptors_logs_once_and_resumes() -> None:
    """EMFILE at accept (descriptors taken by something else than connections): one log line without a
    traceback, not one per attempt, and accepting resumes once descriptors are free."""

    def run() -> dict:
        from lease_broker.api.http_server import BrokerHTTPServer, ConnectionLimits

        records: list[logging.LogRecord] = []
        handler = logging.Handler()
        handler.emit = records.append  # type: ignore[method-assign]
        logging.getLogger("lease_broker").addHandler(handler)
        logging.getLogger("lease_broker").setLevel(logging.INFO)
        path = os.path.join(tempfile.mkdtemp(prefix="gl-emfile"), "s.sock")

        async def main() -> dict:
            from tornado import web

            class Ok(web.RequestHandler):
                def get(self) -> None:
                    self.finish("ok")

            server = BrokerHTTPServer(web.Application([(r"/", Ok)]), limits=ConnectionLimits(descriptors=1 << 16))
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(path)
            listener.listen(64)
            listener.setblocking(False)
            client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            client.connect(path)  # (in the backlog: the server has not accepted it)
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            top = max(int(fd) for fd in os.listdir("/proc/self/fd"))
            resource.setrlimit(resource.RLIMIT_NOFILE, (top + 1, hard))
            taken = []
            try:
                while True:  # no descriptor left to accept with
                    try:
                        taken.append(os.open(os.devnull, os.O_RDONLY))
                    except OSError:
                        break
                server.add_sockets([listener])
                await asyncio.sleep(1.0)  # ten tries at least
            finally:
                for fd in taken:
                    os.close(fd)
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            client.setblocking(True)
            client.settimeout(5)
            answer = await asyncio.get_running_loop().run_in_executor(
                None, lambda: (client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"), client.recv(4096))[1])
            server.stop()
            return {"answer": answer.decode("latin-1")}

        out = asyncio.run(main())
        failed = [r for r in records if "Cannot accept" in r.getMessage()]
        out.update(lines=len(failed), traceback=any(r.exc_info for r in records),
                   emfile="Too many open files" in " ".join(r.getMessage() for r in failed))
        return out

    out = in_child(run)
    assert out["answer"].startswith("HTTP/1.1 200") and out["answer"].endswith("ok")  # accepting resumed
    assert out["lines"] == 1 and out["emfile"] and not out["traceback"]


def test_a_user_queues_at_most_max_queued_per_user(tmp_path: Path, second_user) -> None:  # noqa: F811
    broker = BrokerProcess(tmp_path / "b", gpus=1, args=["--tick=0.1", "--LeasePolicy.max_queued_per_user=3"],
                           socket_path=_shared_socket()).start()
    try:
        c = broker.client()
        holder = c.request_lease(1, heartbeat=False)
        assert holder["state"] == "granted"  # the one GPU is taken: what follows queues
        queued = [c.request_lease(1, heartbeat=False) for _ in range(3)]
        assert {q["state"] for q in queued} == {"queued"}
        with pytest.raises(BrokerError) as e:
            c.request_lease(1, heartbeat=False)
        assert e.value.status == 429 and e.value.reason == "queue_full"
        assert "3" in e.value.message and e.value.body["limit"] == 3
        # another user may still queue
        theirs = as_user(second_user, lambda: BrokerClient(broker.url).request_lease(1, heartbeat=False)["state"])
        assert theirs == "queued"
        # and once one of ours left the queue, we may queue again
        c.release(queued[0]["id"])
        assert c.request_lease(1, heartbeat=False)["state"] == "queued"
    finally:
        broker.stop()


def test_max_queued_per_user_default_and_overrides() -> None:
    policy = LeasePolicy(unix_groups=False, user_limits={"batch": {"max_queued": 0}},
                         group_members={"big": ["bob"]}, group_limits={"big": {"max_queued": 5000}})
    assert policy.max_queued_per_user == 1000
    policy.check_queued("alice", 999)
    with pytest.raises(TooManyRequests) as e:
        policy.check_queued("alice", 1000)
    assert e.value.status_code == 429 and "1000" in e.value.message
    policy.check_queued("batch", 10**6)  # 0: unlimited for this user
    policy.check_queued("bob", 4999)
    with pytest.raises(TooManyRequests):
        policy.check_queued("bob", 5000)


def test_the_write_ahead_log_shrinks_back_after_a_burst(tmp_path: Path) -> None:
    broker = BrokerProcess(tmp_path / "b", gpus=64, args=["--tick=0.1"]).start()
    wal = broker.db + "-wal"
    peak = [0]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            try:
                peak[0] = max(peak[0], os.path.getsize(wal))
            except OSError:
                pass
            done.wait(0.01)

    def burst() -> None:
        c = broker.client()
        for _ in range(250):
            c.release(c.request_lease(1, heartbeat=False)["id"])

    try:
        watcher = threading.Thread(target=watch)
        watcher.start()
        clients = [threading.Thread(target=burst) for _ in range(8)]
        for t in clients:
            t.start()
        for t in clients:
            t.join(120)
        done.set()
        watcher.join()
        limit = 4 << 20  # Checkpointer.WAL_LIMIT
        assert peak[0] > limit, peak  # the burst grew it past the bound (else this test proves nothing)
        wait_for(lambda: os.path.getsize(wal) <= limit, timeout=10, what="the WAL back under 4 MiB")
        assert broker.client().info()
    finally:
        broker.stop()
