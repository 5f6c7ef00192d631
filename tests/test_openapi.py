"""The OpenAPI document is the contract between the broker and its clients: keep it honest.

(a) it is a valid OpenAPI 3.1 document; (b) its paths and methods are exactly the broker's routes and the
methods their handlers implement; (c) real answers of a real broker process (successes and errors) validate
against the documented status codes, media types, headers and schemas; (d) schemathesis generates requests
from the document against a real broker over TCP and checks that none gets a 5xx or an undocumented answer.
"""

from __future__ import annotations

import base64
import http.client
import itertools
import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator
from openapi_spec_validator import validate as validate_openapi
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012
from tornado import web

from lease_broker.api.metrics_http import MetricsHandler
from lease_broker.api.openapi import load
from lease_broker.api.routes import default_handlers

SPEC = load()
METHODS = ("get", "post", "put", "patch", "delete", "head", "options")
SPEC_URI = "urn:gpulease:openapi"
REGISTRY = Registry().with_resource(SPEC_URI, Resource.from_contents(SPEC, default_specification=DRAFT202012))
LEASE_ID_GROUP = "([A-Za-z0-9_-]{1,64})"
RESERVATION_ID_GROUP = "(r-[A-Za-z0-9_-]{1,62})"


# ---------------------------------------------------------------------------------------------- helpers
def routes() -> list[tuple[str, type[web.RequestHandler]]]:
    """Every route the broker serves (service.make_app adds /metrics to the API's default_handlers)."""
    return [*default_handlers(), (r"/metrics", MetricsHandler)]


def templates(regex: str) -> list[str]:
    """OpenAPI path templates of a tornado route: the lease id group becomes {lease_id}; (a|b) expands."""
    text = regex.replace(LEASE_ID_GROUP, "{lease_id}").replace(RESERVATION_ID_GROUP, "{reservation_id}")
    parts = re.split(r"\(([A-Za-z_|]+)\)", text)
    literals, choices = parts[0::2], [p.split("|") for p in parts[1::2]]
    out = []
    for combo in itertools.product(*choices):
        out.append("".join(lit + (combo[i] if i < len(combo) else "") for i, lit in enumerate(literals)))
    assert all(set(t) <= set("abcdefghijklmnopqrstuvwxyz0123456789/_.-{}") for t in out), out
    return out


def implemented(cls: type[web.RequestHandler]) -> set[str]:
    return {m for m in METHODS if getattr(cls, m) is not getattr(web.RequestHandler, m)}


def pointer(*parts: str) -> str:
    return "/".join(p.replace("~", "~0").replace("/", "~1") for p in parts)


def deref(obj: dict[str, Any]) -> dict[str, Any]:
    """Resolve a local $ref of the document (responses, parameters)."""
    while "$ref" in obj:
        node: Any = SPEC
        for part in obj["$ref"].removeprefix("#/").split("/"):
            node = node[part.replace("~1", "/").replace("~0", "~")]
        obj = node
    return obj


def schema_validator(*where: str) -> Draft202012Validator:
    """A validator for the schema at a JSON pointer of the document, resolving $refs within it."""
    return Draft202012Validator({"$ref": f"{SPEC_URI}#/{pointer(*where)}"}, registry=REGISTRY)


def component(name: str) -> Draft202012Validator:
    return schema_validator("components", "schemas", name)


