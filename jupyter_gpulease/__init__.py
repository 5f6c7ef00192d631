"""jupyter-gpulease: the notebook cell, not the notebook, holds the GPU.

- ``%load_ext jupyter_gpulease`` registers the ``%%gpu`` and ``%gpu`` magics (``kernel/``: magics, cell runs,
  sessions, the Python API ``lease``, ``on_gpu``, ``map``).
- ``executors/`` start a cell's worker where the lease's GPUs are (this host, Ray, Slurm); ``worker/`` is the
  worker process itself (it never imports IPython).
- ``cli/`` is the ``gpulease`` command; ``serverext/`` the Jupyter server extension that proxies the broker
  to the sidebar.
- ``jupyter_gpulease.client.BrokerClient`` is the one way this package talks to the broker; it never imports
  ``lease_broker``. What both sides agree on is in ``gpulease_protocol``.
"""

from __future__ import annotations

__version__ = "0.1.0"


def load_ipython_extension(ipython: object) -> None:
    from .kernel.magics import load_ipython_extension as _load

    _load(ipython)


def unload_ipython_extension(ipython: object) -> None:
    from .kernel.magics import unload_ipython_extension as _unload

    _unload(ipython)


def _jupyter_server_extension_points() -> list[dict[str, object]]:
    # The app (an ExtensionApp) gives the extension a shutdown hook, which stops an embedded broker.
    from .serverext import _jupyter_server_extension_points as points

    return points()


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    return [{"src": "labextension", "dest": "jupyter-gpulease"}]


def preempting() -> bool:
    """In a ``%%gpu`` cell (or a function run on a lease): whether the broker warned that a higher priority
    class is taking this lease's GPUs. Save a checkpoint and finish before the grace period ends."""
    import os

    return os.environ.get("GPULEASE_PREEMPTING") == "1"


def __getattr__(name: str) -> object:
    # The Python API (lease, on_gpu, map) is imported lazily so `import jupyter_gpulease` stays cheap.
    if name in ("lease", "on_gpu", "map", "Lease"):
        from .kernel import api

        return getattr(api, name)
    raise AttributeError(f"module 'jupyter_gpulease' has no attribute {name!r}")
