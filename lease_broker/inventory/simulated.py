"""A simulated GPU inventory for demos and tests: labelled simulated everywhere.

The GPUs do not exist, but everything around them does: leases attach real
processes, activity is the CPU time those processes use, and a GPU drains until
the lease's processes are gone, so the broker runs the same code paths as on a host
with real GPUs.
"""

from __future__ import annotations

import hashlib
import uuid
from typing import Any

from traitlets import Integer, Unicode, validate

from ..core.gpu import GPU, GpuSample
from ..core.lease import parse_size
from . import Inventory

_NAMESPACE = uuid.UUID("6b1f9e0c-3f5e-4c27-9c1e-5a0f5e0d1a11")
_NAMESPACE_BYTES = _NAMESPACE.bytes  # a property that builds the bytes at every call


def gpu_uuid(name: str) -> str:
    """``str(uuid.uuid5(_NAMESPACE, name))`` without building UUID objects (10,000 GPUs at every start)."""
    h = bytearray(hashlib.sha1(_NAMESPACE_BYTES + name.encode()).digest()[:16])
    h[6] = (h[6] & 0x0F) | 0x50  # version 5
    h[8] = (h[8] & 0x3F) | 0x80  # RFC 4122 variant
    x = h.hex()
    return f"{x[:8]}-{x[8:12]}-{x[12:16]}-{x[16:20]}-{x[20:]}"


def _gpu(fields: dict[str, Any]) -> GPU:
    """``GPU(**fields)`` without the frozen dataclass's __init__ (a third of its cost; 10,000 GPUs at every
    start). ``fields`` must name every field: test_inventory_contract compares the result with GPU(**fields)."""
    gpu = object.__new__(GPU)
    object.__setattr__(gpu, "__dict__", fields)
    return gpu


class SimulatedInventory(Inventory):
    kind = "simulated"
    simulated = True

    gpus = Integer(4, config=True, help="Number of simulated GPUs in all (spread over `nodes`). Example: 8.")
    nodes = Integer(1, config=True, help="Number of simulated nodes the GPUs are spread over. Example: 2.")
    gpu_name = Unicode("Simulated GPU", config=True, help="Device name shown for every simulated GPU.")
    memory = Unicode("80G", config=True, help="Memory of each simulated GPU, e.g. '80G' or '24GiB'.")
    link_group_size = Integer(
        4,
        config=True,
        help="Simulated GPUs of one node are linked (like NVLink) in groups of this size; "
        "gangs prefer GPUs of one group. 0 = all GPUs of a node in one group.",
    )

    @validate("gpus")
    def _valid_gpus(self, proposal: dict[str, Any]) -> int:
        if not 1 <= proposal["value"] <= 100_000:
            raise ValueError(f"SimulatedInventory.gpus={proposal['value']!r}: give 1 to 100000")
        return int(proposal["value"])

    @validate("nodes")
    def _valid_nodes(self, proposal: dict[str, Any]) -> int:
        if not 1 <= proposal["value"] <= 10_000:
            raise ValueError(f"SimulatedInventory.nodes={proposal['value']!r}: give 1 to 10000")
        return int(proposal["value"])

    @validate("memory")
    def _valid_memory(self, proposal: dict[str, Any]) -> str:
        parse_size(proposal["value"], "SimulatedInventory.memory")
        return str(proposal["value"])

    _ids: list[str] | None = None

    def discover(self) -> list[GPU]:
        nodes = min(self.nodes, self.gpus)
        per_node, extra = divmod(self.gpus, nodes)
        mem = parse_size(self.memory)
        name, group_size, single = self.gpu_name, self.link_group_size, self.node_name  # traits: read once
        out: list[GPU] = []
        for n in range(nodes):
            node = single if nodes == 1 else f"sim-node-{n}"
            for i in range(per_node + (1 if n < extra else 0)):
                group = i // group_size if group_size else 0
                out.append(_gpu({"id": "GPU-" + gpu_uuid(f"{node}/{i}"), "index": i, "node": node, "name": name,
                                 "memory_total": mem, "link_group": f"{node}/nvl{group}", "simulated": True,
                                 "mig": False, "parent": ""}))
        return out

    def sample(self) -> dict[str, GpuSample]:
        """Nothing runs on a simulated GPU: every device reports an empty sample."""
        if self._ids is None:
            self._ids = [g.id for g in self.discover()]
        return {gpu_id: GpuSample() for gpu_id in self._ids}
