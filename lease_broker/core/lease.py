"""The lease: its states, the one table of allowed transitions, and the request it answers."""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import re
from collections.abc import Callable
from typing import Any, TypeVar

from gpulease_protocol import requests

from .errors import BadRequest, InvalidTransition
from .lease_use import NO_USE, LeaseUse


class LeaseState(str, enum.Enum):
    QUEUED = "queued"
    GRANTED = "granted"
    ACTIVE = "active"
    IDLE = "idle"
    RELEASED = "released"
    REVOKED = "revoked"
    EXPIRED = "expired"
    FAILED = "failed"
    CANCELLED = "cancelled"
    SUSPENDED = "suspended"  # its processes are suspended (GPU state in host memory); it holds no GPU

    @property
    def terminal(self) -> bool:
        return self in TERMINAL

    @property
    def holding(self) -> bool:
        """True while the lease holds devices."""
        return self in HOLDING


Q, G, A, IDLE = LeaseState.QUEUED, LeaseState.GRANTED, LeaseState.ACTIVE, LeaseState.IDLE
S = LeaseState.SUSPENDED
ENDINGS = (LeaseState.RELEASED, LeaseState.REVOKED, LeaseState.EXPIRED, LeaseState.FAILED)

#: The one table of allowed transitions. A holding lease may be suspended (its holder reported its processes
#: suspended: ``Lease.suspension``); a suspended one is granted again (resumed, on GPUs of the model it left) or ends.
TRANSITIONS: dict[LeaseState, frozenset[LeaseState]] = {
    Q: frozenset({G, LeaseState.CANCELLED, LeaseState.FAILED}),
    G: frozenset({A, IDLE, S, *ENDINGS}),
    A: frozenset({IDLE, S, *ENDINGS}),
    IDLE: frozenset({A, S, *ENDINGS}),
    S: frozenset({G, *ENDINGS}),
    **{s: frozenset() for s in (*ENDINGS, LeaseState.CANCELLED)},
}
TERMINAL = frozenset(s for s, nxt in TRANSITIONS.items() if not nxt)
HOLDING = frozenset({G, A, IDLE})


def check_transition(lease_id: str, current: LeaseState, target: LeaseState) -> None:
    if target not in TRANSITIONS[current]:
        raise InvalidTransition(
            f"Lease {lease_id} is {current.value}; it cannot become {target.value}",
            extra={"state": current.value},
        )


def _syntax(fn: Callable[..., _T]) -> Callable[..., _T]:
    """The shared request syntax (``gpulease_protocol.requests``), its errors as 400 answers."""

    @functools.wraps(fn)
    def parse(*args: Any) -> _T:
        try:
            return fn(*args)
        except requests.RequestSyntaxError as e:
            raise BadRequest(str(e)) from None

    return parse


_T = TypeVar("_T")
parse_duration = _syntax(requests.parse_duration)
parse_size = _syntax(requests.parse_size)
_parse_gpus = _syntax(requests.parse_gpus)
_parse_gpu_type = _syntax(requests.parse_gpu_type)


@dataclasses.dataclass(frozen=True)
class LeaseRequest:
    """What a client asks for; validated and capped by policy before it is queued."""

    min_gpus: int = 1
    max_gpus: int = 1
    fraction: float = 1.0  # < 1: a share of one GPU
    mem_bytes: int = 0  # > 0: memory wanted on a shared GPU
    duration_seconds: float = 0.0  # 0 = policy default
    idle_timeout_seconds: float = 0.0  # 0 = policy default
    priority: str = "normal"
    locality: str = "node"  # "node": all GPUs on one node; "any": may span nodes
    labels: dict[str, str] = dataclasses.field(default_factory=dict)
    heartbeat: bool = True  # False: no holder heartbeats (CLI leases); time limit and idleness still apply
    gpu_type: str = ""  # "": any; else a model, configured type or MIG profile (core.gpufit)
    gpu_mem: int = 0  # > 0: each device has at least this many bytes of memory
    ends_with_caller: bool = False  # the calling process is the lease's holder: it ends when that process exits
    grow: bool = False  # a range (1-4) grows while it holds (code that takes added GPUs); else it keeps its grant
    suspendable: bool = False  # its holder suspends its processes when asked and reports it (``Suspension``)

    @property
    def shared(self) -> bool:
        return self.fraction < 1.0 or self.mem_bytes > 0

    def to_json(self) -> dict[str, Any]:
        d = dict(self.__dict__)  # the fields (dataclasses.asdict copies recursively: ~10x slower)
        d.pop("_json", None)
        d["labels"] = dict(self.labels)
        return d

    def json_text(self) -> str:
        """to_json() as compact JSON text, made once (the request is frozen): the store writes it at every
        transition."""
        text: str | None = self.__dict__.get("_json")
        if text is None:
            text = json.dumps(self.to_json(), separators=(",", ":"))
            object.__setattr__(self, "_json", text)
        return text


