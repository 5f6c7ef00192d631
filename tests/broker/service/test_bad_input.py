"""Nonsense a real broker process must refuse (issue 30 items 9 and 11): a policy with NaN, infinities, negative
numbers, no priority class or an unknown default class (through the API, a SIGHUP reload, the config at start);
integers of thousands of digits and lone surrogates in request bodies (a 400 naming the field, never a 5xx);
``/metrics`` over TCP without a token; a damaged store or socket path at start (one line naming the file and the fix,
no traceback; a lost table is never recreated empty). Every answer here is parsed as strict JSON."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from broker_process import free_port
from users import as_user, second_user  # noqa: F401  (fixture)
from waiting import wait_for

from lease_broker.api.base import json_text

pytestmark = pytest.mark.attack  # each test is an attack that must fail (BENCHMARKS.md: Reliability)

POLICY = "/api/v1/policy"
HUGE = "9" * 4000  # a JSON integer of 4,000 digits (Python reads up to 4,300)


def _no_constant(name: str) -> Any:
    raise ValueError(f"not strict JSON: {name}")


def strict_json(raw: bytes) -> Any:
    """Parse an answer as strict JSON (RFC 8259): no NaN, no Infinity, UTF-8, no lone surrogates."""
    data = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    json.dumps(data, ensure_ascii=False).encode("utf-8")  # a lone surrogate ("\ud800" escaped in it) fails here
    return data


class _Unix(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=30)
        self.unix_path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(self.unix_path)


def call(broker: Any, method: str, path: str, body: bytes | str | None = None) -> tuple[int, Any]:
    """One request over the broker's Unix socket (as root: an admin); the status and the strictly parsed answer."""
    conn = _Unix(broker.socket)
    data = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else body
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    return resp.status, strict_json(raw)


def filled(template: str, value: str) -> str:
    """A JSON body from a template with ``@`` where ``value`` goes (as JSON text, e.g. ``NaN`` or ``"\\ud800"``)."""
    return template.replace("@", value, 1)


def _numbers(policy: dict[str, Any]) -> list[str]:
    return sorted(k for k, v in policy.items() if isinstance(v, (int, float)) and not isinstance(v, bool))


# ----------------------------------------------------------------------------- a policy that cannot be nonsense
def test_every_numeric_policy_option_refuses_nan_infinity_and_negatives_through_the_api(broker) -> None:
    status, before = call(broker, "GET", POLICY)
    assert status == 200
    numbers = _numbers(before["policy"])
    assert len(numbers) >= 25, numbers  # every Float and Integer option of LeasePolicy
    for name in numbers:
        for bad in ("NaN", "Infinity", "-Infinity", "1e999", "-1", HUGE):
            status, answer = call(broker, "PUT", POLICY, filled(f'{{"{name}": @}}', bad))
            assert status == 400 and name in answer["message"], (name, bad, status, answer)
    for body, field in ((b'{"preempt_grace_seconds": {"high": -5}}', "preempt_grace_seconds"),
                        (b'{"user_max_gpus": {"ada": 1e999}}', "user_max_gpus"),
                        (b'{"user_limits": {"ada": {"max_duration_seconds": 1e999}}}', "user_limits"),
                        (b'{"group_limits": {"ml": {"max_gpus": {"H100": -1}}}}', "group_limits"),
                        (b'{"priority_classes": {}}', "priority_classes"),
                        (b'{"priority_classes": {"a": 1}}', "priority_classes"),  # the default class 'normal' gone
                        (b'{"default_priority": "urgent"}', "default_priority")):
        status, answer = call(broker, "PUT", POLICY, body)
        assert status == 400 and answer["field"].startswith(field) and field in answer["message"], (body, answer)
    assert call(broker, "GET", POLICY)[1] == before  # nothing of it was applied
    # classes and the default change together
    status, answer = call(broker, "PUT", POLICY, b'{"priority_classes": {"a": 0, "b": 5}, "default_priority": "b"}')
    assert status == 200 and answer["policy"]["default_priority"] == "b"
    status, lease = call(broker, "POST", "/api/v1/leases", b'{"gpus": 1, "heartbeat": false, "priority": "b"}')
    assert status == 201 and lease["state"] == "granted"  # the broker still grants: no 503 from a poisoned policy


def _reload(broker: Any, config: Path, text: str) -> None:
    config.write_text(text)
    assert broker.proc is not None
    broker.proc.send_signal(signal.SIGHUP)


def _refusals(broker: Any) -> list[str]:
    return [x for x in broker.log().splitlines() if "Policy reload from" in x and "refused" in x]


