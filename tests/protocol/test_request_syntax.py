"""One contract for request syntax: the notebook side accepts exactly what the broker accepts.

Every case goes both ways: through ``gpulease_protocol`` (what ``%%gpu`` and the Python API check before
they ask) and, as the user typed it, in a request body to a real broker over its Unix socket. The broker
must grant or queue what the client accepts, with the same GPUs, and refuse with 400 what it refuses.
Only HTTP and ``gpulease_protocol``: nothing here depends on where the broker keeps its parser.
"""

from __future__ import annotations

from typing import Any

import pytest

from gpulease_protocol.requests import (
    RequestSyntaxError,
    parse_duration,
    parse_gpu_type,
    parse_gpus,
    parse_size,
    request_fields,
)
from jupyter_gpulease.client import BrokerClient, BrokerError

OK, BAD = True, False

GPUS: list[tuple[Any, bool]] = [
    ("1", OK), ("2", OK), (" 2 ", OK), ("1-4", OK), ("2-2", OK), ("0.25", OK), (".5", OK), ("0.5", OK),
    ("1.0", OK), ("2.0", OK), (3, OK), (1.0, OK), (0.75, OK),
    ("0", BAD), ("-1", BAD), ("4-2", BAD), ("0-2", BAD), ("1.5", BAD), ("abc", BAD), ("", BAD), ("1-", BAD),
    ("0.0", BAD), ("4097", BAD), ("4097-5000", BAD), (0, BAD), (-1, BAD), (1.5, BAD), (True, BAD), ("1e3", BAD),
]
DURATIONS: list[tuple[Any, bool]] = [
    ("90", OK), ("30s", OK), ("5m", OK), ("5min", OK), ("2h", OK), ("1d", OK), ("1.5h", OK), ("500ms", OK),
    ("0", OK), (90, OK), (0, OK), (1.5, OK),
    ("-5m", BAD), ("10x", BAD), ("soon", BAD), ("", BAD), ("5 m s", BAD), (-5, BAD), ("99999d", BAD), (True, BAD),
]
SIZES: list[tuple[Any, bool]] = [
    ("512M", OK), ("10G", OK), ("10GiB", OK), ("10gb", OK), ("1.5G", OK), ("0", OK), ("1024", OK), ("64k", OK),
    (0, OK), (1 << 30, OK),
    ("10Q", BAD), ("-1G", BAD), ("lots", BAD), ("", BAD), ("G", BAD), (-1, BAD), (1.5, BAD), (True, BAD),
]

#: GPU types: the syntax (the broker's 4 simulated GPUs are 'Simulated GPU', 80G); None: valid but no such GPU
TYPES: list[tuple[Any, bool | None]] = [
    ("Simulated", OK), ("simulated gpu", OK), (" Simulated GPU ", OK), ("", OK), ("H100", None), ("1g.10gb", None),
    ("NVIDIA H100 80GB HBM3", None), ("-x", BAD), ("a;b", BAD), ("x" * 65, BAD), (5, BAD), (True, BAD), ("H*", BAD),
]
GPU_MEMS: list[tuple[Any, bool | None]] = [("40G", OK), ("80G", OK), (1 << 30, OK), ("81G", None), ("lots", BAD),
                                           (-1, BAD)]


def accepted_by_client(parse: Any, value: Any) -> bool:
    try:
        parse(value)
    except RequestSyntaxError as e:
        assert repr(value) in str(e) or str(value).strip() in str(e), (value, str(e))  # the message quotes it
        return False
    return True


def accepted_by_broker(client: BrokerClient, body: dict[str, Any]) -> dict[str, Any] | None:
    try:
        lease = client.request_lease(heartbeat=False, **body)
    except BrokerError as e:
        assert e.status == 400, (body, e.status, e.message)
        return None
    client.release(lease["id"])
    return lease


@pytest.mark.parametrize("value, valid", GPUS, ids=repr)
def test_gpus(client: BrokerClient, value: Any, valid: bool) -> None:
    assert accepted_by_client(parse_gpus, value) is valid
    lease = accepted_by_broker(client, {"gpus": value})
    assert (lease is not None) is valid, value
    if lease is not None:
        want = parse_gpus(value)
        assert (lease["min_gpus"], lease["max_gpus"], lease["fraction"]) == want
        # what the client sends for it asks for the same
        again = accepted_by_broker(client, request_fields(value))
        assert again is not None and (again["min_gpus"], again["max_gpus"], again["fraction"]) == want


@pytest.mark.parametrize("value, valid", DURATIONS, ids=repr)
def test_durations(client: BrokerClient, value: Any, valid: bool) -> None:
    assert accepted_by_client(lambda v: parse_duration(v, "time"), value) is valid
    assert (accepted_by_broker(client, {"gpus": 1, "duration_seconds": value}) is not None) is valid, value
    assert (accepted_by_broker(client, {"gpus": 1, "idle_timeout_seconds": value}) is not None) is valid, value
    if valid:
        assert accepted_by_broker(client, request_fields(1, time=value, idle=value)) is not None


@pytest.mark.parametrize("value, valid", SIZES, ids=repr)
def test_sizes(client: BrokerClient, value: Any, valid: bool) -> None:
    assert accepted_by_client(lambda v: parse_size(v, "mem"), value) is valid
    lease = accepted_by_broker(client, {"gpus": 0.5, "mem": value})
    assert (lease is not None) is valid, value
    if lease is not None:
        assert lease["mem_bytes"] == parse_size(value)
        if lease["mem_bytes"]:  # a user's --mem 0 is refused by the client: in a body, 0 means "none asked"
            again = accepted_by_broker(client, request_fields(0.5, mem=value))
            assert again is not None and again["mem_bytes"] == lease["mem_bytes"]
        else:
            with pytest.raises(RequestSyntaxError, match=repr(value)):
                request_fields(0.5, mem=value)


@pytest.mark.parametrize("value, valid", TYPES, ids=repr)
def test_gpu_types(client: BrokerClient, value: Any, valid: bool | None) -> None:
    assert accepted_by_client(parse_gpu_type, value) is (valid is not BAD)
    try:
        lease = client.request_lease(1, heartbeat=False, gpu_type=value)
    except BrokerError as e:
        assert e.status == 400 and valid is not OK, (value, e.message)
        if valid is None:  # well formed, but no GPU of it here: the answer names what there is
            assert e.reason == "no_such_gpu" and "4x Simulated GPU (80G)" in e.message, e.message
        else:
            assert e.reason != "no_such_gpu" and repr(value) in e.message, e.message
        return
    client.release(lease["id"])
    assert valid is OK and lease["gpu_type"] == parse_gpu_type(value)
    again = accepted_by_broker(client, request_fields(1, gpu_type=value))
    assert again is not None and again["gpu_type"] == lease["gpu_type"]


@pytest.mark.parametrize("value, valid", GPU_MEMS, ids=repr)
def test_gpu_mem(client: BrokerClient, value: Any, valid: bool | None) -> None:
    assert accepted_by_client(lambda v: parse_size(v, "gpu_mem"), value) is (valid is not BAD)
    try:
        lease = client.request_lease(1, heartbeat=False, gpu_mem=value)
    except BrokerError as e:
        assert e.status == 400 and valid is not OK, (value, e.message)
        assert (e.reason == "no_such_gpu") is (valid is None), e.message
        return
    client.release(lease["id"])
    assert valid is OK and lease["gpu_mem"] == parse_size(value)
    again = accepted_by_broker(client, request_fields(1, gpu_mem=value))
    assert again is not None and again["gpu_mem"] == lease["gpu_mem"]
