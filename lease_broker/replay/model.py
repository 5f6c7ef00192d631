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


#: ``progress(mode, done, total)``: called now and then during a replay (work items done of the total).
Progress = Callable[[str, int, int], None]
