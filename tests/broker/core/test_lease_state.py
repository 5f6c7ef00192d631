"""The lease state machine: one table of transitions, checked exhaustively."""

import pytest

from lease_broker.core.errors import BadRequest, InvalidTransition
from lease_broker.core.lease import (
    HOLDING,
    TERMINAL,
    TRANSITIONS,
    LeaseState,
    check_transition,
    parse_duration,
    parse_request,
    parse_size,
)

S = LeaseState
ALLOWED = {
    (S.QUEUED, S.GRANTED), (S.QUEUED, S.CANCELLED), (S.QUEUED, S.FAILED),
    (S.GRANTED, S.ACTIVE), (S.GRANTED, S.IDLE),
    (S.ACTIVE, S.IDLE), (S.IDLE, S.ACTIVE),
}
for _s in (S.GRANTED, S.ACTIVE, S.IDLE):
    for _end in (S.RELEASED, S.REVOKED, S.EXPIRED, S.FAILED):
        ALLOWED.add((_s, _end))
    ALLOWED.add((_s, S.SUSPENDED))  # its holder reported its processes suspended
ALLOWED.add((S.SUSPENDED, S.GRANTED))  # resumed
for _end in (S.RELEASED, S.REVOKED, S.EXPIRED, S.FAILED):
    ALLOWED.add((S.SUSPENDED, _end))


@pytest.mark.parametrize("a", list(S))
@pytest.mark.parametrize("b", list(S))
def test_transition_table(a, b):
    if (a, b) in ALLOWED:
        check_transition("l-1", a, b)
    else:
        with pytest.raises(InvalidTransition) as e:
            check_transition("l-1", a, b)
        assert e.value.status_code == 409 and a.value in e.value.message


def test_terminal_and_holding_sets():
    assert TERMINAL == {S.RELEASED, S.REVOKED, S.EXPIRED, S.FAILED, S.CANCELLED}
    assert HOLDING == {S.GRANTED, S.ACTIVE, S.IDLE}  # a suspended lease holds no GPU
    assert not S.SUSPENDED.terminal and not S.SUSPENDED.holding
    assert all(not TRANSITIONS[s] for s in TERMINAL)


@pytest.mark.parametrize(
    "value,seconds", [(90, 90.0), ("90", 90.0), ("90s", 90.0), ("30m", 1800.0), ("2h", 7200.0), ("1.5h", 5400.0),
                      ("250ms", 0.25), ("1d", 86400.0)]
)
def test_parse_duration(value, seconds):
    assert parse_duration(value) == seconds


@pytest.mark.parametrize("value", ["soon", "-5m", -1, True, None, "1e999", [], "5 parsecs"])
def test_parse_duration_rejects_and_quotes(value):
    with pytest.raises(BadRequest) as e:
        parse_duration(value, "duration_seconds")
    assert repr(value) in e.value.message


@pytest.mark.parametrize("value,size", [(1024, 1024), ("16G", 16 << 30), ("512MiB", 512 << 20), ("1.5k", 1536)])
def test_parse_size(value, size):
    assert parse_size(value) == size


@pytest.mark.parametrize(
    "body,expect",
    [
        ({"gpus": 2}, (2, 2, 1.0)),
        ({"gpus": "1-4"}, (1, 4, 1.0)),
        ({"gpus": 0.25}, (1, 1, 0.25)),
        ({"gpus": "0.5"}, (1, 1, 0.5)),
        ({}, (1, 1, 1.0)),
        ({"min_gpus": 2, "max_gpus": 3}, (2, 3, 1.0)),
    ],
)
def test_parse_request_gpus(body, expect):
    r = parse_request(body)
    assert (r.min_gpus, r.max_gpus, r.fraction) == expect


@pytest.mark.parametrize(
    "body,quoted",
    [
        ({"gpus": 0}, "0"),
        ({"gpus": -3}, "-3"),
        ({"gpus": "4-1"}, "'4-1'"),
        ({"gpus": 1.5}, "1.5"),
        ({"gpus": "lots"}, "'lots'"),
        ({"gpus": True}, "True"),
        ({"gpus": 10**9}, "1000000000"),
        ({"gpus": 1, "locality": "moon"}, "'moon'"),
        ({"gpus": 1, "bogus": 1}, "'bogus'"),
        ({"gpus": 1, "labels": {"k": "x" * 5000}}, "'k'"),
        ({"gpus": 1, "heartbeat": "yes"}, "'yes'"),
        ({"gpus": 1, "mem": "lots"}, "'lots'"),
    ],
)
def test_parse_request_errors_quote_the_value(body, quoted):
    with pytest.raises(BadRequest) as e:
        parse_request(body)
    assert quoted in e.value.message and e.value.status_code == 400


def test_parse_request_rejects_non_objects():
    with pytest.raises(BadRequest):
        parse_request([1, 2])


def test_suspendable_is_a_request_field():
    assert parse_request({"gpus": 1, "suspendable": True}).suspendable
    assert not parse_request({"gpus": 1}).suspendable
    with pytest.raises(BadRequest) as e:
        parse_request({"gpus": 1, "suspendable": "yes"})
    assert "suspendable" in e.value.message