MAX_LABEL_LEN = 1024
MAX_LABELS = 32


def parse_request(data: Any) -> LeaseRequest:
    """Validate a request body; every error quotes the bad value."""
    if not isinstance(data, dict):
        raise BadRequest(f"Request body must be a JSON object, not {type(data).__name__}")
    known = {f.name for f in dataclasses.fields(LeaseRequest)} | {"gpus", "mem", "wait_seconds"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise BadRequest(f"Unknown request field(s): {', '.join(map(repr, unknown))}")
    if "gpus" in data:
        lo, hi, frac = _parse_gpus(data["gpus"])
    else:
        lo, hi, frac = (
            _int(data.get("min_gpus", 1), "min_gpus"),
            _int(data.get("max_gpus", data.get("min_gpus", 1)), "max_gpus"),
            data.get("fraction", 1.0),
        )
        if isinstance(frac, bool) or not isinstance(frac, (int, float)):
            raise BadRequest(f"Invalid fraction {frac!r}: must be a number in (0, 1]")
        frac = float(frac)
        if lo < 1 or hi < lo:
            raise BadRequest(f"Invalid gpus range {lo!r}-{hi!r}: need 1 <= min_gpus <= max_gpus")
        if not 0 < frac <= 1:
            raise BadRequest(f"Invalid fraction {frac!r}: must be in (0, 1]")
    if lo > requests.MAX_GPUS:
        raise BadRequest(f"Invalid gpus {lo!r}: more than any inventory holds ({requests.MAX_GPUS} at most)")
    mem = parse_size(data.get("mem", data.get("mem_bytes", 0)), "mem")
    labels = data.get("labels", {}) or {}
    if not isinstance(labels, dict) or len(labels) > MAX_LABELS:
        raise BadRequest(f"Invalid labels: give an object of at most {MAX_LABELS} string values")
    clean: dict[str, str] = {}
    for k, v in labels.items():
        if not isinstance(v, (str, int, float)) or len(str(k)) > 128 or len(str(v)) > MAX_LABEL_LEN:
            raise BadRequest(f"Invalid label {str(k)[:40]!r}: values are strings of at most {MAX_LABEL_LEN} characters")
        clean[str(k)] = str(v)
    locality = data.get("locality", "node")
    if locality not in ("node", "any"):
        raise BadRequest(f"Invalid locality {locality!r}: use 'node' or 'any'")
    priority = data.get("priority", "normal")
    if not isinstance(priority, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,32}", priority):
        raise BadRequest(f"Invalid priority {priority!r}")
    heartbeat, ends_with_caller, grow, suspendable = (_bool(data, name, default) for name, default in (
        ("heartbeat", True), ("ends_with_caller", False), ("grow", False), ("suspendable", False)))
    return LeaseRequest(
        heartbeat=heartbeat,
        ends_with_caller=ends_with_caller,
        grow=grow,
        suspendable=suspendable,
        gpu_type=_parse_gpu_type(data.get("gpu_type", "")),
        gpu_mem=parse_size(data.get("gpu_mem", 0), "gpu_mem"),
        min_gpus=lo,
        max_gpus=hi,
        fraction=frac,
        mem_bytes=mem,
        duration_seconds=parse_duration(data.get("duration_seconds", 0), "duration_seconds"),
        idle_timeout_seconds=parse_duration(data.get("idle_timeout_seconds", 0), "idle_timeout_seconds"),
        priority=priority,
        locality=locality,
        labels=clean,
    )


def _bool(data: dict[str, Any], name: str, default: bool) -> bool:
    value = data.get(name, default)
    if not isinstance(value, bool):
        raise BadRequest(f"Invalid {name} {value!r}: must be true or false")
    return value


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"Invalid {what} {value!r}: must be an integer")
    return value


