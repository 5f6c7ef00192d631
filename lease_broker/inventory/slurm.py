"""A Slurm cluster as the inventory and placement layer (the only broker module that runs Slurm's commands).

The GPUs are the ``gpu`` GRES of the partition's nodes (``sinfo``), named ``slurm:<node>:<index>``.
The broker keeps its own queue, policies and timeouts and picks the node(s); a grant then
becomes a Slurm allocation on exactly those nodes::

    salloc --no-shell --job-name=gpulease-<lease> --nodelist=n1[,n2] --nodes=K --ntasks-per-node=1
           --gres=gpu:N (the same count on every node; else --gpus=TOTAL) --time=MINUTES

named after the lease, so that a restarted broker finds it again and ``scancel --name`` reaches
it even while it is pending. ``salloc`` runs in a thread (it blocks while Slurm queues the
job): the lease's placement is ``pending`` until Slurm grants it, then ``ready``, with the
GPU indices Slurm chose on each node (the lease's devices follow them: those are the ones the
job's steps see in ``CUDA_VISIBLE_DEVICES``; the placement's ``bundles``, one per node, say them). The ``%%gpu`` worker runs in the allocation
with ``srun --jobid J --overlap`` (``jupyter_gpulease.executors.slurm``). Ending the lease is
``scancel``; its GPUs drain until Slurm no longer holds them.

Slurm's own word is final and is surfaced in the lease's reason: ``salloc``'s error
(``slurm_refused: ...``), a pending reason that is a limit rather than a wait
(``slurm_refused: job 12 pending (PartitionTimeLimit)``), an allocation still pending after
``placement_timeout``, a node that went down (``node_lost: n2 (...)``; its GPUs leave the
inventory), a job that Slurm ended (time limit, someone's scancel) or forgot.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Mapping
from typing import Any

from traitlets import Bool, List, Unicode, validate

from ..core.gpu import GPU, GpuSample
from ..core.lease import HOLDING, Lease, parse_size
from ..policy.numbers import Float, Size
from . import Inventory
from .changes import InventoryChange
from .slurm_alloc import Changes, SlurmAllocations
from .slurm_cli import Node, SlurmCommands, Snapshot, _per_node, gpu_id
from .slurm_reconcile import SlurmReconciler

log = logging.getLogger("lease_broker")


class SlurmInventory(Inventory):
    kind = "slurm"
    simulated = False

    partition = Unicode(
        "",
        config=True,
        help="Slurm partition whose nodes' GPUs the broker leases (salloc --partition). Empty: the cluster's "
        "default partition. Example: 'gpu'.",
    )
    account = Unicode("", config=True, help="Slurm account charged for the allocations (salloc --account); empty: "
                      "the broker's user's default account. Example: 'notebooks'.")
    job_prefix = Unicode(
        "gpulease",
        config=True,
        help="Allocations are named '<job_prefix>-<lease id>'; a broker adopts or cancels the jobs with its prefix "
        "(its own Slurm user's, or every user's while it submits as them: charge_users) when it starts. Give each broker that shares a cluster its own. Example: 'gl-prod'.",
    )
    charge_users = Bool(
        True,
        config=True,
        help="When the broker runs as root, submit each allocation as the lease's Unix user (salloc --uid/--gid), "
        "so that Slurm's accounting (sacct) and fair share charge the user, not the broker. A user who is not a "
        "Unix user on the broker's host (a JupyterHub identity) is charged to the broker's account. Example: False.",
    )
    salloc_args = List(
        Unicode(),
        config=True,
        help="Extra arguments for every salloc, e.g. ['--qos=interactive', '--constraint=a100']. Default: none.",
    )
    placement_timeout = Float(
        60.0,
        config=True,
        help="Seconds an allocation may stay pending in Slurm (e.g. GPUs busy with jobs from outside the broker) "
        "before the broker cancels it and fails the lease (reason placement_timeout). 0 = wait forever. Example: 60.",
    )
    time_margin_seconds = Float(
        120.0,
        config=True,
        help="Seconds added to a lease's remaining time for the allocation's Slurm time limit (--time, rounded up "
        "to minutes), so that the broker ends the lease before Slurm does. Example: 120.",
    )
    command_timeout = Float(
        30.0,
        positive=True,
        config=True,
        help="Seconds a Slurm command (sinfo, squeue, scontrol, scancel) may take before it counts as failed. "
        "Example: 30.",
    )
    memory = Size(
        "80G",
        config=True,
        help="Memory reported for each GPU (Slurm does not know it; used for `mem=` requests), e.g. '80G'.",
    )

    @validate("job_prefix")
    def _valid_prefix(self, proposal: dict[str, Any]) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,40}", proposal["value"]):
            raise ValueError(f"SlurmInventory.job_prefix={proposal['value']!r}: give 1 to 40 letters, digits, '_.-'")
        return str(proposal["value"])

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.cli = SlurmCommands(self)
        self.changes = Changes()
        self.allocs = SlurmAllocations(self.cli, lambda: self.time_margin_seconds, lambda: self.wake(), self.changes)
        self.reconciler = SlurmReconciler(self.cli, self.allocs, self.changes)
        self._lock = threading.Lock()
        self._gpus: list[GPU] = []
        self._nodes: dict[str, Node] = {}
        self._reported: set[str] = set()  # the GPU ids as the broker last learned them
        self._snapshot: Snapshot | None = None
        self._dirty = False  # discover() saw a different set of GPUs than the broker has
        self._discovered = False
        self._adopted = False

    # ---------------------------------------------------------------- inventory
    def _gpus_of(self, nodes: dict[str, Node]) -> list[GPU]:
        mem = parse_size(self.memory)
        out: list[GPU] = []
        for node in sorted(nodes.values(), key=lambda n: n.name):
            if node.lost or not node.gpus:
                continue
            name = f"Slurm GPU ({node.gpu_type})" if node.gpu_type else "Slurm GPU (gres gpu)"
            out += [GPU(id=gpu_id(node.name, i), index=i, node=node.name, name=name, memory_total=mem,
                        link_group=node.name) for i in range(node.gpus)]
        return out

    def discover(self) -> list[GPU]:
        self.cli.check_setup()
        nodes = self.cli.read_nodes()
        gpus = self._gpus_of(nodes)
        with self._lock:
            self._dirty = self._dirty or (self._discovered and [g.id for g in gpus] != [g.id for g in self._gpus])
            if not self._discovered:
                self._reported = {g.id for g in gpus}  # the broker starts with these
            self._gpus, self._nodes, self._discovered = gpus, nodes, True
        return gpus

    def sample(self) -> dict[str, GpuSample]:
        """Slurm reports no per-GPU use: refresh nodes and jobs (node death, ended jobs); empty samples."""
        started = time.monotonic()
        jobs = self.cli.read_jobs()  # first: a job that failed with its node finds the node down in what follows
        gpus = self.discover()
        with self._lock:
            self._snapshot = Snapshot(started, dict(self._nodes), jobs)
        self.wake()
        return {g.id: GpuSample() for g in gpus}

    def visible_devices(self, gpus: list[GPU]) -> str:
        """Indices on the node, as Slurm counts them; a step in the allocation gets its own from Slurm."""
        return ",".join(str(g.index) for g in gpus)

    def is_drained(self, gpu_id: str, pids: list[int], samples: dict[str, GpuSample]) -> bool:
        """Clean when the lease's local processes (if any) are gone and Slurm no longer holds the GPU."""
        return super().is_drained(gpu_id, pids, samples) and not self.allocs.freeing(gpu_id)

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "simulated": False,
            "engine": "slurm",
            "cluster": self.cli.cluster,
            "partition": self.cli.partition,
            "nodes": len([n for n in self._nodes.values() if n.gpus]),
            "job_prefix": self.job_prefix,
        }

    def placement(self, lease: Lease) -> dict[str, Any] | None:
        alloc = self.allocs.allocs.get(lease.id)
        if alloc is None or lease.state not in HOLDING:
            return None
        nodes = alloc.nodes or [{"node": n, "gpus": c, "indices": None} for n, c in _per_node(lease.devices).items()]
        bundles = [{"index": i, **n} for i, n in enumerate(nodes)]  # one per node, as Ray's placement says it
        return {
            "kind": "slurm",
            "cluster": self.cli.cluster,
            "partition": self.cli.partition,
            "job_name": alloc.name,
            "job_id": alloc.job_id or None,
            "state": alloc.state,
            "time_limit_minutes": alloc.time_limit,
            "bundles": bundles,
        }

    # ---------------------------------------------------------------- the lease owner's calls
    def on_grant(self, lease: Lease, now: float) -> None:
        try:
            self.allocs.allocate(lease, now)
        except Exception:
            log.exception("Lease %s: Slurm placement failed", lease.id)

    def on_renew(self, lease: Lease, now: float) -> None:
        self.allocs.extend(lease, now)

    def on_end(self, lease: Lease) -> None:
        super().on_end(lease)
        self.allocs.end(lease.id)

    def reconcile(self, leases: Mapping[str, Lease], now: float) -> list[InventoryChange]:
        """Called on every tick (and when a thread has a result): allocations for holding leases, none for others,
        deadlines, nodes, ended jobs."""
        if not self._adopted:
            self._adopted = True
            self.reconciler.adopt(leases, now)
        self.allocs.apply_results(leases, self._reported)
        with self._lock:
            snap, self._snapshot = self._snapshot, None
            gpus = list(self._gpus) if self._dirty else None
            self._dirty = False
        if snap is not None:
            self.reconciler.apply_snapshot(leases, snap, self._reported, gpus)
            if gpus is not None:
                self._reported = {g.id for g in gpus}
        elif gpus is not None:  # no snapshot yet to apply it with: later
            with self._lock:
                self._dirty = True
        self.reconciler.check_pending(self.placement_timeout)
        return self.changes.take()

    def close(self) -> None:
        """Nothing to disconnect; allocations of holding leases stay for the next broker to find."""
