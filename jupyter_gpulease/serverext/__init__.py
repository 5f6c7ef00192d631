"""Jupyter server extension: the GPU lease broker for JupyterLab under ``{base_url}/gpulease/``.

- ``/gpulease/api/(info|gpus|queue|leases|leases/ID[/release|renew|revoke|history])``: the broker's REST API,
  called as the server's user.
- ``/gpulease/api/status``: which broker, and whether it is the embedded one; ``/gpulease/api/artifacts``:
  recent lease artifact directories.
- ``/gpulease/events``: a websocket relaying the broker's event stream.
"""

from __future__ import annotations

from typing import Any

from .app import GpuLease


def _jupyter_server_extension_points() -> list[dict[str, Any]]:
    return [{"module": "jupyter_gpulease.serverext", "app": GpuLease}]


_load_jupyter_server_extension = GpuLease._load_jupyter_server_extension

__all__ = ["GpuLease"]