@dataclasses.dataclass(frozen=True)
class Preempting:
    """A warning that a blocked request of a higher class (``by_class``) takes the lease's GPUs at ``deadline``. Kept
    on the lease after it ended, so that its view can say who preempted it."""

    by_lease: str
    by_user: str
    by_class: str
    at: float
    deadline: float

    def text(self) -> str:
        return json.dumps(dataclasses.astuple(self))

    @classmethod
    def parse(cls, text: str) -> Preempting | None:
        return cls(*json.loads(text)) if text else None


#: ``Change(preempting=WITHDRAWN)``: the warning no longer holds (its request was granted elsewhere or left).
WITHDRAWN = Preempting("", "", "", 0.0, 0.0)


@dataclasses.dataclass(frozen=True)
class Suspension:
    """The broker asked the lease's holder to suspend its processes (``since == 0``: asked, the holder reports by
    ``deadline``, else the broker does what it would have done without suspension), or they are suspended
    (``since > 0``: the lease is SUSPENDED and holds no GPU). Cleared when the lease is granted again (resumed).

    ``why``: idle, pressure, expired (a revocation that suspends instead), preempted (a waiting request that may
    suspend others: ``by_lease``/``by_user``), user (the holder suspended of its own accord), admin. ``devices`` and
    ``model``: the GPUs it left, and their model; it resumes on GPUs of that model, its own when free. ``resume``:
    it wants GPUs back now (queued for them before new requests of its class). ``remaining``: the seconds its time
    limit had left when it was suspended. ``how``: what the holder did ("checkpoint": GPU state to host memory and
    SIGSTOP; "stop": SIGSTOP alone, no CUDA state), as it reported."""

    why: str
    asked_at: float
    deadline: float = 0.0
    since: float = 0.0
    by_lease: str = ""
    by_user: str = ""
    devices: tuple[str, ...] = ()
    model: str = ""
    resume: bool = False
    remaining: float = 0.0
    how: str = ""

    @property
    def suspended(self) -> bool:
        return self.since > 0

    def text(self) -> str:
        return json.dumps(dataclasses.astuple(self))

    @classmethod
    def parse(cls, text: str) -> Suspension | None:
        if not text:
            return None
        values = json.loads(text)
        values[6] = tuple(values[6])
        return cls(*values)


#: ``Change(suspension=RESUMED)``: the suspension is over (the lease was granted again, or the ask withdrawn).
RESUMED = Suspension("", 0.0)


@dataclasses.dataclass
class Lease:
    """A lease as the broker holds it in memory (a row of the store)."""

    id: str
    user: str
    uid: int
    request: LeaseRequest
    state: LeaseState
    created_at: float
    seq: int = 0  # arrival order
    reason: str = ""
    devices: list[str] = dataclasses.field(default_factory=list)  # GPU ids (UUIDs)
    node: str = ""
    granted_at: float | None = None
    expires_at: float | None = None
    ended_at: float | None = None
    duration_seconds: float = 0.0
    idle_timeout_seconds: float = 0.0
    last_heartbeat: float = 0.0
    last_activity: float = 0.0
    processes: dict[int, int] = dataclasses.field(default_factory=dict)  # attached: pid -> start ticks
    secret_hash: str = ""
    use: LeaseUse = NO_USE  # what it used (from the inventory's samples while it held GPUs)
    holder: tuple[int, int] | None = None  # (pid, start ticks) of the process it ends with (ends_with_caller)
    preempting: Preempting | None = None  # warned that a higher class takes its GPUs (kept once it ended)
    warned: frozenset[str] = frozenset()  # the warnings its holder got ("idle", "expiry"): each is sent once
    pauses: tuple[float, ...] = ()  # its last idle pauses that ended in activity (``pressure_learns_pauses``)
    suspension: Suspension | None = None  # asked to suspend, or suspended (``LeaseState.SUSPENDED``)
    suspended_seconds: float = 0.0  # time spent suspended in earlier suspensions (the starvation bound; not charged)
    suspensions: int = 0  # how many times it was suspended

    @property
    def pids(self) -> list[int]:
        return list(self.processes)

    @property
    def gpu_count(self) -> float:
        if self.request.shared:
            return self.request.fraction if self.request.fraction < 1 else 1.0
        return float(len(self.devices) or self.request.min_gpus)


