"""Executors: where a ``%%gpu`` cell's worker runs, chosen by where the broker placed the lease.

A lease view's ``placement`` names the engine that holds its GPUs (``ray``, ``slurm``); no placement
means this host (``local``). An executor is a small configurable class (``base.Executor``) chosen by
that name through entry points (group ``jupyter_gpulease.executors``); it starts a ``base.Worker``,
the one interface the kernel drives. Each engine's module is imported only when a lease needs it, and
this ``__init__`` imports nothing: the Slurm relay (``python -m jupyter_gpulease.executors.slurm_relay``)
starts on the GPU node without the kernel side.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .base import Executor


def placement_kind(placement: dict[str, Any] | None) -> str:
    """The executor a lease needs, by its view's ``placement``: the engine that placed it (``ray``, ``slurm``), else
    ``local`` (this host). The one rule for the magics and the Python API."""
    return str((placement or {}).get("kind") or "local")


def executor_class(name: str) -> type[Executor]:
    """The executor class for leases placed by ``name``: an entry point of ``jupyter_gpulease.executors`` (ours are
    registered in ``pyproject.toml``) or ``module:Class``; an unknown name is refused naming those installed."""
    from gpulease_protocol.entry_points import EntryPointType

    from .base import Executor

    return EntryPointType(klass=Executor, group="jupyter_gpulease.executors").load(name)