def test_a_sighup_reload_with_nonsense_is_refused_naming_the_option(broker_factory, tmp_path: Path) -> None:
    config = tmp_path / "policy.py"
    config.write_text("c.LeasePolicy.heartbeat_timeout = 30\n")
    b = broker_factory(gpus=2, args=["--tick=0.1", f"--config={config}"])
    refusals = 0
    for text, option in (("c.LeasePolicy.heartbeat_timeout = float('nan')\n", "heartbeat_timeout"),
                         ("c.LeasePolicy.max_duration_seconds = float('inf')\n", "max_duration_seconds"),
                         ("c.LeasePolicy.warn_before_seconds = -1\n", "warn_before_seconds"),
                         ("c.LeasePolicy.priority_classes = {}\n", "priority_classes"),
                         ("c.LeasePolicy.default_priority = 'urgent'\n", "default_priority")):
        _reload(b, config, text)
        refusals += 1
        wait_for(lambda n=refusals: len(_refusals(b)) >= n, what=f"the reload of {option} refused")
        line = _refusals(b)[-1]
        assert option in line, line
        assert call(b, "GET", POLICY)[1]["policy"]["heartbeat_timeout"] == 30
    _reload(b, config, "c.LeasePolicy.heartbeat_timeout = 45\n")  # a sound file is applied
    wait_for(lambda: call(b, "GET", POLICY)[1]["policy"]["heartbeat_timeout"] == 45, what="the sound reload")
    assert "Traceback" not in b.log()


def _start(args: list[str], cwd: Path, timeout: float = 30) -> tuple[int, str]:
    """Start a broker that must refuse to start: its exit code and everything it printed."""
    cmd = [sys.executable, "-m", "lease_broker", "--inventory=simulated", "--gpus=2", *args]
    env = {k: v for k, v in os.environ.items() if k != "GPULEASE_BROKER"}
    try:
        out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:  # it started: the test fails below, naming what it printed
        return 0, f"started anyway: {e.stdout!r} {e.stderr!r}"
    return out.returncode, out.stdout + out.stderr


def _start_as(pw: Any, args: list[str], cwd: Path, timeout: float = 30) -> tuple[int, str]:
    """``_start`` as another user: in a forked child that drops to its uid (this interpreter lies in root's home,
    which the user cannot execute), running the broker's ``main`` there."""
    from lease_broker.app import main

    with tempfile.TemporaryFile() as out:
        pid = os.fork()
        if pid == 0:  # child
            code = 1
            try:
                sys.stdout = sys.stderr = open(out.fileno(), "w", closefd=False)  # past pytest's capture
                os.chdir(cwd)
                os.setgroups([])
                os.setgid(pw.pw_gid)
                os.setuid(pw.pw_uid)
                main(["--inventory=simulated", "--gpus=2", *args])
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)

        def exited() -> tuple[int] | None:
            done, status = os.waitpid(pid, os.WNOHANG)
            return (os.waitstatus_to_exitcode(status),) if done else None

        try:
            (rc,) = wait_for(exited, timeout, "the broker to exit")
        except AssertionError:  # it started: the test fails on rc 0
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            rc = 0
        out.seek(0)
        return rc, out.read().decode(errors="replace")


def _refused_in_one_line(rc: int, output: str, *facts: str) -> str:
    assert rc != 0 and "Traceback" not in output, output
    lines = [x for x in output.splitlines() if all(f in x for f in facts)]
    assert len(lines) == 1, (facts, output)
    return lines[0]


@pytest.mark.parametrize("setting, option", [
    ("c.LeasePolicy.heartbeat_timeout = float('nan')", "LeasePolicy.heartbeat_timeout"),
    ("c.LeasePolicy.max_shares_per_gpu = float('inf')", "LeasePolicy.max_shares_per_gpu"),
    ("c.LeasePolicy.term_timeout = -5", "LeasePolicy.term_timeout"),
    ("c.LeasePolicy.backfill_depth = -1", "LeasePolicy.backfill_depth"),
    ("c.LeasePolicy.fairshare_weight = 0", "LeasePolicy.fairshare_weight"),
    ("c.LeasePolicy.preempt_grace_seconds = {'high': float('nan')}", "preempt_grace_seconds"),
    ("c.LeasePolicy.priority_classes = {}", "LeasePolicy.priority_classes"),
    ("c.LeasePolicy.default_priority = 'urgent'", "LeasePolicy.default_priority"),
])
def test_a_config_with_nonsense_stops_the_start_naming_the_option(tmp_path: Path, setting: str, option: str) -> None:
    config = tmp_path / "lease_broker_config.py"
    config.write_text(setting + "\n")
    rc, output = _start([f"--socket={tmp_path}/b.sock", f"--db={tmp_path}/l.db", f"--config={config}"], tmp_path)
    _refused_in_one_line(rc, output, option)
    assert not (tmp_path / "b.sock").exists()


