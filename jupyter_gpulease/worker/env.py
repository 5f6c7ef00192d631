"""The environment a worker process starts with, on this host or on a GPU node (Ray actor, Slurm step), and the
directory of a lease's artifacts (``lease_dir``)."""

from __future__ import annotations

import os

from gpulease_protocol.private import private_dir

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


def lease_dir(path: str, mode: int = 0o700) -> str:
    """A lease's artifact directory, made if missing: the artifact root above it as the admin set it up (made with
    the umask's mode if missing: it may be shared), the lease's own directory the user's with ``mode`` (0700, or
    0750 when ``GpuMagics.artifacts_group_readable``), never another user's or a link (``private_dir``)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return private_dir(path, mode)


#: the marker file in a lease's artifact directory that shows a node sees the same directory as the kernel
MARKER = ".gpulease-marker"


def write_marker(directory: str, mode: int = 0o700) -> tuple[str, str]:
    """A new random token in the marker file of the lease directory ``directory`` (made if missing: ``lease_dir``):
    (path, token). A node that reads the same token there sees the kernel's artifact directory."""
    from gpulease_protocol.private import create_private

    path = os.path.join(lease_dir(directory, mode), MARKER)
    token = os.urandom(16).hex()
    tmp = f"{path}.{token[:8]}"
    with os.fdopen(create_private(tmp), "w") as f:
        f.write(token)
    os.replace(tmp, path)
    return path, token


def sees_marker(path: str, token: str) -> bool:
    """Whether this process (on a GPU node) reads ``token`` in the marker file ``path``."""
    from gpulease_protocol.private import UnsafePathError, open_private

    try:
        with os.fdopen(open_private(path), "r") as f:
            return f.read().strip() == token
    except (OSError, UnsafePathError):
        return False
