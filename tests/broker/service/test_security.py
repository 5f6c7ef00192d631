"""Security and bad input against a real broker: a second real Unix user, file permissions,
secrets in logs, recycled pids, and inputs that must be refused without storing anything. The same checks between
two JupyterHub users whose servers share one uid and one socket: test_hub_identity.py."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from broker_process import raw_request
from kernels import Kernel
from users import SECOND_USER, as_user, second_user  # noqa: F401  (fixture)
from waiting import wait_for

from jupyter_gpulease.client import BrokerClient, BrokerError

pytestmark = pytest.mark.attack  # each test is an attack that must fail (BENCHMARKS.md: Reliability)


def _shared_socket_dir() -> str:
    d = tempfile.mkdtemp(prefix="gl-sec")
    os.chmod(d, 0o755)
    return os.path.join(d, "b.sock")


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "120"], start_new_session=True)


def _try(call) -> object:  # type: ignore[no-untyped-def]
    try:
        call()
        return 200
    except BrokerError as e:
        return e.status


# ----------------------------------------------------------------------------- two users
def test_attach_across_users_is_refused(broker_factory, second_user) -> None:  # noqa: F811
    """root as a regular user (root_is_admin off): neither user can attach to, or attach the
    processes of, the other's lease."""
    broker = broker_factory(gpus=2, args=["--tick=0.1", "--LeaseBroker.root_is_admin=False"],
                            socket_path=_shared_socket_dir(), name="noadmin")
    c = broker.client()
    mine = c.request_lease(1, heartbeat=False)
    root_proc = _sleeper()
    try:
        def theirs() -> dict:
            t = BrokerClient(broker.url)
            lease = t.request_lease(1, heartbeat=False)
            return {"lease": lease["id"], "me": os.getpid(),
                    "attach_mine_to_root_lease": _try(lambda: t.attach(mine["id"], os.getpid())),
                    "attach_root_proc_to_my_lease": _try(lambda: t.attach(lease["id"], root_proc.pid)),
                    "signal_root_lease": _try(lambda: t.revoke(mine["id"], "x")),
                    "release_root_lease": _try(lambda: t.release(mine["id"])),
                    "see_root_lease": _try(lambda: t.lease(mine["id"])),
                    "history_root_lease": _try(lambda: t.history(mine["id"]))}

        out = as_user(second_user, theirs)
        assert {k: v for k, v in out.items() if k not in ("lease", "me")} == {
            "attach_mine_to_root_lease": 403, "attach_root_proc_to_my_lease": 403, "signal_root_lease": 403,
            "release_root_lease": 403, "see_root_lease": 403, "history_root_lease": 403}
        # and root (not an admin here) cannot attach its process to the second user's lease, nor see it
        with pytest.raises(BrokerError) as e:
            c.attach(out["lease"], root_proc.pid)
        assert e.value.status == 403
        with pytest.raises(BrokerError) as e:
            c.lease(out["lease"])
        assert e.value.status == 403
        c.release(mine["id"])
        assert root_proc.poll() is None  # never attached, never signalled
    finally:
        root_proc.kill()
        root_proc.wait()


def test_admin_acts_on_every_lease_and_its_revoke_stops_the_owners_processes(broker_factory, second_user):  # noqa: F811
    broker = broker_factory(gpus=2, args=["--tick=0.1"], socket_path=_shared_socket_dir(), name="admin")

    def theirs() -> dict:
        t = BrokerClient(broker.url)
        lease = t.request_lease(1, heartbeat=False)
        p = subprocess.Popen(["sleep", "120"], start_new_session=True)
        t.attach(lease["id"], p.pid)
        os.set_inheritable(0, True)
        return {"lease": lease["id"], "pid": p.pid}  # the child outlives the forked helper

    out = as_user(second_user, theirs)
    c = broker.client()  # root is an admin by default
    assert c.lease(out["lease"])["user"] == SECOND_USER
    assert c.history(out["lease"])[0]["to"] == "queued"
    assert any(x["id"] == out["lease"] for x in c.leases(everyone=True))
    c.renew(out["lease"], 120)
    c.revoke(out["lease"], "maintenance")
    assert c.lease(out["lease"])["state"] == "revoked"

    def gone() -> bool:
        try:
            with open(f"/proc/{out['pid']}/stat") as f:
                return f.read().split(") ")[1][0] == "Z"
        except FileNotFoundError:
            return True

    wait_for(gone, 10, "the second user's attached process to be stopped by the admin's revoke")


# ----------------------------------------------------------------------------- files at start
def test_socket_directory_writable_by_others_is_refused(broker_factory, tmp_path: Path) -> None:
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, 0o777)
    with pytest.raises(RuntimeError) as e:
        broker_factory(gpus=1, socket_path=str(d / "b.sock"), name="elsewhere")  # the store elsewhere
    assert "can be written by other users" in str(e.value) and str(d) in str(e.value) and "--socket" in str(e.value)
    assert not (d / "b.sock").exists()


