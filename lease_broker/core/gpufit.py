"""Whether a device satisfies a request: its GPU type (model or MIG profile), its memory, and MIG's one-device rule.

One rule, used by the scheduler for every placement (``fits``) and by the broker to refuse at once a request that
no device can ever satisfy (``unplaceable``, over the inventory's kinds of devices, naming what exists).

A request's ``gpu_type`` names devices the way admins configure them (``LeasePolicy.gpu_types``: a type name and
the NVML device names or patterns it covers, e.g. ``{'A100-40GB': ['NVIDIA A100-SXM4-40GB', 'NVIDIA A100-PCIE-40GB']}``)
or by the device's own name, case-insensitively: the whole name (``NVIDIA H100 80GB HBM3``), the name without the
vendor (``H100 80GB HBM3``) or its leading word (``H100``: the name up to a space, ``-`` or ``_``). A MIG device
answers to its profile (``1g.10gb``), to ``MIG`` and to its whole name (``NVIDIA A100-SXM4-40GB MIG 1g.10gb``), not
to its GPU's model alone: ``--gpu-type A100`` asks for a whole A100. CUDA shows a process one MIG device, so a
request for more than one GPU never gets MIG devices.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from fnmatch import fnmatchcase
from typing import NamedTuple, Protocol, TypeVar

from .gpu import GPU
from .lease import LeaseRequest

#: Admin-configured GPU types, as the scheduler keeps them: ((type name, (NVML names or patterns, ...)), ...).
Aliases = tuple[tuple[str, tuple[str, ...]], ...]

_VENDORS = ("nvidia ", "tesla ")


class Device(Protocol):
    """What the rule reads of a device (a scheduler ``Slot`` or an inventory ``GPU``)."""

    @property
    def name(self) -> str: ...
    @property
    def memory_total(self) -> int: ...
    @property
    def mig(self) -> bool: ...


def aliases_of(gpu_types: Mapping[str, Sequence[str]]) -> Aliases:
    """The policy's ``gpu_types`` in the hashable form the rule memoises on."""
    return tuple((name, tuple(patterns)) for name, patterns in sorted(gpu_types.items()))


@functools.lru_cache(maxsize=4096)
def matches_type(name: str, mig: bool, wanted: str, aliases: Aliases = ()) -> bool:
    """Whether a device called ``name`` (a MIG device: ``mig``) is of the type ``wanted``."""
    w = wanted.strip().lower()
    low = name.lower()
    for type_name, patterns in aliases:
        if type_name.lower() == w and any(fnmatchcase(low, p.lower()) for p in patterns):
            return True
    bare = next((low[len(v):] for v in _VENDORS if low.startswith(v)), low)
    if w in (low, bare):
        return True
    if mig:
        return w == "mig" or w == bare.rpartition(" mig ")[2]
    return bare.startswith(w) and len(bare) > len(w) and bare[len(w)] in " -_"


def fits(device: Device, req: LeaseRequest, aliases: Aliases = ()) -> bool:
    """Whether one device can serve ``req``: of its type, with at least its ``gpu_mem``, and not a MIG device for
    a request of several GPUs."""
    if req.gpu_mem and device.memory_total < req.gpu_mem:
        return False
    if device.mig and req.max_gpus > 1 and not req.shared:
        return False
    return not req.gpu_type or matches_type(device.name, device.mig, req.gpu_type, aliases)


def fit_rule(req: LeaseRequest, aliases: Aliases, blocked: Sequence[str] = ()) -> Callable[[Device], bool]:
    """``fits`` for one request, also refusing devices of the types in ``blocked`` (the user's caps for them)."""
    if not blocked:
        return lambda d: fits(d, req, aliases)
    return lambda d: fits(d, req, aliases) and not any(matches_type(d.name, d.mig, t, aliases) for t in blocked)


class Held(Device, Protocol):
    """A device with the users holding it (a scheduler ``Slot``)."""

    @property
    def held_by(self) -> tuple[tuple[str, float], ...]: ...


_H = TypeVar("_H", bound=Held)


class TypeRoom:
    """Per-type caps (``max_gpus`` per GPU type) during one scheduling pass: which capped types a user may not
    take ``need`` more of, counting what they held before the pass and what the pass gave them."""

    def __init__(self, caps: Callable[[str], Mapping[str, float]], aliases: Aliases) -> None:
        self.caps, self.aliases = caps, aliases
        self.held: dict[tuple[str, str], float] = {}

    def blocked(self, user: str, need: float, devices: Callable[[], Iterable[Held]]) -> list[str]:
        caps = self.caps(user)
        for t in caps:
            if (user, t) not in self.held:  # before the pass: a scan, once per capped user and type
                self.held[(user, t)] = sum(f for d in devices() if matches_type(d.name, d.mig, t, self.aliases)
                                           for u, f in d.held_by if u == user)
        return [t for t, cap in caps.items() if self.held[(user, t)] + need > cap + 1e-9]

    def trim(self, user: str, chosen: list[_H], minimum: int) -> list[_H]:
        """``chosen`` without the devices past the user's caps (call ``blocked`` first); [] if fewer than
        ``minimum`` are left."""
        caps = self.caps(user)
        if not caps:
            return chosen
        used = {t: self.held[(user, t)] for t in caps}
        keep = []
        for d in chosen:
            types = [t for t in caps if matches_type(d.name, d.mig, t, self.aliases)]
            if all(used[t] + 1 <= caps[t] + 1e-9 for t in types):
                for t in types:
                    used[t] += 1
                keep.append(d)
        return keep if len(keep) >= max(minimum, 1) else []

    def charge(self, user: str, taken: Iterable[Held], each: float = 1.0) -> None:
        for t in self.caps(user):
            n = sum(each for d in taken if matches_type(d.name, d.mig, t, self.aliases))
            self.held[(user, t)] = self.held.get((user, t), 0.0) + n


