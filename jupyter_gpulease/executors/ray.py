"""The Ray executor: a ``%%gpu`` cell's worker as a Ray actor in the lease's placement group.

When the broker's inventory is a Ray cluster, a grant is a placement group on the node(s)
that hold the GPUs (the lease view's ``placement``). The kernel then starts one actor
(``num_cpus=0``, the bundle's GPUs) in that group; the actor starts the same worker process
a local run uses (``python -m jupyter_gpulease.worker``) in its own process group with
``CUDA_VISIBLE_DEVICES`` set to the GPUs Ray assigned, relays the framed job and result
messages and hands back its output as it comes (the kernel polls an actor method). When the
actor dies (the lease ended and the broker removed the group, or the kernel killed it), the
worker's stdin closes and the worker kills its own process group.

Values over 1 MiB travel out of band as files: here in ``<lease artifact dir>/.oob``, which
must be a path both nodes see (a shared artifact root), not the kernel's /dev/shm.

The only module on the notebook side that imports ``ray`` (lazily: importing this module
does not need it).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from typing import TYPE_CHECKING, Any

from ..wire import transfer
from ..worker.env import worker_env
from .base import OutputDecoder, PlacedExecutor, RelayedWorker, Sink, WorkerCrashed, inputs_on_shared_storage

if TYPE_CHECKING:
    from ..client import LeaseView

DEFAULT_START_TIMEOUT = PlacedExecutor.env_timeout("ray")  # seconds for the actor to start
_SEQ = itertools.count(1)


def worker_name(lease_id: str) -> str:
    """The actor's name in the broker's namespace: ``gpulease-<lease>-w<kernel pid>-<n>`` (the broker and
    ``ray list actors`` find a lease's workers by it; the broker's own module names the same prefix)."""
    return f"gpulease-{lease_id}-w{os.getpid()}-{next(_SEQ)}"


class CellProcess:
    """The actor (runs on the GPU node): owns the worker process and its pipes."""

    def __init__(self, python: str, args: list[str], env: dict[str, str]) -> None:
        import ray

        ids = ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
        self.visible = ",".join(str(i) for i in ids)
        r, w = os.pipe()
        where = {"GPULEASE_NODE_IP": ray.util.get_node_ip_address(),
                 "GPULEASE_RAY_ACTOR_ID": ray.get_runtime_context().get_actor_id() or ""}
        full = worker_env({**env, **where, "GPULEASE_CTRL_FD": str(w), "CUDA_VISIBLE_DEVICES": self.visible})
        try:
            self.proc = subprocess.Popen(
                [python or sys.executable, "-m", "jupyter_gpulease.worker", *args], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(w,), env=full, start_new_session=True,
                close_fds=True,
            )
        finally:
            os.close(w)
        self.events: queue.Queue[tuple[int, bytes]] = queue.Queue()
        self._open = 3
        assert self.proc.stdout is not None and self.proc.stderr is not None
        for fd, tag in ((self.proc.stdout.fileno(), 1), (self.proc.stderr.fileno(), 2), (r, 3)):
            threading.Thread(target=self._pump, args=(fd, tag), daemon=True, name=f"gpulease-pump-{tag}").start()

    def _pump(self, fd: int, tag: int) -> None:
        while True:
            try:
                data = os.read(fd, 1 << 16)
            except OSError:
                data = b""
            self.events.put((tag, data))
            if not data:
                if tag == 3:
                    os.close(fd)
                return

    def info(self) -> dict[str, Any]:
        import ray

        return {"pid": self.proc.pid, "node_ip": ray.util.get_node_ip_address(), "hostname": socket.gethostname(),
                "cuda_visible_devices": self.visible, "actor_pid": os.getpid()}

    def submit(self, job: dict[str, Any]) -> None:
        job = dict(job)
        job["env"] = {**(job.get("env") or {}), "CUDA_VISIBLE_DEVICES": self.visible}
        assert self.proc.stdin is not None
        transfer.send(self.proc.stdin, job)

    def poll(self, timeout: float) -> tuple[list[tuple[int, bytes]], int | None, int]:
        """What the worker wrote since the last call (waiting up to ``timeout`` for something), its exit
        status (None while it runs) and how many of its pipes are still open."""
        out: list[tuple[int, bytes]] = []
        if self._open:
            try:
                out.append(self.events.get(timeout=timeout))
            except queue.Empty:
                pass
            while True:
                try:
                    out.append(self.events.get_nowait())
                except queue.Empty:
                    break
            self._open -= sum(1 for _, data in out if not data)
        return out, (self._wait(5.0) if not self._open else self.proc.poll()), self._open

    def _wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def kill(self, grace: float) -> int | None:
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            self.signal(sig)
            if self._wait(wait) is not None:
                break
        self.signal(signal.SIGKILL)  # what is left of the group (the cell's own children)
        return self.proc.returncode

    def wait(self, timeout: float) -> int | None:
        return self._wait(timeout)


def _connect(placement: dict[str, Any]) -> Any:
    import ray

    if not ray.is_initialized():
        extra: dict[str, Any] = {"_node_ip_address": os.environ["GPULEASE_RAY_NODE_IP"]} if os.environ.get("GPULEASE_RAY_NODE_IP") else {}
        ray.init(address=placement["address"], namespace=placement.get("namespace"), log_to_driver=False,
                 configure_logging=False, **extra)
    return ray


class RayWorker(RelayedWorker):
    """Kernel side: the Worker interface, for a worker that runs in a Ray actor."""

    local = False  # not a process of this host: nothing to attach to the lease by pid

    def __init__(self, placement: dict[str, Any], python: str | None = None, preload: list[str] | None = None,
                 session: bool = False, bundle: int = 0, lease_id: str = "", start_timeout: float = DEFAULT_START_TIMEOUT) -> None:
        self.start_timeout = start_timeout
        ray = _connect(placement)
        from ray._raylet import PlacementGroupID
        from ray.util.placement_group import PlacementGroup
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pg = PlacementGroup(PlacementGroupID(bytes.fromhex(placement["placement_group_id"])))
        gpus = float(placement["bundles"][bundle].get("gpus", 1))
        args = (["--session"] if session else []) + (["--preload", ",".join(preload)] if preload else [])
        env = {k: v for k, v in os.environ.items() if k.startswith(("GPULEASE_", "PYTHON"))}
        # the cell may use the rest of its gang (the group's other bundles, on other nodes) through Ray itself
        env.update({"GPULEASE_RAY_ADDRESS": str(placement.get("address") or ""),
                    "GPULEASE_RAY_NAMESPACE": str(placement.get("namespace") or ""),
                    "GPULEASE_RAY_PLACEMENT_GROUP_ID": placement["placement_group_id"],
                    "GPULEASE_RAY_BUNDLE": str(bundle), "GPULEASE_RAY_BUNDLES": str(len(placement["bundles"]))})
        self.name = worker_name(lease_id or placement.get("placement_group", "gpulease-?")[len("gpulease-"):])
        # owned by the kernel (not detached): a kernel that dies takes its workers with it; the lease's
        # group, owned by the broker, is what outlives a broker restart
        self.actor = (
            ray.remote(CellProcess)
            .options(num_cpus=0, num_gpus=gpus, max_restarts=0, max_concurrency=4, name=self.name,
                     namespace=placement.get("namespace"),
                     scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle))
            .remote(python or sys.executable, args, env)
        )
        try:
            self.info: dict[str, Any] = ray.get(self.actor.info.remote(), timeout=self.start_timeout)
        except Exception:
            ray.kill(self.actor)
            raise
        self.pid: int = self.info["pid"]
        self.ready: dict[str, Any] | None = None
        self._frames = transfer.FrameReader()
        self._results: list[dict[str, Any]] = []
        self._stderr_tail = b""
        self._decoders = {1: OutputDecoder(), 2: OutputDecoder()}
        self._returncode: int | None = None
        self._done = False  # every pipe closed
        self._dead = ""  # the actor itself is gone: why

    # ---------------------------------------------------------------- state
    def alive(self) -> bool:
        return not self._done and not self._dead and self._returncode is None

    @property
    def returncode(self) -> int | None:
        return self._returncode

    def submit(self, job: dict[str, Any]) -> None:
        import ray

        job = inputs_on_shared_storage(job, (job.get("env") or {}).get("GPULEASE_ARTIFACTS"))
        ray.get(self.actor.submit.remote(job), timeout=self.start_timeout)

    # ---------------------------------------------------------------- output
    def _ended(self) -> bool:
        return bool(self._done or self._dead)

    def _crashed(self) -> WorkerCrashed:
        return WorkerCrashed(self._returncode, self._tail())

    def _fetch(self, timeout: float, out: Sink, err: Sink) -> int:
        """Relay what the actor has; returns how many chunks of output (stdout/stderr) it brought."""
        import ray

        try:
            events, code, still_open = ray.get(self.actor.poll.remote(timeout), timeout=timeout + self.start_timeout)
        except Exception as e:  # RayActorError: the actor (and so the worker) is gone
            self._dead = f"its Ray actor died ({type(e).__name__})"
            self._stderr_tail += f"\n[gpulease] the worker's Ray actor is gone: {e}".encode()[:1000]
            return 0
        chunks = 0
        for tag, data in events:
            if not data:
                continue
            if tag == 3:
                for msg in self._frames.feed(data):
                    if msg.get("type") == "ready":
                        self.ready = msg
                    else:
                        self._results.append(msg)
                continue
            if tag == 2:
                self._stderr_tail = (self._stderr_tail + data)[-4000:]
            chunks += 1
            text = self._decoders[tag].decode(data)
            if text:
                (out if tag == 1 else err)(text)
        if not still_open:  # every pipe closed: the worker is gone
            self._returncode, self._done = code, True
        return chunks

    def _tail(self) -> str:
        return self._stderr_tail.decode(errors="replace")

    def drain(self, out: Sink, err: Sink) -> None:
        if not self._done and not self._dead:
            self._fetch(0.0, out, err)

    # ---------------------------------------------------------------- stopping
    def interrupt(self) -> None:
        with contextlib.suppress(Exception):
            self.actor.signal.remote(int(signal.SIGINT))

    def kill(self, grace: float = 2.0) -> None:
        import ray

        with contextlib.suppress(Exception):
            self._returncode = ray.get(self.actor.kill.remote(grace), timeout=grace + self.start_timeout)
        self.close()

    def wait_exit(self, timeout: float = 5.0) -> int | None:
        import ray

        if self._returncode is None and not self._dead:
            with contextlib.suppress(Exception):
                self._returncode = ray.get(self.actor.wait.remote(timeout), timeout=timeout + self.start_timeout)
            if self._returncode is None:
                self.kill(0.5)
        return self._returncode

    def close(self) -> None:
        """Kill the actor: its GPUs go back to the lease's group; the worker's lifeline closes."""
        import ray

        self._done = True
        with contextlib.suppress(Exception):
            ray.kill(self.actor)


class RayExecutor(PlacedExecutor):
    """Workers for leases the broker placed with Ray (the lease view's ``placement.kind`` is ``ray``):
    an actor in the Ray placement group that holds the lease's GPUs."""

    kind = "ray"

    def worker(self, lease: LeaseView, python: str | None, preload: list[str] | None,
               session: bool) -> RayWorker:
        assert lease.placement is not None
        return RayWorker(lease.placement, python, preload, session=session, lease_id=lease.id, start_timeout=self.start_timeout)