#: Fields of a lease that only the broker's memory keeps between transitions (not written on their own).
_SOFT = ("last_activity", "last_heartbeat", "use", "warned", "pauses")


@dataclasses.dataclass(frozen=True)
class Change:
    """One change of a lease: a new state (with its reason), new field values, or both. The lease's owner
    applies every change through one path (``LeaseManager.commit``); ``None`` leaves a field as it is.

    ``event`` names the published change when the state stays (``renewed``, ``grown``, ``placed``, ``retimed``); a
    change of state publishes the new state. ``holder`` (pid, start ticks) is the process the lease ends with (set
    with its request, ``ends_with_caller``). ``attach`` adds a process (pid, start ticks) to the lease. ``shift``
    moves every time of the lease (``TIMES``) by that many seconds: the wall clock stepped (``LeaseManager.retime``),
    and the lease keeps its remaining time.
    """

    state: LeaseState | None = None
    reason: str | None = None
    devices: tuple[str, ...] | None = None
    node: str | None = None
    granted_at: float | None = None
    expires_at: float | None = None
    duration_seconds: float | None = None
    last_activity: float | None = None
    last_heartbeat: float | None = None
    use: LeaseUse | None = None
    holder: tuple[int, int] | None = None
    preempting: Preempting | None = None
    warned: frozenset[str] | None = None
    pauses: tuple[float, ...] | None = None
    processes: dict[int, int] | None = None
    suspension: Suspension | None = None
    suspended_seconds: float | None = None
    suspensions: int | None = None
    attach: tuple[int, int] | None = None
    shift: float = 0.0
    event: str = ""

    @property
    def stored(self) -> bool:
        """Whether the store must write the lease's row (anything beyond activity, heartbeat times and usage):
        known from the construction (``_change_init``)."""
        stored: bool = self.__dict__["_stored"]
        return stored

    @property
    def moves(self) -> bool:
        """Whether the GPU table must see the lease again (its state, devices, times or time limit changed)."""
        return self.state is not None or self.devices is not None or self.expires_at is not None or bool(self.shift)

    def apply(self, lease: Lease, now: float) -> None:
        """Write the change into the lease (the owner checks the transition and persists it)."""
        values = self.__dict__
        for name in values["_given"]:  # (the fields it sets: ``_change_init``)
            value = values[name]
            setattr(lease, name, list(value) if name == "devices" else value)
        if self.preempting is WITHDRAWN:
            lease.preempting = None
        if self.suspension is RESUMED:
            lease.suspension = None
        if self.shift:
            for name in TIMES:
                value = getattr(lease, name)
                if value is not None:
                    setattr(lease, name, value + self.shift)
            if lease.preempting is not None and lease.state in HOLDING:  # its grace keeps the time it had left
                lease.preempting = dataclasses.replace(lease.preempting, deadline=lease.preempting.deadline + self.shift)
        if self.state is not None and self.state.terminal:
            lease.ended_at = now
        if self.attach is not None and lease.processes.get(self.attach[0]) != self.attach[1]:
            lease.processes = {**lease.processes, self.attach[0]: self.attach[1]}


