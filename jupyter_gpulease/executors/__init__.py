"""Executors: where a ``%%gpu`` cell's worker runs, chosen by where the broker placed the lease.

A lease view's ``placement`` names the engine that holds its GPUs (``ray``, ``slurm``); no placement
means this host (``local``). An executor is a small configurable class (``base.Executor``) chosen by
that name through entry points (group ``jupyter_gpulease.executors``); it starts a ``base.Worker``,
the one interface the kernel drives. Each engine's module is imported only when a lease needs it, and
this ``__init__`` imports nothing: the Slurm relay (``python -m jupyter_gpulease.executors.slurm_relay``)
starts on the GPU node without the kernel side.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .base import Executor

ENTRY_POINT_GROUP = "jupyter_gpulease.executors"

_BUILTIN = {"local": "jupyter_gpulease.executors.local:LocalExecutor",
            "ray": "jupyter_gpulease.executors.ray:RayExecutor",
            "slurm": "jupyter_gpulease.executors.slurm:SlurmExecutor"}


def executor_class(name: str) -> type[Executor]:
    """Load an executor class: a built-in name, another entry-point name, or ``module:Class``.

    Built-in names are resolved without reading the installed packages' entry points (that costs ~40 ms).
    """
    import importlib

    from .base import Executor

    if ":" in name:
        mod, _, attr = name.partition(":")
        cls = getattr(importlib.import_module(mod), attr)
    elif name in _BUILTIN:
        return executor_class(_BUILTIN[name])
    else:
        from importlib.metadata import entry_points

        eps = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
        if name not in eps:
            choices = ", ".join(sorted(set(eps) | set(_BUILTIN)))
            raise ValueError(f"No executor for leases placed by {name!r}: installed are {choices}")
        cls = eps[name].load()
    if not (isinstance(cls, type) and issubclass(cls, Executor)):
        raise ValueError(f"Executor {name!r} is not an Executor subclass")
    return cls
