"""A simulated GPU inventory for demos and tests: labelled simulated everywhere.

The GPUs do not exist, but everything around them does: leases attach real
processes, activity is the CPU time those processes use, and a GPU drains until
the lease's processes are gone, so the broker runs the same code paths as on a host
with real GPUs.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
import uuid
from collections.abc import Mapping
from typing import Any

from traitlets import Bool, Integer, Unicode, validate

from ..core.gpu import GPU, GpuSample
from ..core.lease import HOLDING, Lease, parse_size
from ..host.procs import tree_usage, uptime_ticks
from ..policy import numbers
from . import Inventory
from .changes import InventoryChange

_CLK_TCK = os.sysconf("SC_CLK_TCK")

_NAMESPACE = uuid.UUID("6b1f9e0c-3f5e-4c27-9c1e-5a0f5e0d1a11")
_NAMESPACE_BYTES = _NAMESPACE.bytes  # a property that builds the bytes at every call


def gpu_uuid(name: str) -> str:
    """``str(uuid.uuid5(_NAMESPACE, name))`` without building UUID objects (10,000 GPUs at every start)."""
    h = bytearray(hashlib.sha1(_NAMESPACE_BYTES + name.encode()).digest()[:16])
    h[6] = (h[6] & 0x0F) | 0x50  # version 5
    h[8] = (h[8] & 0x3F) | 0x80  # RFC 4122 variant
    x = h.hex()
    return f"{x[:8]}-{x[8:12]}-{x[12:16]}-{x[16:20]}-{x[20:]}"


_GROUP_RE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*(?::\s*([A-Za-z0-9][A-Za-z0-9 ._-]*?)\s*)?(?::\s*(\S+)\s*)?$")
_NAME_MEMORY_RE = re.compile(r"(\d+)\s*GB?$", re.IGNORECASE)


def parse_cluster(text: str, memory: str = "80G") -> list[tuple[int, int, str, int]]:
    """Groups of alike nodes from ``'2x8:A100-40GB,1x8:H100:80G'``: (nodes, GPUs per node, GPU name, bytes).

    A group without a name has ``'Simulated GPU'``; without a memory size, the size that ends its name
    (``A100-40GB``: 40G), else ``memory``."""
    groups = []
    for part in text.split(","):
        m = _GROUP_RE.match(part)
        if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
            raise ValueError(f"Invalid cluster {text!r}: give NODESxGPUS[:GPU_NAME[:MEMORY]] groups separated by "
                             "commas, e.g. 8x8 or 2x8:A100-40GB,1x8:H100:80G")
        name = m.group(3) or "Simulated GPU"
        size = m.group(4) or (f"{n.group(1)}G" if (n := _NAME_MEMORY_RE.search(name)) else memory)
        groups.append((int(m.group(1)), int(m.group(2)), name, parse_size(size, f"memory of {part.strip()!r}")))
    return groups


def _gpu(fields: dict[str, Any]) -> GPU:
    """``GPU(**fields)`` without the frozen dataclass's __init__ (a third of its cost; 10,000 GPUs at every
    start). ``fields`` must name every field: test_inventory_contract compares the result with GPU(**fields)."""
    gpu = object.__new__(GPU)
    object.__setattr__(gpu, "__dict__", fields)
    return gpu


class SimulatedInventory(Inventory):
    kind = "simulated"
    simulated = True

    gpus = numbers.Integer(4, min=1, max=100_000, config=True,
                           help="Number of simulated GPUs in all (spread over `nodes`). Example: 8.")
    nodes = numbers.Integer(1, min=1, max=10_000, config=True,
                            help="Number of simulated nodes the GPUs are spread over. Example: 2.")
    gpu_name = Unicode("Simulated GPU", config=True, help="Device name shown for every simulated GPU.")
    memory = numbers.Size("80G", config=True, help="Memory of each simulated GPU, e.g. '80G' or '24GiB'.")
    cluster = Unicode(
        "",
        config=True,
        help="Mixed simulated nodes, replacing gpus, nodes, gpu_name and memory: groups of NODESxGPUS[:GPU_NAME"
        "[:MEMORY]] separated by commas, e.g. '2x8:A100-40GB,1x8:H100:80G' (3 nodes; a name's size, 40GB, is its "
        "memory unless given). '' = gpus GPUs of one kind on nodes nodes.",
    )
    link_group_size = Integer(
        4,
        config=True,
        help="Simulated GPUs of one node are linked (like NVLink) in groups of this size; "
        "gangs prefer GPUs of one group. 0 = all GPUs of a node in one group.",
    )

    simulate_usage = Bool(
        True,
        config=True,
        help="Simulate what leases use, so their usage figures, memory caps and the GPU views have something to "
        "show: the resident memory (RSS) of a lease's processes and their descendants counts as their GPU memory, "
        "their CPU use (percent of one core, at most 100) as their GPU utilisation, spread evenly over the lease's "
        "GPUs. False = every sample is empty (nothing runs on a simulated GPU).",
    )

    @validate("cluster")
    def _valid_cluster(self, proposal: dict[str, Any]) -> str:
        if proposal["value"]:
            try:
                parse_cluster(proposal["value"])
            except ValueError as e:
                raise ValueError(f"SimulatedInventory.cluster: {e}") from None
        return str(proposal["value"])

    _ids: list[str] | None = None

    def discover(self) -> list[GPU]:
        if self.cluster:
            groups = parse_cluster(self.cluster, self.memory)
        else:
            nodes = min(self.nodes, self.gpus)
            per_node, extra = divmod(self.gpus, nodes)
            mem = parse_size(self.memory)
            groups = [(1, per_node + 1, self.gpu_name, mem)] * extra + [(nodes - extra, per_node, self.gpu_name, mem)]
        total_nodes = sum(n for n, *_ in groups)
        group_size, single = self.link_group_size, self.node_name  # traits: read once
        out: list[GPU] = []
        n = 0
        for count, per_node, name, mem in groups:
            for _ in range(count):
                node = single if total_nodes == 1 else f"sim-node-{n}"
                n += 1
                for i in range(per_node):
                    group = i // group_size if group_size else 0
                    out.append(_gpu({"id": "GPU-" + gpu_uuid(f"{node}/{i}"), "index": i, "node": node, "name": name,
                                     "memory_total": mem, "link_group": f"{node}/nvl{group}", "simulated": True,
                                     "mig": False, "parent": ""}))
        return out

    _holding: list[tuple[tuple[str, ...], tuple[int, ...]]] = []  # (devices, pids) of leases with processes
    _cpu_seen: dict[int, tuple[int, int, float]] = {}  # pid -> (start ticks, CPU ticks, monotonic time)

    def reconcile(self, leases: Mapping[str, Lease], now: float) -> list[InventoryChange]:
        """Note the holding leases' devices and processes for the next sample (which runs in a thread)."""
        if self.simulate_usage:
            self._holding = [(tuple(lease.devices), tuple(lease.pids)) for lease in leases.values()
                             if lease.pids and lease.devices and lease.state in HOLDING]
        return []

    def sample(self) -> dict[str, GpuSample]:
        """Empty samples, except where leases' processes run (``simulate_usage``): their memory and CPU use."""
        if self._ids is None:
            self._ids = [g.id for g in self.discover()]
        if not self.simulate_usage:
            return {gpu_id: GpuSample() for gpu_id in self._ids}
        out = {gpu_id: GpuSample(proc_util={}) for gpu_id in self._ids}  # per-process figures: of leases only
        holding = self._holding
        if not holding:
            self._cpu_seen = {}
            return out
        now, seen = time.monotonic(), {}
        up = uptime_ticks()
        for devices, roots in holding:
            for pid, (rss, cpu, start) in tree_usage(list(roots)).items():
                last = self._cpu_seen.get(pid)
                if last is not None and last[0] == start and now > last[2]:
                    percent = (cpu - last[1]) / _CLK_TCK / (now - last[2]) * 100
                else:  # first seen: its mean since it started
                    percent = cpu / max(1.0, up - start) * 100
                seen[pid] = (start, cpu, now)
                for gpu_id in devices:
                    s = out.get(gpu_id)
                    if s is None:
                        continue
                    share = rss // len(devices)
                    s.pids[pid] = share
                    s.proc_util = {**(s.proc_util or {}), pid: min(100.0, max(0.0, percent))}
                    s.memory_used += share
                    s.utilization = min(100.0, sum(s.proc_util.values()))
        self._cpu_seen = seen
        return out
