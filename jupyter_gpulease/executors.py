"""Which executor runs a ``%%gpu`` cell's worker: chosen by where the broker placed the lease.

A lease view's ``placement`` names the engine that holds its GPUs (``ray``, ``slurm``); the
matching module starts the worker there. No placement: the worker runs on this host (the
warm pool). Each engine's module is imported only when a lease needs it.
"""

from __future__ import annotations

import importlib
from typing import Any

from .runner import Worker

#: placement kind -> module with ``executor_for(lease, python, session)``
EXECUTORS = {"ray": "jupyter_gpulease.ray_worker", "slurm": "jupyter_gpulease.slurm_worker"}


def executor_for(lease: dict[str, Any], python: str | None = None, session: bool = False) -> Worker | None:
    """A worker on the lease's GPU node when another engine placed it; None: run locally."""
    kind = (lease.get("placement") or {}).get("kind")
    module = EXECUTORS.get(kind or "")
    if module is None:
        return None
    return importlib.import_module(module).executor_for(lease, python, session=session)  # type: ignore[no-any-return]