def test_store_and_socket_permissions(broker_factory, tmp_path: Path) -> None:
    b = broker_factory(gpus=1, args=["--tick=0.1"], name="perms")
    b.client().request_lease(1, heartbeat=False)
    for f in (b.db, b.db + "-wal", b.db + "-shm"):
        if os.path.exists(f):
            assert stat.S_IMODE(os.stat(f).st_mode) == 0o600, f
    assert stat.S_IMODE(os.stat(os.path.dirname(b.db)).st_mode) & 0o022 == 0
    assert stat.S_IMODE(os.stat(b.socket).st_mode) == 0o666  # anyone may connect: identity is SO_PEERCRED
    # a store that an older broker left readable by others is tightened at start
    b.stop()
    os.chmod(b.db, 0o644)
    b.start()
    assert stat.S_IMODE(os.stat(b.db).st_mode) == 0o600
    # the token CLI creates its store 0600 too
    db = tmp_path / "tok" / "t.db"
    db.parent.mkdir()
    subprocess.run([sys.executable, "-m", "lease_broker", "token", "create", "dave", f"--db={db}"],
                   check=True, capture_output=True)
    assert stat.S_IMODE(os.stat(db).st_mode) == 0o600


def test_tokens_and_lease_secrets_never_logged(broker_factory) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    b = broker_factory(gpus=2, args=["--tick=0.1", f"--port={port}", "--debug"], name="logs")
    token = subprocess.run([sys.executable, "-m", "lease_broker", "token", "create", "erin", f"--db={b.db}"],
                           capture_output=True, text=True, check=True).stdout.strip()
    t = BrokerClient(f"http://127.0.0.1:{port}", token=token)
    u = b.client()
    secrets = []
    for client in (t, u):
        for _ in range(3):
            lease = client.request_lease(1, heartbeat=True)
            secrets.append(lease["secret"])
            client.heartbeat(lease["id"], active=True)
            client.renew(lease["id"], 60)
            client.lease(lease["id"])
            client.release(lease["id"])
    with pytest.raises(BrokerError):
        BrokerClient(f"http://127.0.0.1:{port}", token=token + "x").info()
    log = b.log_path.read_text(errors="replace")
    assert " D " in log and "POST /api/v1/leases" in log  # DEBUG request logs were written
    assert token not in log and token[4:] not in log and token + "x" not in log
    assert not [s for s in secrets if s in log]
    assert "Authorization" not in log and "Bearer" not in log


# ----------------------------------------------------------------------------- recycled pids
def _spawn_with_pid(pid: int, tries: int = 50) -> subprocess.Popen[bytes] | None:
    """A new process that gets ``pid`` (root only: /proc/sys/kernel/ns_last_pid)."""
    for _ in range(tries):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
        p = _sleeper()
        if p.pid == pid:
            return p
        p.kill()
        p.wait()
    return None


def test_revoke_never_signals_a_process_that_reused_an_attached_pid(broker) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to recycle a pid through /proc/sys/kernel/ns_last_pid (CI runs as root)")
    c = broker.client()
    lease = c.request_lease(1, heartbeat=False)
    old = _sleeper()
    c.attach(lease["id"], old.pid)
    old.kill()
    old.wait()
    time.sleep(0.05)  # start times are in clock ticks (10 ms): the new process must start in a later tick
    try:
        new = _spawn_with_pid(old.pid)
    except OSError as e:
        pytest.fail(f"root but /proc/sys/kernel/ns_last_pid is not writable here: {e}")
    assert new is not None, "could not recycle the pid (other processes kept taking it)"
    try:
        c.release(lease["id"])
        wait_for(lambda: c.gpus()["summary"]["free"] == 4, 10, "the GPU to be free")
        time.sleep(0.5)  # a real process must be observed: give a wrong signal time to land
        assert new.poll() is None, f"the unrelated process that reused pid {old.pid} was signalled"
        assert f"SIGTERM to process group of {old.pid}" not in broker.log()
    finally:
        new.kill()
        new.wait()


