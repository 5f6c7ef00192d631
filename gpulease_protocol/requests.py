"""The syntax of a lease request: GPU counts, ranges and fractions, durations and memory sizes.

One set of rules for both sides: the broker parses request bodies with these functions, and the
notebook side (``%%gpu``, the Python API) checks what a user typed with the same ones before it asks,
so the two accept exactly the same values (``tests/protocol/test_request_syntax.py`` checks it against a real
broker). Each function takes a JSON value (a number or a string) and raises ``RequestSyntaxError``, a
``ValueError`` quoting the bad value and naming the fix.
"""

from __future__ import annotations

import re
from typing import Any

#: More GPUs than this in one request is refused: no inventory holds that many.
MAX_GPUS = 4096
MAX_SECONDS = 10 * 365 * 86400

_PART = r"(\d+(?:\.\d+)?)\s*(ms|s|min|m|h|d)"  # "min" before "m", "ms" before "m" and "s"
#: A number of seconds ("90"), or parts with units ("30m", "1h30m", "1h 30m", "2d12h").
_DURATION_RE = re.compile(rf"\s*(?:\d+(?:\.\d+)?|(?:{_PART}\s*)+)\s*", re.IGNORECASE)
_UNITS = {"s": 1.0, "ms": 0.001, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_GPUS_HINT = "give a count like 2, a range like '1-4' or a fraction like 0.25"
_GPU_TYPE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9 ._-]{0,63}$")


class RequestSyntaxError(ValueError):
    """A request value that does not parse; the message quotes it and says what to give instead."""