def check_answer(method: str, template: str, status: int, headers: http.client.HTTPMessage, raw: bytes) -> Any:
    """Assert that an answer is documented: its status, media type, headers and body schema."""
    op = SPEC["paths"][template][method.lower()]
    documented = op["responses"]
    assert str(status) in documented, f"{method} {template} answered {status}, documented: {sorted(documented)}"
    response = deref(documented[str(status)])
    media = (headers.get("Content-Type") or "").split(";")[0].strip()
    assert media in response.get("content", {}), f"{method} {template} {status}: undocumented media type {media!r}"
    for name, header in response.get("headers", {}).items():
        value = headers.get(name)
        assert value is not None, f"{method} {template} {status}: missing header {name}"
        if header["schema"].get("type") == "integer":
            assert int(value) >= header["schema"].get("minimum", 0)
    if media != "application/json":
        return raw
    body = strict_json(raw)
    where = ("paths", template, method.lower(), "responses", str(status))
    if "$ref" in documented[str(status)]:
        where = ("components", "responses", documented[str(status)]["$ref"].rsplit("/", 1)[1])
    errors = sorted(schema_validator(*where, "content", "application/json", "schema").iter_errors(body), key=str)
    assert not errors, f"{method} {template} {status}: " + "; ".join(
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors[:5]
    )
    return body


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def strict_json(raw: bytes) -> Any:
    """An answer parsed as strict JSON (RFC 8259), as a strict client would: UTF-8, no NaN or Infinity, no lone
    surrogate (escaped as ``\\ud800`` it passes Python's parser; it is no Unicode text)."""
    data = json.loads(raw.decode("utf-8"), parse_constant=_not_json)
    json.dumps(data, ensure_ascii=False).encode("utf-8")
    return data


class Unix(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=30)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(self.path)


class Caller:
    """Raw HTTP to a broker; every answer is checked against the document and recorded."""

    def __init__(self, conn: http.client.HTTPConnection, headers: dict[str, str] | None = None) -> None:
        self.conn = conn
        self.headers = headers or {}
        self.seen: set[tuple[str, str, int]] = set()

    def __call__(self, method: str, template: str, expect: int, body: Any = None, raw: bytes | None = None,
                 query: str = "", **params: str) -> Any:
        path = template.format(**params) + query
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        headers = {**self.headers, **({"Content-Type": "application/json"} if data is not None else {})}
        self.conn.request(method, path, body=data, headers=headers)
        resp = self.conn.getresponse()
        content = resp.read()
        assert resp.status == expect, f"{method} {path}: {resp.status} {content[:300]!r}"
        self.seen.add((method, template, resp.status))
        return check_answer(method, template, resp.status, resp.headers, content)


# ---------------------------------------------------------------------------------------------- (a), (b)
def test_document_is_valid_openapi_3_1() -> None:
    assert SPEC["openapi"].startswith("3.1")
    validate_openapi(SPEC)
    # every schema in components is itself a valid JSON Schema (2020-12, the dialect of OpenAPI 3.1)
    for schema in SPEC["components"]["schemas"].values():
        Draft202012Validator.check_schema(schema)


def test_every_route_is_documented_and_every_documented_path_is_served() -> None:
    served = {t for regex, _ in routes() for t in templates(regex)}
    assert served == set(SPEC["paths"]), (
        f"served but not documented: {sorted(served - set(SPEC['paths']))}; "
        f"documented but not served: {sorted(set(SPEC['paths']) - served)}"
    )
    # each documented path, filled in, is matched by exactly the route it was derived from
    for template in SPEC["paths"]:
        concrete = template.replace("{lease_id}", "l-0123456789ab").replace("{reservation_id}", "r-0123456789")
        matching = [regex for regex, _ in routes() if re.fullmatch(regex, concrete)]
        assert len(matching) == 1, (template, matching)


def test_documented_methods_are_the_implemented_ones() -> None:
    for regex, cls in routes():
        for template in templates(regex):
            documented = {m for m in SPEC["paths"][template] if m in METHODS}
            assert documented == implemented(cls), f"{template} ({cls.__name__}): documented {documented}"


def test_lease_id_parameter_matches_the_route_pattern() -> None:
    for template, item in SPEC["paths"].items():
        for method in (m for m in item if m in METHODS):
            params = [deref(p) for p in item[method].get("parameters", [])]
            in_path = {p["name"]: p for p in params if p["in"] == "path"}
            assert set(in_path) == set(re.findall(r"\{(\w+)\}", template)), (template, method)
            if "lease_id" in in_path:
                assert in_path["lease_id"]["schema"]["pattern"] == "^" + LEASE_ID_GROUP[1:-1] + "$"