# ----------------------------------------------------------------------------- bad input: never a 5xx
def test_integers_of_thousands_of_digits_in_any_duration_field_are_a_400_naming_it(broker) -> None:
    status, lease = call(broker, "POST", "/api/v1/leases", b'{"gpus": 1, "heartbeat": false}')
    assert status == 201
    renew = f"/api/v1/leases/{lease['id']}/renew"
    cases = [("/api/v1/leases", "duration_seconds", '{"gpus": 1, "duration_seconds": @}'),
             ("/api/v1/leases", "idle_timeout_seconds", '{"gpus": 1, "idle_timeout_seconds": @}'),
             ("/api/v1/leases", "wait_seconds", '{"gpus": 1, "wait_seconds": @}'),
             (renew, "duration_seconds", '{"duration_seconds": @}'),
             (renew, "extend_seconds", '{"extend_seconds": @}'),
             ("/api/v1/reservations", "duration_seconds", '{"user": "root", "gpus": 1, "duration_seconds": @}'),
             ("/api/v1/reservations", "start", '{"user": "root", "gpus": 1, "start": @}'),
             ("/api/v1/reservations", "end", '{"user": "root", "gpus": 1, "end": @}')]
    for number in (HUGE, "-" + HUGE, str(2**62), "1e999"):
        for path, field, body in cases:
            status, answer = call(broker, "POST", path, filled(body, number))
            assert status == 400 and field in answer["message"], (path, field, number[:30], status, answer)
            assert len(answer["message"]) < 400  # the value is quoted by its first digits, not all 4,000
    for body in (filled('{"gpus": 1, "min_gpus": @}', HUGE), filled('{"min_gpus": 1, "fraction": @}', HUGE)):
        assert call(broker, "POST", "/api/v1/leases", body)[0] == 400
    assert call(broker, "POST", f"/api/v1/leases/{lease['id']}/processes", filled('{"pid": @}', HUGE))[0] == 400
    status, mine = call(broker, "GET", "/api/v1/leases")
    assert status == 200 and [x["id"] for x in mine["leases"]] == [lease["id"]]  # nothing else stored
    assert "Unhandled error" not in broker.log()


SURROGATE = "\ud800"  # a lone surrogate: no UTF-8 text (SQLite's included) can hold it


@pytest.mark.parametrize("escaped", [True, False], ids=["json-escape", "raw-bytes"])
def test_lone_surrogates_anywhere_in_a_body_are_a_400_naming_the_field(broker, escaped: bool) -> None:
    def text(value: str) -> str:  # "\ud800" as a JSON escape, or its bytes (ED A0 80) right in the body
        return json.dumps(value) if escaped else '"' + value + '"'

    s = SURROGATE
    cases = [("/api/v1/leases", "labels.notebook", filled('{"gpus": 1, "labels": {"notebook": @}}', text("a" + s))),
             ("/api/v1/leases", "labels.", filled('{"gpus": 1, "labels": {@: "x"}}', text(s))),
             ("/api/v1/leases", "priority", filled('{"gpus": 1, "priority": @}', text(s))),
             ("/api/v1/leases", "gpu_type", filled('{"gpus": 1, "gpu_type": @}', text(s))),
             ("/api/v1/reservations", "user", filled('{"user": @, "gpus": 1}', text(s))),
             ("/api/v1/reservations", "note", filled('{"user": "root", "gpus": 1, "note": @}', text("booked " + s))),
             (POLICY, "group_members.ml[0]", filled('{"group_members": {"ml": [@]}}', text(s)))]
    for path, field, body in cases:
        method = "PUT" if path == POLICY else "POST"
        status, answer = call(broker, method, path, body)
        assert status == 400 and field in answer["message"], (path, field, status, answer)
    assert call(broker, "GET", "/api/v1/leases")[1]["leases"] == []
    assert call(broker, "GET", "/api/v1/reservations")[1]["reservations"] == []
    assert "Unhandled error" not in broker.log()


def test_answers_are_strict_json_even_where_a_number_is_not_finite() -> None:
    """The one encoder of answers and events (api/base.py): never NaN or Infinity, which strict parsers refuse."""
    text = json_text({"a": float("nan"), "b": [1.5, float("inf")], "c": {"d": -float("inf")}, "e": "x"})
    assert strict_json(text.encode()) == {"a": None, "b": [1.5, None], "c": {"d": None}, "e": "x"}


# ----------------------------------------------------------------------------- /metrics over TCP
def _token(db: str, user: str, cwd: Path) -> str:
    out = subprocess.run([sys.executable, "-m", "lease_broker", "token", "create", user, f"--db={db}"],
                         capture_output=True, text=True, check=True, cwd=cwd)
    return out.stdout.strip().splitlines()[-1]