def constrained(req: LeaseRequest) -> bool:
    """Whether ``req`` narrows the devices it may get (otherwise every device but MIG ones for several GPUs)."""
    return bool(req.gpu_type or req.gpu_mem)


class Kind(NamedTuple):
    """Devices alike for every request: one model (or MIG profile) with one memory size."""

    name: str
    memory_total: int
    mig: bool


def device_kinds(gpus: Iterable[GPU]) -> dict[Kind, dict[str, int]]:
    """How many devices of each kind each node has."""
    out: dict[Kind, dict[str, int]] = {}
    for g in gpus:
        per_node = out.setdefault(Kind(g.name, g.memory_total, g.mig), {})
        per_node[g.node] = per_node.get(g.node, 0) + 1
    return out


def beyond_caps(req: LeaseRequest, kinds: Mapping[Kind, Mapping[str, int]], aliases: Aliases,
                caps: Mapping[str, float]) -> str | None:
    """Why ``req`` can never be granted to a user with these caps (GPUs per type, ``max_gpus``) although devices
    for it exist: those of a capped type count up to the cap only. None when it can."""
    if not caps:
        return None
    matching = [k for k in kinds if fits(k, req, aliases)]
    need = 1 if req.shared else req.min_gpus
    if _room(matching, kinds, aliases, req.locality == "node", caps) >= need:
        return None
    capped = ", ".join(f"{n:g} {t}" for t, n in sorted(caps.items()))
    return (f"Request for {need} GPUs can never be granted to you: the GPUs that match it are of types you may "
            f"hold at most {capped} of at once (max_gpus)")


def unplaceable(req: LeaseRequest, kinds: Mapping[Kind, Mapping[str, int]], aliases: Aliases = ()) -> str | None:
    """Why no device (or no node, for a gang on one node) can ever serve ``req``, naming what exists; None when
    some can. Only the kinds of devices are read: cheap at every request."""
    matching = [k for k in kinds if fits(k, req, aliases)]
    need = 1 if req.shared else req.min_gpus
    have = _room(matching, kinds, aliases, req.locality == "node", {})
    if have >= need:
        return None
    count = f"{req.min_gpus}-{req.max_gpus} GPUs" if req.max_gpus > req.min_gpus and not req.shared else (
        f"{need} GPUs" if need > 1 else "a GPU")
    asked = " ".join(part for part in (count,
                                       f"of type {req.gpu_type!r}" if req.gpu_type else "",
                                       f"with at least {_size(req.gpu_mem)}" if req.gpu_mem else "") if part)
    one = [k for k in kinds if fits(k, LeaseRequest(gpu_type=req.gpu_type, gpu_mem=req.gpu_mem), aliases)]
    if (need > 1 or (req.max_gpus > 1 and not req.shared)) and one and all(k.mig for k in one):
        return (f"Request for {asked} can never be granted: only MIG devices match, and CUDA shows a process only "
                "one MIG device; ask for 1")
    if matching:
        where = "on one node" if req.locality == "node" else "in all"
        return f"Request for {asked} can never be granted: at most {have} match {where} ({describe_kinds(kinds)})"
    return f"Request for {asked} can never be granted: this broker has {describe_kinds(kinds)}"


def _room(matching: Sequence[Kind], kinds: Mapping[Kind, Mapping[str, int]], aliases: Aliases, one_node: bool,
          caps: Mapping[str, float]) -> float:
    """The most matching devices one user may hold (on one node, or in all): a capped type's up to its cap."""
    def capped(k: Kind) -> str | None:
        return next((t for t in caps if matches_type(k.name, k.mig, t, aliases)), None)

    per: dict[str, dict[str | None, int]] = {}
    for k in matching:
        for node, n in kinds[k].items():
            by_type = per.setdefault(node if one_node else "", {})
            t = capped(k)
            by_type[t] = by_type.get(t, 0) + n
    return max((sum(n if t is None else min(n, caps[t]) for t, n in by_type.items()) for by_type in per.values()),
               default=0)


def describe_kinds(kinds: Mapping[Kind, Mapping[str, int]]) -> str:
    """'8x NVIDIA H100 80GB HBM3 (80G), 3x NVIDIA A100-SXM4-40GB MIG 1g.10gb (10G, MIG)' for messages."""
    parts = [f"{sum(nodes.values())}x {k.name} ({_size(k.memory_total)}{', MIG' if k.mig else ''})"
             for k, nodes in sorted(kinds.items(), key=lambda kv: (kv[0].mig, -kv[0].memory_total, kv[0].name))]
    return ", ".join(parts) or "no GPUs"


def _size(n: int) -> str:
    return f"{n / 2**30:.4g}G"