def quoted(value: Any) -> str:
    """A value as an error quotes it: a number of 4,000 digits by its first digits and its length."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}…({len(text)} characters)"


def parse_duration(value: Any, what: str = "duration") -> float:
    """Seconds from ``90``, ``"90s"``, ``"30m"``, ``"2h"``, ``"1d"``, ``"1h30m"`` (0 means the policy's default)."""
    if isinstance(value, bool):
        raise RequestSyntaxError(f"Invalid {what} {value!r}: give seconds or a string like '30m'")
    if isinstance(value, (int, float)):
        seconds = float(value) if not isinstance(value, int) or abs(value) < MAX_SECONDS else float(MAX_SECONDS)
    elif isinstance(value, str) and _DURATION_RE.fullmatch(value):
        parts = re.findall(_PART, value, re.IGNORECASE) or [(value, "s")]
        seconds = sum(float(n) * _UNITS[unit.lower()] for n, unit in parts)
    else:
        raise RequestSyntaxError(f"Invalid {what} {value!r}: give seconds or a string like '30m', '2h' or '1h30m'")
    if not (0 <= seconds < MAX_SECONDS) or seconds != seconds:
        raise RequestSyntaxError(f"Invalid {what} {quoted(value)}: must be between 0 and 10 years")
    return seconds


def parse_size(value: Any, what: str = "size") -> int:
    """Bytes from ``1024``, ``"16G"``, ``"512MiB"``, ``"1.5G"`` (binary units; 0 means none)."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62:
        return value
    if isinstance(value, str) and (m := _SIZE_RE.match(value)):
        size = float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "b").lower()[0]]
        if size < 1 << 62:  # also refuses inf (a 400-digit number)
            return int(size)
    raise RequestSyntaxError(f"Invalid {what} {value!r}: give bytes or a string like '16G'")


def format_size(n: float) -> str:
    """Bytes in binary units, the one way every client writes a size: ``"0 B"``, ``"512 B"``, ``"1.5 KiB"``,
    ``"40.0 GiB"`` (one decimal from KiB up; ``parse_size`` reads each back)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def parse_gpu_type(value: Any, what: str = "gpu_type") -> str:
    """A GPU type as a request names it: a model (``H100``), a configured type (``A100-40GB``), a MIG profile
    (``1g.10gb``) or a device name (``NVIDIA H100 80GB HBM3``); ``""`` means any."""
    if value is None:
        return ""
    if isinstance(value, str) and (not value.strip() or _GPU_TYPE_RE.match(value.strip())):
        return value.strip()
    raise RequestSyntaxError(f"Invalid {what} {value!r}: give a GPU model or MIG profile like 'H100' or '1g.10gb' "
                             "(letters, digits, space, '.', '_', '-', at most 64)")


def parse_gpus(value: Any) -> tuple[int, int, float]:
    """``(min, max, fraction)`` from a count (``2``, ``"2"``, ``2.0``, ``"1.0"``), a range (``"1-4"``)
    or a fraction of one shared GPU (``0.25``, ``"0.25"``, ``".5"``)."""
    given = value
    if isinstance(value, bool):
        raise RequestSyntaxError(f"Invalid gpus {value!r}: {_GPUS_HINT}")
    if isinstance(value, str):
        text = value.strip()
        if re.fullmatch(r"\d+\s*-\s*\d+", text):
            lo, hi = (int(x) for x in text.split("-"))
            if lo < 1 or hi < lo:
                raise RequestSyntaxError(f"Invalid gpus range {value!r}: need 1 <= min <= max")
            return _capped(lo, hi, value)
        try:
            value = float(text) if "." in text else int(text)
        except ValueError:
            raise RequestSyntaxError(f"Invalid gpus {value!r}: {_GPUS_HINT}") from None
    if isinstance(value, float) and not value.is_integer():
        if not 0 < value < 1:
            raise RequestSyntaxError(f"Invalid gpus {given!r}: a fraction must be between 0 and 1")
        return 1, 1, value
    if isinstance(value, (int, float)):
        n = int(value)
        if n < 1:
            got = f" (got {given!r})" if isinstance(given, str) else ""
            raise RequestSyntaxError(f"Invalid gpus {value!r}: ask for at least 1{got}")
        return _capped(n, n, given)
    raise RequestSyntaxError(f"Invalid gpus {value!r}: {_GPUS_HINT}")


def _capped(lo: int, hi: int, given: Any) -> tuple[int, int, float]:
    if lo > MAX_GPUS:
        raise RequestSyntaxError(f"Invalid gpus {given!r}: more than any inventory holds ({MAX_GPUS} at most)")
    return lo, hi, 1.0


def gpus_value(value: Any) -> int | float | str:
    """The request body's ``gpus`` for what a user gave: ``2``, ``"1-4"`` or ``0.25`` (validated)."""
    lo, hi, fraction = parse_gpus(value)
    if fraction < 1:
        return fraction
    return lo if lo == hi else f"{lo}-{hi}"


def request_fields(gpus: Any = 1, *, mem: Any = None, time: Any = None, idle: Any = None, gpu_type: Any = None,
                   gpu_mem: Any = None, flag: str = "", ends_with_caller: bool = False,
                   grow: bool = False) -> dict[str, Any]:
    """The request body's fields for what a user gave (``%%gpu 2 --time 30m --gpu-type H100``,
    ``lease(2, time="30m", gpu_type="H100")``).

    ``None`` leaves a field out (the broker's policy decides). A ``mem`` of 0 is refused: the body's 0 means
    "none asked", so a user who typed it meant something else. ``flag`` prefixes the option names in error
    messages (``"--"`` for a command line).

    ``ends_with_caller``: the lease ends as soon as the process that asks for it exits (a kernel's leases: the
    broker watches the caller's pid, seen through the socket, never one the body names); left out (false), the
    lease lasts until it is released or its heartbeats stop (the CLI, the sidebar). ``grow``: a range (``1-4``)
    grows toward its maximum while held, for code that takes added GPUs (the Python API's ``lease`` and
    ``map``); left out (false), it gets what is free up to its maximum at its grant and keeps that (a cell's
    process sees only the GPUs it started with).
    """
    fields: dict[str, Any] = {"gpus": gpus_value(gpus)}
    if ends_with_caller:
        fields["ends_with_caller"] = True
    if grow:
        fields["grow"] = True
    if mem is not None:
        fields["mem"] = parse_size(mem, f"{flag}mem")
        if not fields["mem"]:  # in a request body 0 means "no memory asked"; given by a user, it is a mistake
            raise RequestSyntaxError(f"Invalid {flag}mem {mem!r}: give the memory wanted on a shared GPU, like "
                                     "'10G', or leave it out")
    if gpu_type is not None:
        fields["gpu_type"] = parse_gpu_type(gpu_type, f"{flag}gpu{'-' if flag else '_'}type")
    if gpu_mem is not None:
        fields["gpu_mem"] = parse_size(gpu_mem, f"{flag}gpu{'-' if flag else '_'}mem")
        if not fields["gpu_mem"]:
            raise RequestSyntaxError(f"Invalid {flag}gpu{'-' if flag else '_'}mem {gpu_mem!r}: give the memory "
                                     "each GPU must have at least, like '40G', or leave it out")
    if time is not None:
        fields["duration_seconds"] = parse_duration(time, f"{flag}time")
    if idle is not None:
        fields["idle_timeout_seconds"] = parse_duration(idle, f"{flag}idle")
    return fields
