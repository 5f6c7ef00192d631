"""The GPUs as the scheduler sees them: ``Slot`` and ``SlotIndex``, an index by node that forks cheaply.

A scheduling pass runs on every request, release and tick, so it must not cost a copy of every GPU: the
broker keeps one ``SlotIndex`` current as leases come and go (``gputable.GpuTable``), and a pass works on a
``fork()`` of it, which copies a slot only when the pass changes it (copy on write). The index also counts
the idle GPUs of every node, so that placing a request looks only at nodes that have room.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable


@dataclasses.dataclass
class Slot:
    """A GPU as the scheduler sees it."""

    id: str
    node: str
    index: int = 0
    link_group: str = ""
    memory_total: int = 0
    exclusive: bool = False  # held by an exclusive lease
    shares: float = 0.0  # sum of the fractions of shared leases on it
    mem_used: int = 0  # memory promised to shared leases
    n_shared: int = 0
    available: bool = True  # False while draining, unhealthy, or reserved by an admin window
    free_at: float = 0.0  # when it is expected to be free for an exclusive lease (INF = never)
    name: str = ""  # the device's model (or MIG profile) name, for requests of a GPU type
    mig: bool = False  # a MIG device: never one of several GPUs of a lease
    held_by: tuple[tuple[str, float], ...] = ()  # (user, GPUs) of the leases on it, for per-type caps

    def clone(self) -> Slot:
        """A copy (dataclasses.replace is ~10x slower)."""
        c = object.__new__(Slot)
        c.__dict__.update(self.__dict__)
        return c

    @property
    def idle(self) -> bool:
        return self.available and not self.exclusive and self.n_shared == 0


class SlotIndex:
    """Slots by id and by node (each node's in index order), and the idle slots of every node.

    ``idle`` counts what the index was given or ``put``; a holder of a ``fork`` that changes a slot it got from
    ``edit`` keeps those counts itself (``note_idle``).
    """

    __slots__ = ("by_id", "nodes", "idle", "idle_total", "has_mig", "_owned_nodes", "_owned", "kept")

    def __init__(self, slots: Iterable[Slot] = ()) -> None:
        self.by_id: dict[str, Slot] = {}
        self.nodes: dict[str, list[Slot]] = {}
        self.idle: dict[str, int] = {}
        self.idle_total = 0
        self.has_mig = False  # some slot is a MIG device: requests of several GPUs must skip those
        for s in slots:
            self.by_id[s.id] = s
            self.has_mig = self.has_mig or s.mig
            self.nodes.setdefault(s.node, []).append(s)
            if s.idle:
                self.idle[s.node] = self.idle.get(s.node, 0) + 1
                self.idle_total += 1
        for members in self.nodes.values():
            members.sort(key=lambda s: s.index)
        self._owned_nodes: set[str] | None = None  # None: owns everything (not a fork)
        self._owned: set[str] | None = None
        #: the ready times a scheduling pass worked out from a node's slots, for later passes (``scheduler._State``):
        #: node -> (the node's list of slots they came from, when, the times); shared by every fork of this index
        self.kept: dict[str, tuple[list[Slot], float, list[tuple[float, int]]]] = {}

    def __len__(self) -> int:
        return len(self.by_id)

    def all(self) -> list[Slot]:
        """Every slot, node by node."""
        return [s for members in self.nodes.values() for s in members]

    def fork(self) -> SlotIndex:
        """A copy that shares the slots until it changes them (``edit``/``put``); this index is left untouched."""
        c = object.__new__(SlotIndex)
        c.by_id, c.nodes, c.idle, c.idle_total = dict(self.by_id), dict(self.nodes), dict(self.idle), self.idle_total
        c.has_mig = self.has_mig
        c._owned_nodes, c._owned = set(), set()
        c.kept = self.kept
        return c

    def unchanged(self, node: str) -> bool:
        """Whether this index still has the node's slots as it was given them (a fork: it changed none of them,
        so the node's list is the one it shares; a list that is not a fork's own never changes in place)."""
        return self._owned_nodes is not None and node not in self._owned_nodes

    def put(self, slot: Slot) -> None:
        """Replace the slot of the same id (its node and index unchanged), keeping the idle counts."""
        old = self.by_id[slot.id]
        self._replace(old, slot)
        if old.idle != slot.idle:
            self.note_idle(slot.node, 1 if slot.idle else -1)

    def edit(self, slot_id: str) -> Slot:
        """The slot, as this index's own copy to change (a fork copies it on first edit)."""
        s = self.by_id[slot_id]
        if self._owned is None or slot_id in self._owned:
            return s
        c = s.clone()
        self._replace(s, c)
        self._owned.add(slot_id)
        return c

    def note_idle(self, node: str, delta: int) -> None:
        self.idle[node] = self.idle.get(node, 0) + delta
        self.idle_total += delta

    def _replace(self, old: Slot, new: Slot) -> None:
        self.by_id[new.id] = new
        members = self.nodes[old.node]
        if self._owned_nodes is not None and old.node not in self._owned_nodes:
            members = self.nodes[old.node] = list(members)  # the original's list stays as it was
            self._owned_nodes.add(old.node)
        elif self._owned_nodes is None:
            members = self.nodes[old.node] = list(members)  # forks made earlier keep the list they share
        for i, m in enumerate(members):
            if m is old:
                members[i] = new
                break


def pick_connected(free: list[Slot], k: int) -> list[Slot]:
    """k GPUs of one node, preferring one link group (NVLink island) that fits them best."""
    if k <= 0:
        return []
    groups: dict[str, list[Slot]] = {}
    for s in free:
        groups.setdefault(s.link_group, []).append(s)
    fitting = [g for g in groups.values() if len(g) >= k]
    if fitting:
        return min(fitting, key=lambda g: (len(g), g[0].index))[:k]
    chosen: list[Slot] = []
    for g in sorted(groups.values(), key=lambda g: (-len(g), g[0].index)):
        chosen.extend(g[: k - len(chosen)])
        if len(chosen) == k:
            break
    return chosen
