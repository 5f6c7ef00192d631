"""A Ray cluster as the inventory and placement layer (the only broker module that imports ``ray``).

The GPUs are those the cluster's alive nodes declare (``ray.nodes()``), named
``ray:<node_ip>:<index>``. The broker keeps its own queue, policies and timeouts and picks
the devices; a grant then becomes a Ray placement group that reserves them, one bundle per
node the lease spans (``{"GPU": n, "node:<ip>": 0.001}``: the node the broker chose),
``STRICT_PACK`` when the lease is on one node, ``PACK`` otherwise. A group is detached and
named after the lease in the broker's namespace, so it outlives a broker restart and is
found again by name; ending the lease removes it (Ray then kills the actors in it, e.g. the
``%%gpu`` worker). A group that Ray cannot place within ``placement_timeout`` is removed and
the lease fails; a node that dies takes its GPUs out of the inventory and fails the leases
that held them.

Once a group is placed, the broker learns which GPU IDs Ray assigned to each bundle (one task per bundle, placed in
the bundle, ``gpulease_protocol.ray_ids``; submitted off Ray's callback thread, never waited for on the event loop)
and the lease view shows them (``placement.bundles[i].gpu_ids``, e.g. ``"0,1"``), so that a kernel need not run that
task itself (a kernel's task needs a Ray worker process of the kernel's own job: seconds of ``import ray`` on its first
cell). At start the broker runs one trivial task on each GPU node: its idle Ray worker process there then runs those
tasks at once (milliseconds).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from traitlets import Unicode

from gpulease_protocol.ray_ids import gpu_ids, in_bundle

from ..core.errors import LeaseError
from ..core.gpu import GPU, GpuSample
from ..core.lease import HOLDING, Lease, parse_size
from ..policy.numbers import Float, Size
from . import Inventory
from .changes import GpusChanged, InventoryChange, LeaseFailed

log = logging.getLogger("lease_broker")

PG_PREFIX = "gpulease-"
NODE_PIN = 0.001  # share of a node's `node:<ip>` resource a bundle asks for, to pin it to that node


def pg_name(lease_id: str) -> str:
    return PG_PREFIX + lease_id


def worker_prefix(lease_id: str) -> str:
    """Names of a lease's ``%%gpu`` worker actors (``gpulease-<lease>-w<pid>-<n>``) in the broker's namespace."""
    return f"{PG_PREFIX}{lease_id}-w"


def bundles_for(devices: list[GPU], fraction: float) -> tuple[list[dict[str, float]], list[str]]:
    """One bundle per node (in the order the devices name them): its GPUs and its node pin."""
    nodes: list[str] = []
    count: dict[str, int] = {}
    for g in devices:
        if g.node not in count:
            nodes.append(g.node)
            count[g.node] = 0
        count[g.node] += 1
    bundles = [
        {"GPU": fraction if fraction < 1 else float(count[n]), f"node:{n}": NODE_PIN} for n in nodes
    ]
    return bundles, nodes


class RayInventory(Inventory):
    kind = "ray"
    simulated = False

    address = Unicode(
        "",
        config=True,
        help="Address of the Ray cluster (what `ray.init(address=...)` takes), e.g. '10.0.0.5:6379'. "
        "Empty: $RAY_ADDRESS, else 'auto' (the cluster this host belongs to).",
    )
    namespace = Unicode(
        "gpulease",
        config=True,
        help="Ray namespace of the broker's named, detached placement groups; clients join it to find them. "
        "Example: 'gpulease-prod'.",
    )
    node_ip = Unicode(
        "",
        config=True,
        help="IP address of the broker's host as the Ray cluster knows it (Ray's `_node_ip_address`), e.g. "
        "'10.0.0.7'. Empty: Ray's guess.",
    )
    placement_timeout = Float(
        60.0,
        config=True,
        help="Seconds a granted lease's placement group may stay pending in Ray before the broker removes it and "
        "fails the lease (reason placement_timeout). 0 = wait forever. Example: 60.",
    )
    memory = Size(
        "80G",
        config=True,
        help="Memory reported for each GPU (Ray does not report it; used for `mem=` requests), e.g. '80G'.",
    )

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._ray: Any = None
        self._owns_ray = False  # this inventory called ray.init (and so may shut it down)
        self._lock = threading.Lock()
        self._gpus: list[GPU] = []
        self._declared = True
        self._node_count = 0
        self._pgs: dict[str, Any] = {}  # lease id -> PlacementGroup
        self._pg_state: dict[str, str] = {}  # lease id -> pending / ready
        self._pg_since: dict[str, float] = {}  # lease id -> when the group was created (monotonic)
        self._logged: set[str] = set()  # lease ids whose group was seen ready by the tick
        self._reported: dict[str, GPU] = {}  # the GPUs as the broker last learned them (discover or a change)
        self._adopted = False
        self._discovered = False
        self._dirty = False  # discover() saw a different set of GPUs than the broker has
        self._gpu_ids: dict[str, dict[int, str]] = {}  # lease id -> bundle index -> the GPU IDs Ray assigned there
        self._ids_task: Any = None
        # asks for the GPU IDs of a placed group off Ray's callback thread (submits tasks; never waits for them)
        self._asker = ThreadPoolExecutor(1, thread_name_prefix="gpulease-ray-ids")

    # ---------------------------------------------------------------- connection
    def _connect(self) -> Any:
        if self._ray is not None:
            return self._ray
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        import ray

        address = self.address or os.environ.get("RAY_ADDRESS") or "auto"
        try:
            if not ray.is_initialized():
                extra: dict[str, Any] = {"_node_ip_address": self.node_ip} if self.node_ip else {}
                ray.init(address=address, namespace=self.namespace, log_to_driver=False,
                         logging_level=logging.WARNING, configure_logging=False, **extra)
                self._owns_ray = True
        except Exception as e:
            raise LeaseError(
                f"Cannot connect to the Ray cluster at {address!r} ({type(e).__name__}: {e}): "
                "set --RayInventory.address (or $RAY_ADDRESS) to a running cluster's address",
                reason="startup",
            ) from None
        self._ray = ray
        self.gcs_address = ray.get_runtime_context().gcs_address
        return ray

    # ---------------------------------------------------------------- inventory
    def discover(self) -> list[GPU]:
        ray = self._connect()
        mem = parse_size(self.memory)
        out: list[GPU] = []
        declared = True
        nodes = sorted((n for n in ray.nodes() if n.get("Alive")), key=lambda n: n["NodeManagerAddress"])
        for n in nodes:
            res = n.get("Resources") or {}
            count = int(res.get("GPU", 0))
            if not count:
                continue
            ip = n["NodeManagerAddress"]
            accel = [k.split(":", 1)[1] for k in res if k.startswith("accelerator_type:")]
            declared = declared and not accel
            name = f"Ray GPU ({accel[0]})" if accel else "Ray GPU (declared resource)"
            out += [GPU(id=f"ray:{ip}:{i}", index=i, node=ip, name=name, memory_total=mem, link_group=ip)
                    for i in range(count)]
        with self._lock:
            self._dirty = self._dirty or (self._discovered and [g.id for g in out] != [g.id for g in self._gpus])
            first = not self._discovered
            if first:
                self._reported = {g.id: g for g in out}  # the broker starts with these
            self._discovered = True
            self._gpus, self._declared, self._node_count = out, declared, len(nodes)
        if first:
            self._prestart([n["NodeID"] for n in nodes if int((n.get("Resources") or {}).get("GPU", 0))])
        return out

    def _ids(self) -> Any:
        if self._ids_task is None:
            self._ids_task = self._connect().remote(num_cpus=0)(gpu_ids)
        return self._ids_task

    def _prestart(self, node_ids: list[str]) -> None:
        """One trivial task (no CPUs) on each GPU node, not waited for: the Ray worker process it starts (a new
        Python's ``import ray``, seconds of the node's CPU, once) stays idle for this broker's job, so the tasks that
        learn each placed group's GPU IDs there run in it at once (milliseconds)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        for node_id in node_ids:
            try:
                self._ids().options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()
            except Exception:  # only a head start: the first group's tasks start the worker then
                log.debug("Ray node %s: no prestarted worker", node_id, exc_info=True)

    def sample(self) -> dict[str, GpuSample]:
        """Ray reports no per-GPU use: refresh the node list (node death) and report empty samples."""
        gpus = self.discover()
        return {g.id: GpuSample() for g in gpus}

    def visible_devices(self, gpus: list[GPU]) -> str:
        """Indices on the node as the broker counts them; a Ray actor in the lease's group gets its own."""
        return ",".join(str(g.index) for g in gpus)

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "simulated": False,
            "engine": "ray",
            "address": getattr(self, "gcs_address", self.address),
            "namespace": self.namespace,
            "nodes": self._node_count,
            # True when no node names an accelerator type: GPUs are declared resources (maybe fake)
            "declared_gpus": self._declared,
        }

    def placement(self, lease: Lease) -> dict[str, Any] | None:
        pg = self._pgs.get(lease.id)
        if pg is None or lease.state not in HOLDING:
            return None
        per_node: dict[str, int] = {}
        for d in lease.devices:
            node = d.split(":")[1]
            per_node[node] = per_node.get(node, 0) + 1
        frac = lease.request.fraction if lease.request.shared else 0.0
        return {
            "kind": "ray",
            "address": getattr(self, "gcs_address", self.address),
            "namespace": self.namespace,
            "placement_group": pg_name(lease.id),
            "placement_group_id": pg.id.hex(),
            "state": self._pg_state.get(lease.id, "pending"),
            "bundles": [self._bundle(lease.id, i, n, frac or count) for i, (n, count) in enumerate(per_node.items())],
        }

    def _bundle(self, lease_id: str, index: int, node: str, gpus: float) -> dict[str, Any]:
        """A bundle as the view shows it; ``gpu_ids`` once the broker learned them (``_learn_ids``)."""
        out: dict[str, Any] = {"index": index, "node": node, "gpus": gpus}
        ids = self._gpu_ids.get(lease_id, {}).get(index)
        if ids is not None:
            out["gpu_ids"] = ids
        return out

    # ---------------------------------------------------------------- placement groups
    def _create(self, lease: Lease) -> None:
        self._connect()
        from ray.util.placement_group import placement_group

        devices = [g for g in (self._by_id().get(d) for d in lease.devices) if g is not None]
        if not devices:
            return
        bundles, nodes = bundles_for(devices, lease.request.fraction if lease.request.shared else 1.0)
        strategy = "STRICT_PACK" if len(nodes) == 1 else "PACK"
        existing = self._find(lease.id)
        if existing is None:
            existing = placement_group(bundles, strategy=strategy, name=pg_name(lease.id), lifetime="detached")
            log.info("Lease %s: placement group %s created: %s %s", lease.id, pg_name(lease.id), strategy, bundles)
        self._track(lease.id, existing)

    def _track(self, lease_id: str, pg: Any) -> None:
        """Follow a group until it is placed: Ray says so as soon as it is (no polling, no task)."""
        self._pgs[lease_id] = pg
        self._pg_state[lease_id] = "pending"
        self._pg_since[lease_id] = time.monotonic()

        def placed(fut: Any) -> None:  # on a Ray thread
            if fut.exception() is not None:
                return
            with self._lock:
                if self._pgs.get(lease_id) is pg and self._pg_state.get(lease_id) == "pending":
                    self._pg_state[lease_id] = "ready"  # seen by the next view; the tick logs it
            try:
                self._asker.submit(self._learn_ids, lease_id, pg)
            except RuntimeError:  # closed
                pass

        try:
            pg.ready().future().add_done_callback(placed)
        except Exception:  # the tick's pg.wait(0) still finds out
            log.debug("Lease %s: no readiness callback", lease_id, exc_info=True)

    def _learn_ids(self, lease_id: str, pg: Any) -> None:
        """(Off Ray's callback thread, once the group is placed.) One task per bundle in the group, as a kernel would
        ask (``ray_ids.in_bundle``); each answer is stored under the lock as it comes and shown by the next view. A
        group removed meanwhile ends its tasks (Ray stops a group's tasks with it): the answer is then dropped."""
        try:
            specs = pg.bundle_specs
        except Exception:
            log.debug("Lease %s: the group's bundles are unknown", lease_id, exc_info=True)
            return
        for index, spec in enumerate(specs):
            gpus = float(spec.get("GPU", 0))
            if not gpus:
                continue

            def learned(fut: Any, index: int = index) -> None:  # on a Ray thread
                with self._lock:
                    if fut.exception() is None and self._pgs.get(lease_id) is pg:
                        self._gpu_ids.setdefault(lease_id, {})[index] = str(fut.result())
                if fut.exception() is not None:
                    log.debug("Lease %s: bundle %d's GPU IDs: %s", lease_id, index, fut.exception())

            try:
                with self._lock:
                    if self._pgs.get(lease_id) is not pg:
                        return
                ref = in_bundle(self._ids(), pg, index, gpus).remote()
                ref.future().add_done_callback(functools.partial(learned, index=index))
            except Exception:  # the view goes without them; a kernel asks itself
                log.debug("Lease %s: asking bundle %d's GPU IDs failed", lease_id, index, exc_info=True)

    def _find(self, lease_id: str) -> Any:
        from ray.util import get_placement_group

        try:
            return get_placement_group(pg_name(lease_id))
        except ValueError:
            return None

    def _remove(self, lease_id: str) -> None:
        from ray.util import remove_placement_group

        with self._lock:
            pg = self._pgs.pop(lease_id, None)
            self._pg_state.pop(lease_id, None)
            self._gpu_ids.pop(lease_id, None)
            self._pg_since.pop(lease_id, None)
            self._logged.discard(lease_id)
        if pg is None:
            pg = self._find(lease_id)
        if pg is not None:
            try:
                remove_placement_group(pg)
                log.info("Lease %s: placement group %s removed", lease_id, pg_name(lease_id))
            except Exception as e:  # already gone
                log.debug("Lease %s: removing placement group: %s", lease_id, e)

    def _by_id(self) -> dict[str, GPU]:
        return self._reported or {g.id: g for g in self._gpus}

    # ---------------------------------------------------------------- the lease owner's calls
    def on_grant(self, lease: Lease, now: float) -> None:
        """Create the lease's placement group."""
        try:
            self._create(lease)
        except Exception:
            log.exception("Lease %s: Ray placement failed", lease.id)

    def on_end(self, lease: Lease) -> None:
        super().on_end(lease)
        try:
            self._remove(lease.id)
        except Exception:
            log.exception("Lease %s: removing its Ray placement failed", lease.id)

    def reconcile(self, leases: Mapping[str, Lease], now: float) -> list[InventoryChange]:
        """Called on every tick: groups for holding leases, no orphans, deadlines, node death."""
        changes: list[InventoryChange] = []
        if not self._adopted:
            self._adopted = True
            self._adopt(leases)
        if self._dirty:
            with self._lock:
                gpus, self._dirty = list(self._gpus), False
            changes += self._gpus_changed(leases, gpus)
        changes += self._check_pending(leases)
        return changes

    def _adopt(self, leases: Mapping[str, Lease]) -> None:
        """At start: find the groups of holding leases again; remove those of leases that ended."""
        ray = self._connect()
        holding = {lid for lid, lease in leases.items() if lease.state in HOLDING}
        try:  # the %%gpu workers of this broker's leases: named actors in its namespace
            named = sorted(a for a in ray.util.list_named_actors() if a.startswith(PG_PREFIX))
        except Exception:
            named = []
        for info in ray.util.placement_group_table().values():
            name = info.get("name") or ""
            if not name.startswith(PG_PREFIX) or info.get("state") == "REMOVED":
                continue
            lid = name[len(PG_PREFIX):]
            if lid not in holding and self._find(lid) is not None:
                log.info("Placement group %s has no live lease: removing it", name)
                self._remove(lid)
        for lid in sorted(holding):
            pg = self._find(lid)
            if pg is not None:
                workers = [a for a in named if a.startswith(worker_prefix(lid))]
                log.info("Lease %s: placement group %s found again (worker actors: %s)", lid, pg_name(lid),
                         ", ".join(workers) or "none")
                self._track(lid, pg)
            else:
                self.on_grant(leases[lid], 0.0)

    def _check_pending(self, leases: Mapping[str, Lease]) -> list[InventoryChange]:
        now = time.monotonic()
        out: list[InventoryChange] = []
        for lid in list(self._pg_state):
            pg = self._pgs.get(lid)
            if pg is None or lid in self._logged:
                continue
            ready = self._pg_state.get(lid) == "ready"
            if not ready:
                try:
                    ready = pg.wait(0)
                except Exception:
                    ready = False
            if ready:
                self._pg_state[lid] = "ready"
                self._logged.add(lid)
                log.info("Lease %s: placement group ready (seen %.3f s after it was created)", lid,
                         now - self._pg_since[lid])
                continue
            if self.placement_timeout and now - self._pg_since[lid] > self.placement_timeout:
                log.error("Lease %s: Ray could not place its placement group within %g s (placement_timeout)",
                          lid, self.placement_timeout)
                self._remove(lid)
                out.append(LeaseFailed(lid, "placement_timeout"))
        return out

    def _gpus_changed(self, leases: Mapping[str, Lease], gpus: list[GPU]) -> list[InventoryChange]:
        """The cluster changed (a node died or joined): the new inventory; leases on lost GPUs fail."""
        gone = set(self._reported) - {g.id for g in gpus}
        log.info("Ray inventory changed: %d GPU(s) on %d node(s); gone: %s",
                 len(gpus), len({g.node for g in gpus}), ", ".join(sorted(gone)) or "none")
        self._reported = {g.id: g for g in gpus}
        out: list[InventoryChange] = [GpusChanged(tuple(gpus))]
        for lease in leases.values():
            if lease.state in HOLDING and any(d in gone for d in lease.devices):
                nodes = sorted({d.split(":")[1] for d in lease.devices if d in gone})
                out.append(LeaseFailed(lease.id, "node_lost: " + " ".join(nodes)))
        return out

    def close(self) -> None:
        """Disconnect; the detached groups of holding leases stay for the next broker to find."""
        self._asker.shutdown(wait=False)
        if self._ray is not None and self._owns_ray:
            try:
                self._ray.shutdown()
            except Exception:
                pass
