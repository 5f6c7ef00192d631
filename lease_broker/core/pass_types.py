"""What a scheduling pass takes and gives: the queued requests, the policy, the grants and the plan."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

from .gpufit import Aliases
from .lease import Lease, LeaseRequest


@dataclasses.dataclass(frozen=True)
class Pending:
    lease_id: str
    user: str
    request: LeaseRequest
    seq: int
    duration: float  # effective lease duration (policy applied)
    queued_at: float = 0.0  # when it was requested (small_first_timeout counts from here)
    prefer: tuple[str, ...] = ()  # the GPUs its notebook's lease just gave back: taken again if still free
    resuming: bool = False  # a suspended lease that wants GPUs back: queued before new requests of its class

    @classmethod
    def of(cls, lease: Lease, prefer: tuple[str, ...] = ()) -> Pending:
        """A queued lease as a pass sees it (``prefer``: see ``manager.planning.WarmRegrants``)."""
        return cls(lease.id, lease.user, lease.request, lease.seq, lease.duration_seconds, lease.created_at, prefer)


@dataclasses.dataclass(frozen=True)
class Grant:
    lease_id: str
    gpu_ids: tuple[str, ...]
    node: str


@dataclasses.dataclass(frozen=True)
class SchedulerPolicy:
    priority_ranks: Mapping[str, int] = dataclasses.field(
        default_factory=lambda: {"low": 0, "normal": 10, "high": 20}
    )
    user_cap: Callable[[str], float] = lambda user: 0.0  # max GPUs held at once; 0 = unlimited
    capped: bool = True  # whether any user or group may have a cap (False: nobody's is asked)
    max_shares_per_gpu: float = 1.0
    max_leases_per_shared_gpu: int = 4
    backfill_depth: int = 8
    groups_of: Callable[[str], Sequence[str]] = lambda user: ()
    group_cap: Callable[[str], float] = lambda group: 0.0  # GPUs a group's members hold together; 0 = unlimited
    gpu_types: Aliases = ()  # admin-configured GPU type names (gpufit.aliases_of)
    type_caps: Callable[[str], Mapping[str, float]] = lambda user: {}  # GPUs of a type a user may hold at once
    small_first_gpus: int = 0  # requests of at most this many GPUs go before bigger ones of their class; 0 = off
    small_first_timeout: float = 3600.0  # ...until the bigger one has waited this long (seconds): then it keeps its place


@dataclasses.dataclass(frozen=True)
class Growing:
    """A holding incremental lease (min_gpus < max_gpus) that may grow toward max_gpus until ``end``."""

    pending: Pending  # its user, request and arrival; ``duration``: GPU-seconds charged per added GPU
    devices: tuple[str, ...]
    end: float


@dataclasses.dataclass(frozen=True)
class Reservation:
    """Where and when a blocked request is planned to start: these GPUs are held for it from ``start`` to ``end``
    (later requests may use them only if they end first). A pass hands its reservations to the next event passes,
    which keep them while they still hold instead of planning again (``schedule(plan=...)``)."""

    start: float
    gpu_ids: tuple[str, ...]
    end: float


@dataclasses.dataclass
class Decision:
    grants: list[Grant] = dataclasses.field(default_factory=list)
    planned_start: dict[str, float] = dataclasses.field(default_factory=dict)  # lease id -> estimate
    reserved: dict[str, str] = dataclasses.field(default_factory=dict)  # GPU id -> advance reservation id
    grown: list[Grant] = dataclasses.field(default_factory=list)  # GPUs added to holding incremental leases
    plan: dict[str, Reservation] = dataclasses.field(default_factory=dict)  # blocked lease id -> its reservation
    waiting: dict[str, str] = dataclasses.field(default_factory=dict)  # lease id the pass looked at -> WAIT slug


#: Why a request the pass looked at was not granted (``Decision.waiting``), most specific first: the user's (or a
#: group's) GPUs at once, the daily GPU-hours, a gang no node has room for now, no free GPU of the type or size it
#: asks for, GPUs held for an advance reservation, behind a higher class, behind users who used less (fair share),
#: behind earlier requests, or simply every GPU it could use is held.
WAIT_REASONS = ("quota", "budget", "whole_node", "no_gpu_type", "reservation", "priority", "fair_share", "queue",
                "gpus_busy")