def test_every_error_status_is_documented_with_the_error_schema() -> None:
    for template, item in SPEC["paths"].items():
        for method in (m for m in item if m in METHODS):
            responses = item[method]["responses"]
            if item[method].get("security") != []:  # authenticated: 401 and 503 everywhere
                assert {"401", "503"} <= set(responses), (template, method)
            for status, response in responses.items():
                response = deref(response)
                if int(status) >= 400 and "application/json" in response.get("content", {}):
                    schema = response["content"]["application/json"]["schema"]
                    assert schema == {"$ref": "#/components/schemas/Error"}, (template, method, status)
    assert "Retry-After" in SPEC["components"]["responses"]["TooManyRequests"]["headers"]


def test_the_broker_serves_its_document(client: Any) -> None:
    assert client.request("GET", "/api/v1/openapi.json") == SPEC


# ---------------------------------------------------------------------------------------------- (c)
def token_for(broker: Any, user: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "lease_broker", "token", "create", user, f"--db={broker.db}"],
        capture_output=True, text=True, check=True, cwd=broker.workdir,
    )
    return out.stdout.strip().splitlines()[-1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def tcp_broker(broker_factory: Any, tmp_path: Any) -> Iterator[tuple[Any, int, str]]:
    """A real broker on a Unix socket and a TCP port, and a bearer token of the non-admin user 'fuzz'."""
    from broker_process import BrokerProcess

    port = free_port()
    b = BrokerProcess(tmp_path / "tcp", gpus=4, args=["--tick=0.1", f"--port={port}"])
    token = token_for(b, "fuzz")  # creates the store before the broker opens it
    b.start()
    try:
        yield b, port, token
    finally:
        b.stop()


def websocket_hello(path: str) -> dict[str, Any]:
    """Open the event WebSocket over the Unix socket and return its first message."""
    key = base64.b64encode(os.urandom(16)).decode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(path)
        s.sendall(
            (
                "GET /api/v1/events HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
            ).encode()
        )
        data = b""
        while b"\r\n\r\n" not in data:
            data += s.recv(4096)
        head, _, rest = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 101"), head
        while len(rest) < 2 or len(rest) < frame_size(rest):
            rest += s.recv(65536)
        start, length = frame_header(rest)
        return dict(json.loads(rest[start : start + length]))


def frame_header(buf: bytes) -> tuple[int, int]:
    length = buf[1] & 0x7F
    if length == 126:
        return 4, int.from_bytes(buf[2:4], "big")
    if length == 127:
        return 10, int.from_bytes(buf[2:10], "big")
    return 2, length


def frame_size(buf: bytes) -> int:
    if len(buf) < 10:
        return 10 if buf[1] & 0x7F >= 126 else 2 + (buf[1] & 0x7F)
    start, length = frame_header(buf)
    return start + length


def test_real_answers_match_the_document(tcp_broker: tuple[Any, int, str]) -> None:
    broker, port, token = tcp_broker
    call = Caller(Unix(broker.socket))  # the test runs as its own uid: root here is an admin
    L, ONE = "/api/v1/leases", "/api/v1/leases/{lease_id}"

    call("GET", "/api/v1/openapi.json", 200)
    call("GET", "/api/v1/info", 200)
    call("GET", "/api/v1/queue", 200)
    a = call("POST", L, 201, {"gpus": 1, "heartbeat": False, "duration_seconds": "1h", "labels": {"cell": 3}})
    s = call("POST", L, 201, {"gpus": 0.5, "mem": "1G", "priority": "normal", "idle_timeout_seconds": 600})
    assert s["env"]["GPULEASE_MEMORY_LIMIT"] == str(1 << 30)
    q = call("POST", L, 202, {"gpus": "4-4", "locality": "any", "wait_seconds": 0.05})
    assert q["state"] == "queued" and q["position"] == 1
    call("GET", ONE, 200, lease_id=q["id"], query="?wait=0.05")
    assert call("GET", "/api/v1/queue", 200)["queue"][0]["lease_id"] == q["id"]
    gpus = call("GET", "/api/v1/gpus", 200)
    assert {g["state"] for g in gpus["gpus"]} == {"leased", "shared", "free"}
    call("GET", L, 200)
    call("GET", L, 200, query="?all=1&ended=5")
    assert call("POST", ONE + "/heartbeat", 200, {"active": True}, lease_id=a["id"])["state"] == "active"
    call("POST", ONE + "/renew", 200, {"duration_seconds": "2h"}, lease_id=a["id"])
    refused = call("POST", ONE + "/renew", 403, {"duration_seconds": 10**7}, lease_id=a["id"])
    assert refused["reason"] == "max_duration"
    child = subprocess.Popen(["sleep", "60"])
    try:
        assert call("POST", ONE + "/processes", 200, {"pid": child.pid}, lease_id=a["id"])["pids"] == [child.pid]
        call("POST", ONE + "/processes", 400, {"pid": "x"}, lease_id=a["id"])
        call("GET", ONE + "/history", 200, lease_id=a["id"])
        call("POST", ONE + "/release", 200, {"reason": "done"}, lease_id=a["id"])
    finally:
        child.kill()
        child.wait()
    assert call("POST", ONE + "/release", 409, {}, lease_id=a["id"])["state"] == "released"
    call("POST", ONE + "/heartbeat", 409, {}, lease_id=a["id"])
    call("POST", ONE + "/revoke", 200, {"reason": "test"}, lease_id=s["id"])
    call("DELETE", ONE, 200, lease_id=q["id"], query="?reason=changed+my+mind")
    call("DELETE", ONE, 409, lease_id=q["id"])
    call("GET", ONE, 200, lease_id=a["id"])
    history = call("GET", ONE + "/history", 200, lease_id=a["id"])["transitions"]
    assert [t["to"] for t in history][:2] == ["queued", "granted"] and history[0]["from"] is None
    # input errors
    call("GET", ONE, 404, lease_id="l-000000000000")
    call("GET", ONE + "/history", 404, lease_id="l-000000000000")
    call("POST", ONE + "/renew", 404, {}, lease_id="l-000000000000")
    call("POST", L, 400, raw=b"{not json")
    call("POST", L, 400, raw=b"[1]")
    call("POST", L, 400, {"gpus": "lots"})
    call("POST", L, 400, {"gpus": 2, "colour": "red"})
    call("POST", L, 400, {"min_gpus": 1, "fraction": "half"})  # was a 500
    call("POST", L, 400, {"gpus": 0.5, "mem": "9" * 400})  # was a 500 (int(inf))
    assert call("POST", L, 400, {"gpus": 100})["reason"] == "too_large"
    call("GET", L, 400, query="?ended=many")
    call("GET", ONE, 400, lease_id=a["id"], query="?wait=soon")
    call("POST", ONE + "/heartbeat", 400, {"active": "yes"}, lease_id=a["id"])
    assert call("GET", "/metrics", 200).startswith(b"# HELP")

    # the event streams
    conn = Unix(broker.socket)
    conn.request("GET", "/api/v1/events/stream")
    resp = conn.getresponse()
    check_answer("GET", "/api/v1/events/stream", resp.status, resp.headers, b"")
    assert resp.read(13) == b"retry: 2000\n\n"
    conn.close()
    hello = websocket_hello(broker.socket)
    assert hello["type"] == "hello" and not list(component("Event").iter_errors(hello))
    call("GET", "/api/v1/events", 400)  # not an upgrade request

    # over TCP: a token user who is no admin; no token at all
    tcp = Caller(http.client.HTTPConnection("127.0.0.1", port, timeout=30), {"Authorization": f"Bearer {token}"})
    info = tcp("GET", "/api/v1/info", 200)
    assert info["user"] == {"name": "fuzz", "uid": -1, "admin": False}
    tcp("GET", L, 403, query="?all=1")
    tcp("GET", ONE, 403, lease_id=q["id"])
    tcp("POST", ONE + "/revoke", 403, {}, lease_id=q["id"])
    mine = tcp("POST", L, 201, {"gpus": 1, "heartbeat": False})
    tcp("POST", ONE + "/processes", 403, {"pid": os.getpid()}, lease_id=mine["id"])  # only over the Unix socket
    tcp("DELETE", ONE, 200, lease_id=mine["id"])
    anonymous = Caller(http.client.HTTPConnection("127.0.0.1", port, timeout=30))
    assert anonymous("GET", "/api/v1/info", 401)["reason"] == "unauthorized"
    Caller(http.client.HTTPConnection("127.0.0.1", port, timeout=30), {"Authorization": "Bearer nope"})(
        "GET", "/api/v1/queue", 401
    )
    anonymous("GET", "/api/v1/openapi.json", 200)
    assert anonymous("GET", "/metrics", 401)["reason"] == "unauthorized"  # the series name users and leases
    assert tcp("GET", "/metrics", 200).startswith(b"# HELP")

    statuses = {status for _, _, status in call.seen | tcp.seen | anonymous.seen}
    assert {200, 201, 202, 400, 401, 403, 404, 409} <= statuses
    # 429 and 503 are documented but cannot be provoked here: no policy answers 429 yet, and the
    # store does not fail on demand. Their schemas are checked by test_every_error_status_is_documented.


# ---------------------------------------------------------------------------------------------- (d)
def _short_waits(case: Any) -> None:
    """A generated long poll (``wait_seconds`` in a body, ``wait`` in a query, up to MAX_WAIT) on a request that
    queues would hold the call past the client's timeout: waits are cut to 2 s here (long polls are (c)'s)."""
    for where, key in ((case.body, "wait_seconds"), (case.query, "wait")):
        if not isinstance(where, dict) or key not in where or isinstance(where[key], bool):
            continue
        value = where[key]
        if isinstance(value, (int, float)):
            where[key] = min(value, 2)
        elif isinstance(value, str) and re.fullmatch(r"\s*\d+(\.\d+)?\s*(ms|s|m|min|h|d)?\s*", value):
            where[key] = "2s"  # a valid duration (an invalid one is left for its 400)


def test_generated_requests_get_documented_answers(tcp_broker: tuple[Any, int, str]) -> None:
    """Schemathesis: requests generated from the document (valid and invalid) against a real broker over TCP."""
    schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is in the test extras")
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import GenerationMode
    from schemathesis.checks import (
        content_type_conformance,
        not_a_server_error,
        response_headers_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    _, port, token = tcp_broker
    base_url = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {token}"}
    schema = schemathesis.openapi.from_dict(SPEC)
    streaming = {"/api/v1/events", "/api/v1/events/stream"}  # never-ending answers: covered in (c)
    conformance = [not_a_server_error, status_code_conformance, content_type_conformance,
                   response_schema_conformance, response_headers_conformance]

    # ``make soak`` raises the examples per operation and mode; the figures go to BENCHMARKS.md
    examples = int(os.environ.get("GPULEASE_FUZZ_EXAMPLES", "25"))
    tried: dict[str, int] = {}
    statuses: dict[int, int] = {}

    def exercise(op: Any, mode: Any, checks: list[Any]) -> None:
        @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy(generation_mode=mode))
        def run(case: Any) -> None:
            _short_waits(case)
            response = case.call(base_url=base_url, headers=headers, timeout=30)
            key = f"{op.method.upper()} {op.path} {mode.name.lower()}"
            tried[key] = tried.get(key, 0) + 1
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            case.validate_response(response, checks=checks)
            if response.headers.get("Content-Type", "").startswith("application/json"):
                strict_json(response.content)

        run()

    ran = 0
    for result in schema.get_all_operations():
        op = result.ok()
        if op.path in streaming:
            continue
        exercise(op, GenerationMode.POSITIVE, conformance)
        ran += 1
        raw = SPEC["paths"][op.path][op.method.lower()]
        if raw.get("parameters") or raw.get("requestBody"):  # else there is nothing to make invalid
            # invalid input: never a 5xx, and the 4xx answer is the documented error (schema, media type)
            exercise(op, GenerationMode.NEGATIVE,
                     [not_a_server_error, content_type_conformance, response_schema_conformance])
            ran += 1
    assert ran >= 15 + 9
    assert not [code for code in statuses if code >= 500], statuses
    if os.environ.get("GPULEASE_FUZZ_STATS"):
        Path(os.environ["GPULEASE_FUZZ_STATS"]).write_text(json.dumps(
            {"examples_per_operation_and_mode": examples, "runs": ran, "inputs": sum(tried.values()),
             "operations": len({k.rsplit(" ", 1)[0] for k in tried}), "by_operation": tried,
             "statuses": {str(k): v for k, v in sorted(statuses.items())}}, indent=1))


# ---------------------------------------------------------------------------------------------- (e)
#: What strict JSON forbids, or no store can hold, in place of one value of a generated body: Python's parser reads
#: them all (NaN, Infinity, 1e999 as inf, integers up to 4,300 digits, lone surrogates as escapes or as raw bytes:
#: ED A0 80, written here as surrogate escapes of those bytes).
POISON = ("NaN", "Infinity", "-Infinity", "1e999", "-1e999", "9" * 400, "-" + "9" * 4000, str(2**64), str(2**62),
          '"\\ud800"', '"tail \\udfff"', '"\udced\udca0\udc80"', '{"\\ud800": 1}')


def poisoned(body: Any, at: int, poison: str) -> bytes:
    """The JSON text of ``body`` with its ``at``-th value (counted over the whole document, modulo how many there
    are; the body itself when it holds none) replaced by ``poison``."""
    slots: list[tuple[Any, Any]] = []
    stack = [body]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in items:
            slots.append((node, key))
            stack.append(value)
    marker = "__poison__"
    if slots:
        node, key = slots[at % len(slots)]
        node[key] = marker
        text = json.dumps(body)
    else:
        text = json.dumps(marker)
    return text.replace(json.dumps(marker), poison, 1).encode("utf-8", "surrogateescape")


def test_poisoned_bodies_get_documented_4xx_answers(tcp_broker: tuple[Any, int, str]) -> None:
    """Bodies schemathesis generates for every operation that takes one, each with one value replaced by NaN, an
    infinity, a huge integer or a lone surrogate, sent by an admin over the Unix socket (so that every handler,
    the policy's included, reads them): never a 5xx, and every answer documented and strict JSON."""
    schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is in the test extras")
    from urllib.parse import urlencode

    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st
    from schemathesis import GenerationMode

    broker, _, _ = tcp_broker
    schema = schemathesis.openapi.from_dict(SPEC)
    examples = int(os.environ.get("GPULEASE_FUZZ_EXAMPLES", "25"))
    statuses: dict[int, int] = {}
    conn = Unix(broker.socket)

    def exercise(op: Any) -> None:
        @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy(generation_mode=GenerationMode.POSITIVE), at=st.integers(0, 1 << 16),
               poison=st.sampled_from(POISON))
        def run(case: Any, at: int, poison: str) -> None:
            _short_waits(case)
            query = f"?{urlencode(case.query, doseq=True)}" if case.query else ""
            conn.request(op.method.upper(), case.formatted_path + query, body=poisoned(case.body, at, poison),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            raw = resp.read()
            statuses[resp.status] = statuses.get(resp.status, 0) + 1
            assert resp.status < 500, (op.method, op.path, poison[:20], resp.status, raw[:300])
            check_answer(op.method, op.path, resp.status, resp.headers, raw)

        run()

    ran = 0
    for result in schema.get_all_operations():
        op = result.ok()
        if SPEC["paths"][op.path][op.method.lower()].get("requestBody"):
            exercise(op)
            ran += 1
    assert ran >= 9 and statuses.get(400, 0) >= ran * examples // 2, statuses
