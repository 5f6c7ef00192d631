"""The environment a worker process starts with, on this host or on a GPU node (Ray actor, Slurm step)."""

from __future__ import annotations

import os

# What a worker must not inherit from a kernel (see notes: unbuffered output splits
# every print, the inline matplotlib backend does not exist outside the kernel).
_DROP_ENV = ("PYTHONUNBUFFERED", "MPLBACKEND", "JPY_PARENT_PID", "JPY_SESSION_NAME", "PYDEVD_USE_FRAME_EVAL",
             "FORCE_COLOR", "CLICOLOR", "CLICOLOR_FORCE", "TERM")


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without what a worker must not inherit, no GPU visible, and ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in _DROP_ENV}
    env["MPLBACKEND"] = "Agg"
    env["CUDA_VISIBLE_DEVICES"] = ""  # nothing visible until a lease says which GPUs
    env.update(extra or {})
    return env