def test_metrics_over_tcp_need_a_token_and_over_the_socket_do_not(tmp_path: Path) -> None:
    from broker_process import BrokerProcess, scrape_metrics

    port = free_port()
    b = BrokerProcess(tmp_path / "tcp", gpus=2, args=["--tick=0.1", f"--port={port}"])
    token = _token(b.db, "prometheus", b.workdir)
    b.start()
    try:
        b.client().request_lease(1, heartbeat=False)  # a series that names a user and a lease

        def scrape(authorization: str | None) -> tuple[int, bytes, str]:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request("GET", "/metrics", headers={"Authorization": authorization} if authorization else {})
            resp = conn.getresponse()
            body = resp.read()
            conn.close()
            return resp.status, body, resp.headers.get("Content-Type", "")

        for refused in (None, "Bearer gpl_not-a-token", "Basic x"):
            status, body, media = scrape(refused)
            assert status == 401 and media.startswith("application/json"), (refused, status, body[:200])
            answer = strict_json(body)
            assert answer["status"] == 401 and b"gpulease_" not in body
        status, body, media = scrape(f"Bearer {token}")
        assert status == 200 and media.startswith("text/plain") and b"gpulease_user_gpus" in body
        assert "gpulease_user_gpus" in scrape_metrics(b.socket)  # the Unix socket: as before, no token
    finally:
        b.stop()


# ----------------------------------------------------------------------------- damaged stores and socket paths
def _good_store(tmp_path: Path) -> str:
    """A store a broker wrote (one lease in it), the broker stopped."""
    from broker_process import BrokerProcess

    b = BrokerProcess(tmp_path / "first", gpus=2, args=["--tick=0.1"]).start()
    try:
        b.client().request_lease(1, heartbeat=False)
    finally:
        b.stop()
    return b.db


def _damage(db: str, how: str) -> None:
    if how == "garbage":
        Path(db).write_bytes(os.urandom(8192))
    elif how == "directory":
        os.remove(db)
        os.mkdir(db)
    elif how == "damaged row":
        with sqlite3.connect(db) as raw:
            raw.execute("UPDATE leases SET request='{not json'")
    else:  # "dropped history"
        with sqlite3.connect(db) as raw:
            raw.execute("DROP TABLE transitions")


@pytest.mark.parametrize("how, facts", [
    ("garbage", ("--db",)),
    ("directory", ("--db",)),
    ("damaged row", ("backup",)),
    ("dropped history", ("'transitions'", "backup")),
])
def test_a_damaged_store_is_refused_at_start_in_one_line(tmp_path: Path, how: str, facts: tuple[str, ...]) -> None:
    db = _good_store(tmp_path)
    for suffix in ("-wal", "-shm"):
        Path(db + suffix).unlink(missing_ok=True)
    _damage(db, how)
    rc, output = _start([f"--socket={tmp_path}/b.sock", f"--db={db}"], tmp_path)
    _refused_in_one_line(rc, output, db, *facts)
    if how == "dropped history":  # still missing: never recreated empty
        with sqlite3.connect(db) as raw:
            assert raw.execute("SELECT name FROM sqlite_master WHERE name='transitions'").fetchone() is None


def test_a_store_the_broker_cannot_read_is_refused_at_start_in_one_line(second_user) -> None:  # noqa: F811
    """Run as another user (root reads every file): the store is root's, mode 0600."""
    home = Path(tempfile.mkdtemp(prefix="gl-unreadable"))
    try:
        os.chown(home, second_user.pw_uid, second_user.pw_gid)
        db = home / "leases.db"
        db.write_bytes(b"")
        os.chmod(db, 0o600)  # root's: unreadable for the broker's user
        rc, output = _start_as(second_user, [f"--socket={home}/b.sock", f"--db={db}"], home)
        _refused_in_one_line(rc, output, str(db), "--db")
    finally:
        subprocess.run(["rm", "-rf", str(home)], check=False)


@pytest.mark.parametrize("what", ["directory", "file", "parent is a file"])
def test_a_bad_socket_path_is_refused_at_start_in_one_line(tmp_path: Path, what: str) -> None:
    path = tmp_path / "b.sock"
    if what == "directory":
        path.mkdir()
    elif what == "file":
        path.write_text("someone's data")
    else:
        (tmp_path / "plain").write_text("")
        path = tmp_path / "plain" / "sub" / "b.sock"
    rc, output = _start([f"--socket={path}", f"--db={tmp_path}/l.db"], tmp_path)
    _refused_in_one_line(rc, output, str(path.parent if what == "parent is a file" else path), "--socket")
    if what == "file":
        assert path.read_text() == "someone's data"  # never removed as if it were a stale socket


def test_a_store_directory_that_cannot_be_made_is_refused_at_start_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "plain").write_text("")
    db = tmp_path / "plain" / "sub" / "leases.db"
    rc, output = _start([f"--socket={tmp_path}/b.sock", f"--db={db}"], tmp_path)
    _refused_in_one_line(rc, output, str(db.parent), "--db")
