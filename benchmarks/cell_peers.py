"""The peers a ``%%gpu`` cell is measured against, started inside the same kernel: ipyparallel's ``%%px`` on one
warm engine, and a local Ray task with ``num_gpus=1``.

Each peer is a set of cells run in the benchmark's kernel, so a round of the benchmark runs ``%%gpu``, ``%%px``
and Ray one after the other through the same kernel and jupyter_client (drift hits them all alike). A peer that
cannot run here (not installed: ``make bench`` installs the ``bench`` extra) is reported as missing, with why.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import Any, Protocol


class KernelLike(Protocol):
    def run(self, code: str, timeout: float = 600) -> float: ...


@dataclass
class Peer:
    name: str
    setup: str  # run once in the kernel (starts the engine or the cluster, defines the cells below)
    trivial: str  # a cell that does nothing, remotely
    transfer: str  # the kernel's x in, y = x + 1 there, y back into the kernel
    stop: str
    module: str  # what must be importable
    reset: str = "y = None"  # before a transfer: drop the previous round's copies (unmeasured)

    def missing(self) -> str:
        """Why this peer cannot run here ('' when it can)."""
        import importlib.util

        if importlib.util.find_spec(self.module) is None:
            return f"{self.module} is not installed (make bench installs the bench and ray extras)"
        return ""


PX = Peer(
    name="ipyparallel %%px, one warm engine",
    setup="import ipyparallel as _ipp\n"
          "_px_cluster = _ipp.Cluster(n=1, log_level=40)\n"
          "_px = _px_cluster.start_and_connect_sync(activate=True)\n"
          "_px.wait_for_engines(1, timeout=120)\n"
          "_px_view = _px[0]\n",
    trivial="%%px\npass",
    transfer="_px_view.push({'x': x}, block=True)\n_px_view.execute('y = x + 1', block=True)\n"
             "y = _px_view.pull('y', block=True)",
    stop="_px.close()\n_px_cluster.stop_cluster_sync()",
    module="ipyparallel",
    reset="y = None\n_px_view.execute('x = y = None', block=True)",
)


def ray_peer(temp_dir: str, store_bytes: int) -> Peer:
    """A local Ray instance of its own (never a cluster some other process started), declaring one GPU."""
    return Peer(
        name="Ray task, num_gpus=1, local",
        setup="import os as _os, ray as _ray\n"
              "_hidden = _os.environ.pop('CUDA_VISIBLE_DEVICES', None)  # the extension hides GPUs from the kernel\n"
              f"_ray.init(address='local', _temp_dir={temp_dir!r}, num_cpus=1, num_gpus=1, include_dashboard=False,"
              f" object_store_memory={store_bytes}, log_to_driver=False, configure_logging=False)\n"
              "_os.environ['CUDA_VISIBLE_DEVICES'] = _hidden or ''\n"
              "@_ray.remote(num_gpus=1)\n"
              "def _ray_cell(x=None):\n"
              "    return None if x is None else x + 1\n"
              "_ray.get(_ray_cell.remote())\n",
        trivial="_ray.get(_ray_cell.remote())",
        transfer="y = _ray.get(_ray_cell.remote(x))",
        stop="_ray.shutdown()",
        module="ray",
    )


RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}


def start(k: KernelLike, peers: list[Peer]) -> dict[str, str]:
    """Start each peer in the kernel; returns {name: why it is missing} for those that could not start."""
    missing = {}
    for p in peers:
        why = p.missing()
        if not why:
            try:
                k.run(p.setup, timeout=300)
            except Exception as e:
                why = f"did not start: {e}"
        if why:
            missing[p.name] = why
    return missing


def stop(k: KernelLike, peers: list[Peer]) -> None:
    for p in peers:
        try:
            k.run(p.stop, timeout=60)
        except Exception:
            pass


def kill_leftovers(marker: str) -> list[int]:
    """SIGKILL this run's own processes that outlived their kernel (an interrupted run): those whose command line
    or environment names ``marker``, the run's temporary directory (the kernel's children inherit its IPYTHONDIR
    and GPULEASE_BROKER; Ray's processes name their temporary directory)."""
    killed = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f, open(f"/proc/{pid}/environ", "rb") as e:
                if marker.encode() not in f.read() + e.read():
                    continue
            os.kill(int(pid), signal.SIGKILL)
            killed.append(int(pid))
        except OSError:
            continue
    return killed


def env(ipython_dir: str) -> dict[str, Any]:
    """For the kernel: its own IPython profile (ipyparallel's connection files land there), Ray's defaults off."""
    return {"IPYTHONDIR": ipython_dir, **RAY_ENV}
