"""The replay's records: the replayed cluster, what each GPU burst experienced, and one run's outcomes and
integrals over time."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

from ..core.lease import Lease
from ..inventory.simulated import SimulatedInventory, parse_cluster


@dataclasses.dataclass(frozen=True)
class Cluster:
    """The replayed cluster: ``nodes`` of ``gpus_per_node``, or mixed groups (``spec``, as
    ``SimulatedInventory.cluster`` reads it: ``2x8:A100-40GB,1x8:H100``)."""

    nodes: int
    gpus_per_node: int
    spec: str = ""
    total: int = 0

    def __post_init__(self) -> None:
        if not self.total:
            object.__setattr__(self, "total", self.nodes * self.gpus_per_node)

    @classmethod
    def parse(cls, text: str) -> "Cluster":
        m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
        if m:
            if int(m.group(1)) < 1 or int(m.group(2)) < 1:
                raise ValueError(f"Invalid cluster {text!r}: give NODESxGPUS_PER_NODE, e.g. 8x8")
            return cls(int(m.group(1)), int(m.group(2)))
        groups = parse_cluster(text)  # mixed: 2x8:A100-40GB,1x8:H100
        return cls(sum(n for n, *_ in groups), max(g for _, g, *_ in groups), ",".join(p.strip() for p in text.split(",")),
                   sum(n * g for n, g, *_ in groups))

    def inventory(self) -> SimulatedInventory:
        """The simulated inventory of this cluster's shape."""
        shape: dict[str, Any] = {"cluster": self.spec} if self.spec else {"gpus": self.total, "nodes": self.nodes}
        # no processes run in a replay: nothing to sample
        return SimulatedInventory(**shape, node_name="sim-node-0", link_group_size=0, simulate_usage=False)

    def __str__(self) -> str:
        return self.spec or f"{self.nodes}x{self.gpus_per_node}"


@dataclasses.dataclass
class Outcome:
    """What one GPU burst experienced."""

    owner: str  # user, else session
    gpus: int
    duration: float
    arrival: float  # when the cell asked (trace start, moved by the session's earlier waits)
    wait: float = 0.0  # time to GPU
    warm: bool = False  # ran on a lease the session still held
    regranted: bool = False  # a warm re-grant: a new lease, at once, on the GPUs the session's last one gave back
    first: bool = True  # the session's first GPU burst (no lease to be warm from)
    granted: bool = False
    resumed: bool = False  # ran on its session's suspended lease, resumed (``Suspend``): no variable lost
    suspended: float = 0.0  # seconds it spent suspended while it ran (preemption by suspension)
    suspensions: int = 0  # how many times it was suspended while it ran
    costs: float = 0.0  # suspend and resume seconds it paid while it ran (its end moved by suspended + costs)
    done: bool = False  # it ran to its end


@dataclasses.dataclass
class Told:
    """A request that queued, and the start it was told at once (its view right after the request): the
    estimate users see (``shown``, its ``low``/``high`` range when the broker gave one) and the scheduler's plan
    from the holders' time limits (``planned``), as absolute times; the lease's grant gives the real wait."""

    lease: Lease
    shown: float | None
    low: float | None
    high: float | None
    planned: float | None


@dataclasses.dataclass
class Run:
    """One replay: its outcomes, the leases it made, and integrals over time."""

    mode: str
    cluster: Cluster
    idle_timeout: float
    outcomes: list[Outcome] = dataclasses.field(default_factory=list)
    leases: list[Lease] = dataclasses.field(default_factory=list)
    cpu_bursts: int = 0
    busy_gpu_seconds: float = 0.0
    gang_block_gpu_seconds: float = 0.0
    start: float = 0.0
    end: float = 0.0
    events: int = 0
    wall_seconds: float = 0.0
    renewals_refused: int = 0
    notes: list[str] = dataclasses.field(default_factory=list)
    queue_seconds: dict[int, float] = dataclasses.field(default_factory=dict)  # queue depth -> virtual seconds at it
    queue_max: int = 0
    pass_seconds: list[float] = dataclasses.field(default_factory=list)  # wall time of the passes of each event
    limits: str = "oracle"  # the time limits requests ask for (sim.LIMITS)
    told: list[Told] = dataclasses.field(default_factory=list)  # every request that queued (lease mode)
    suspend: Suspend | None = None  # the holders' suspension model (lease mode), None: not suspendable
    suspended: list[Suspended] = dataclasses.field(default_factory=list)  # every suspension reported
    suspended_held_gpu_s: float = 0.0  # GPU-time held before each suspension (a lease's grant time is its last)


#: Per GiB of a process's GPU footprint, measured through ``jupyter_gpulease/worker/suspend.py`` on an H100 with
#: driver 580 (docs/gpu-checks.md: 5.96 s and 2.22 s for 12.83 GiB); the H200 rerun gave 0.43-0.53 and 0.16-0.20.
SUSPEND_SECONDS_PER_GIB = 0.46
RESUME_SECONDS_PER_GIB = 0.17
GIB_PER_GPU = 16.0  # a burst's GPU-memory footprint per GPU when the trace gives none (gpu_mem_gib)


@dataclasses.dataclass(frozen=True)
class Suspend:
    """How the replay's holders suspend (issue 33): a burst's processes move ``gib_per_gpu`` GiB per GPU (or the
    trace's ``gpu_mem_gib``) to host memory in ``suspend_seconds_per_gib`` per GiB, and back in
    ``resume_seconds_per_gib`` (one process after the other, as ``worker/suspend.py`` does: the cost grows with the
    lease's GPUs). ``suspendable``: whether the holders' requests are suspendable; None: when the policy's
    ``preempt_mode`` is "suspend" (so a replay under another policy makes the decisions it made before)."""

    suspendable: bool | None = None
    suspend_seconds_per_gib: float = SUSPEND_SECONDS_PER_GIB
    resume_seconds_per_gib: float = RESUME_SECONDS_PER_GIB
    gib_per_gpu: float = GIB_PER_GPU

    def __post_init__(self) -> None:
        for name in ("suspend_seconds_per_gib", "resume_seconds_per_gib", "gib_per_gpu"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"Invalid {name}={getattr(self, name)!r}: must be >= 0")

    @property
    def source(self) -> str:
        """Where the costs come from, for the report."""
        if (self.suspend_seconds_per_gib, self.resume_seconds_per_gib) == (SUSPEND_SECONDS_PER_GIB,
                                                                           RESUME_SECONDS_PER_GIB):
            return ("measured on a real GPU (H100, driver 580, CUDA checkpoint through worker/suspend.py: "
                    "docs/gpu-checks.md)")
        return "given"


@dataclasses.dataclass
class Suspended:
    """One suspension the replay's holder reported: the lease's GPUs, why (the broker's ask), when, until when (its
    resume, or its end; None while suspended), whether a burst was running, and the two costs in seconds."""

    lease: str
    gpus: int
    why: str
    since: float
    until: float | None = None
    running: bool = False
    suspend_cost: float = 0.0
    resume_cost: float = 0.0


#: ``progress(mode, done, total)``: called now and then during a replay (work items done of the total).
Progress = Callable[[str, int, int], None]