# ----------------------------------------------------------------------------- bad input
def _post(b, body: bytes) -> tuple[int, dict]:  # type: ignore[no-untyped-def]
    req = (b"POST /api/v1/leases HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
    return raw_request(b.socket, req)


BAD_BODIES = {
    "label_10kB": json.dumps({"gpus": 1, "labels": {"cell": "x" * 10_000}}).encode(),
    "labels_10000": json.dumps({"gpus": 1, "labels": {f"k{i}": "v" for i in range(10_000)}}).encode(),
    "label_not_string": json.dumps({"gpus": 1, "labels": {"a": {"b": 1}}}).encode(),
    "non_utf8": b'{"gpus": 1, "labels": {"cell": "\xff\xfe\xc0"}}',
    "nested_array_100k": b"[" * 100_000 + b"]" * 100_000,
    "nested_in_labels": b'{"gpus": 1, "labels": {"a": ' + b"[" * 50_000 + b"]" * 50_000 + b"}}",
    "duration_huge": b'{"gpus": 1, "duration_seconds": "99999999999h"}',
    "duration_inf": b'{"gpus": 1, "duration_seconds": 1e400}',
    "duration_nan": b'{"gpus": 1, "duration_seconds": NaN}',
    "mem_huge": b'{"gpus": 0.5, "mem": "1e400G"}',
    "gpus_float_huge": b'{"gpus": 1e400}',
    "priority_unicode": '{"gpus": 1, "priority": "h\u00f6ch\U0001f680"}'.encode(),
}


@pytest.mark.parametrize("name", list(BAD_BODIES))
def test_absurd_api_input_is_a_clear_4xx_and_stores_nothing(broker, name: str) -> None:
    code, payload = _post(broker, BAD_BODIES[name])
    assert 400 <= code < 500 and payload["status"] == code, (code, payload)
    assert payload["message"] and "Traceback" not in payload["message"] and len(payload["message"]) < 2000
    c = broker.client()
    assert c.leases(ended=1000) == [] and c.info()["summary"]["free"] == 4
    assert "Unhandled error" not in broker.log()


def test_unicode_labels_within_limits_are_kept(broker) -> None:
    c = broker.client()
    lease = c.request_lease(1, heartbeat=False, labels={"notebook": "résumé/训练 🚀.ipynb"})
    assert c.lease(lease["id"])["labels"]["notebook"] == "résumé/训练 🚀.ipynb"


@pytest.fixture
def kernel(broker, tmp_path: Path) -> Iterator[Kernel]:
    k = Kernel(broker.url, str(tmp_path / "artifacts"))
    yield k
    k.stop()


def test_absurd_magic_arguments_are_usage_errors_and_store_nothing(kernel: Kernel, broker) -> None:
    for line in ("%%gpu --time 99999999999h", "%%gpu --mem 1e400G", "%%gpu --mem 99999999999999999999T",
                 "%%gpu --mem 1000G", "%%gpu --mem 0",
                 "%%gpu --idle -5m", "%%gpu 1e400", "%%gpu --time 1h --time", "%%gpu \u00e9\u00e8"):
        r = kernel.run(f"{line}\nprint('ran')")
        # IPython shows a magic's UsageError as one line "UsageError: ..." (an error reply, or on stderr)
        text = f"UsageError: {r.error['evalue']}" if r.error else r.stderr
        assert text.startswith("UsageError: ") and text.strip().count("\n") == 0, (line, r.error, r.stderr)
        assert "ran" not in r.stdout, line
    assert broker.client().leases(ended=1000) == []


def test_every_answer_shows_a_lease_as_its_viewer_may_see_it(broker_factory, second_user):  # noqa: F811
    """One view for every handler: an admin sees who preempted a lease (GET and list alike), its owner only the
    class; and an admin's answer to an action on another user's lease is the admin's view, as GET's is."""
    broker = broker_factory(gpus=1, args=["--tick=0.1"], socket_path=_shared_socket_dir(), name="views")
    admin = broker.client()  # root is an admin by default
    admin.request("PUT", "/api/v1/policy", {"preempt_grace_seconds": {"high": 0}})

    def low_lease() -> dict:
        return dict(BrokerClient(broker.url).request_lease(1, heartbeat=False, priority="low"))

    victim = as_user(second_user, low_lease)
    assert victim["state"] == "granted"
    high = admin.request_lease(1, heartbeat=False, priority="high", wait=10)
    assert high["state"] == "granted"
    got = dict(admin.lease(victim["id"]))
    assert got["state"] == "revoked" and got["reason"] == "preempted"
    assert got["preempted_by"] == {"priority": "high", "user": "root", "lease_id": high["id"]}
    listed = next(x for x in admin.leases(everyone=True, ended=10) if x["id"] == victim["id"])
    assert listed["preempted_by"] == got["preempted_by"]
    owners = as_user(second_user, lambda: dict(BrokerClient(broker.url).lease(victim["id"])))
    assert owners["preempted_by"] == {"priority": "high"}

    admin.release(high["id"])
    theirs = as_user(second_user,
                     lambda: dict(BrokerClient(broker.url).request_lease(1, heartbeat=False, wait=10)))
    renewed = dict(admin.renew(theirs["id"], 600))
    assert renewed == dict(admin.lease(theirs["id"]))
    released = dict(admin.release(theirs["id"], "maintenance"))
    assert released == dict(admin.lease(theirs["id"])) and released["state"] == "revoked"