_FIELDS = tuple(f for f in dataclasses.fields(Change) if f.name not in ("attach", "shift", "event"))
#: The names of ``_FIELDS`` (and those the store writes): ``Change.apply`` and ``stored`` read them from the change's
#: ``__dict__``, as every change of activity costs a commit: with getattr per field they were 2.95 s of 34.5 s
#: profiled on the 3,000-job overloaded replay (benchmarks/replay_month.py), 14.5 us a commit; now 8.7 us.
_NAMES = tuple(f.name for f in _FIELDS)
_HARD = tuple(name for name in _NAMES if name not in _SOFT)
_HARD_SET, _NAMES_SET = frozenset(_HARD), frozenset(_NAMES)
_ORDER = tuple(f.name for f in dataclasses.fields(Change))
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Change)}


def _change_init(self: Change, *args: Any, **values: Any) -> None:
    """``Change``'s constructor (the dataclass's signature, checked as usual): it writes the fields into the frozen
    change's ``__dict__`` at once, and notes which fields it sets (``_given``: what ``apply`` writes) and whether the
    store must write the lease's row (``_stored``), once, where the dataclass's frozen ``__init__`` calls
    ``object.__setattr__`` per field (21) and ``apply`` and ``stored`` tested every field again. Every activity report
    is a Change (1.03 M on the overloaded month replay, benchmarks/replay_month.py): on that replay's state after
    6,000 events of its 3,000-job version, construction 3.2 -> 1.5 us of CPU, ``stored`` 1.2 -> 0.1 us, ``apply`` of
    one field 0.7 -> 0.3 us (the best of 7 runs each, the same sitting)."""
    if args:
        if len(args) > len(_ORDER):
            raise TypeError(f"Change() takes at most {len(_ORDER)} positional arguments ({len(args)} given)")
        twice = values.keys() & _ORDER[:len(args)]
        if twice:
            raise TypeError(f"Change() got multiple values for {', '.join(sorted(twice))}")
        values.update(zip(_ORDER[:len(args)], args, strict=True))
    d = self.__dict__
    d.update(_DEFAULTS)
    d.update(values)
    if len(d) != len(_DEFAULTS):
        unknown = sorted(values.keys() - _DEFAULTS.keys())
        d.clear()
        raise TypeError(f"Change() got unexpected keyword argument(s): {', '.join(unknown)}")
    d["_given"] = given = [k for k, v in values.items() if v is not None and k in _NAMES_SET]
    d["_stored"] = bool(d["shift"]) or not _HARD_SET.isdisjoint(given)


Change.__init__ = _change_init  # type: ignore[method-assign]
#: The times a live lease keeps (wall-clock seconds): what ``Change.shift`` moves.
TIMES = ("created_at", "granted_at", "expires_at", "last_heartbeat", "last_activity")


def reason_slug(reason: str, default: str) -> str:
    """A caller's free-text reason, made safe to store and log (at most 200 plain characters)."""
    text = "".join(c if c.isalnum() or c in "-_: " else "_" for c in (reason or default))[:200].strip()
    return text or default


def describe_request(req: LeaseRequest) -> str:
    """'2', '1-4', '1-4 growing', '0.25 (shared)' or '0.5 mem=…', with ' type=H100 gpu_mem=…' when asked, for
    logs."""
    if req.shared:
        text = f"{req.fraction:g} (shared)" if not req.mem_bytes else f"{req.fraction:g} mem={req.mem_bytes}"
    else:
        text = str(req.min_gpus) if req.min_gpus == req.max_gpus else f"{req.min_gpus}-{req.max_gpus}" + (
            " growing" if req.grow else "")
    return text + (f" type={req.gpu_type}" if req.gpu_type else "") + (f" gpu_mem={req.gpu_mem}" if req.gpu_mem else "")


def renewal_seconds(lease: Lease, duration: Any, extend: Any, now: float) -> float:
    """The seconds from ``now`` a renewal asks for: ``duration`` (default: the lease's own), or ``extend`` past the
    current end (a queued lease: past its time limit), so "+15 min" means the same however late it arrives."""
    if extend is not None:
        base = lease.expires_at - now if lease.expires_at is not None else lease.duration_seconds
        return max(0.0, base) + parse_duration(extend, "extend_seconds")
    return parse_duration(duration, "duration_seconds") if duration is not None else lease.duration_seconds
