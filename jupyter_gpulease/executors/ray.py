"""The Ray executor: a ``%%gpu`` cell's worker as a Ray actor in the lease's placement group.

When the broker's inventory is a Ray cluster, a grant is a placement group on the node(s)
that hold the GPUs (the lease view's ``placement``). The kernel then starts one actor
(``num_cpus=0``, the bundle's GPUs) in that group; the actor starts the same worker process
a local run uses (``python -m jupyter_gpulease.worker``) in its own process group with
``CUDA_VISIBLE_DEVICES`` set to the GPUs Ray assigned, relays the framed job and result
messages and hands back its output as it comes (the kernel polls an actor method). When the
actor dies (the lease ended and the broker removed the group, or the kernel killed it), the
worker's stdin closes and the worker kills its own process group.

A single-use cell instead borrows a pre-started worker from the node's warm host (``WarmHost``,
``RayExecutor.warm``): a detached actor outside every group that all kernels share, started by the first kernel that
needs it on the node and found by name by the others (``WarmActors``), so that a kernel's first cell there starts no
Ray worker process of its own job (seconds of a new Python's ``import ray``). The worker runs with the GPU IDs Ray
assigned in the lease's group, which the broker learns once the group is placed and the lease view carries
(``placement.bundles[i].gpu_ids``; where absent, a task in the group: ``gpulease_protocol.ray_ids``); the host
watches the group while the worker is lent and kills the worker's process group once the group is removed.

Values over 1 MiB travel out of band as files in ``<lease artifact dir>/.oob`` where the node sees the
kernel's artifact root (the marker check, ``base.RootCheck``); elsewhere through Ray's object store: in the
job (the actor writes them to one file in its node's /dev/shm for the worker) and in the actor's replies.

The only module on the notebook side that imports ``ray`` (lazily: importing this module
does not need it).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from traitlets import Bool, Unicode, default

from gpulease_protocol.ray_ids import gpu_ids, in_bundle

from ..wire import transfer
from ..worker.env import sees_marker, worker_env
from .base import (
    CTRL,
    ENDED,
    STDERR,
    STDOUT,
    OutputDecoder,
    PlacedExecutor,
    RelayedWorker,
    RootCheck,
    Sink,
    WorkerCrashed,
)
from .ray_lazy_import import cell_pythonpath, defer_iri_grammar

if TYPE_CHECKING:
    from ..client import LeaseView

DEFAULT_START_TIMEOUT = PlacedExecutor.env_timeout("ray")  # seconds for the actor to start
DEFAULT_CALL_TIMEOUT = PlacedExecutor.env_call_timeout("ray")  # seconds for any one call to a started actor
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
        self._start(python, args, env)

    def _start(self, python: str, args: list[str], env: dict[str, str]) -> None:
        """Start a worker process (``self.proc``) with fresh pipes and pumps."""
        import ray

        r, w = os.pipe()
        where = {"GPULEASE_NODE_IP": ray.util.get_node_ip_address(),
                 "GPULEASE_RAY_ACTOR_ID": ray.get_runtime_context().get_actor_id() or ""}
        full = worker_env({**env, **where, "GPULEASE_CTRL_FD": str(w), "CUDA_VISIBLE_DEVICES": self.visible})
        if full.get("PYTHONPATH"):  # the node's Ray worker site directory (ray_lazy_import) is the actor's only
            full["PYTHONPATH"] = cell_pythonpath(full["PYTHONPATH"])
        python = python or sys.executable
        self.error = ""
        if not os.access(python, os.X_OK):  # said in one line by info(), not as the actor's death
            os.close(r)
            os.close(w)
            self.error = (f"the worker's interpreter {python} does not exist on node {where['GPULEASE_NODE_IP']}: "
                          "install the same Python environment at the same path on every GPU node, or point "
                          "GpuMagics.worker_python at one that is there")
            return
        try:
            self.proc = subprocess.Popen(
                [python, "-m", "jupyter_gpulease.worker", *args], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(w,), env=full, start_new_session=True,
                close_fds=True,
            )
        finally:
            os.close(w)
        # each worker its own queue: the pumps of a warm actor's previous worker never feed the next one's
        self.events: queue.Queue[tuple[int, bytes]] = queue.Queue()
        self._open = 3
        self._kept: list[tuple[int, int, bytes]] = []  # events taken from the queue, numbered, not yet taken by the kernel
        self._seq = 0
        # the kernel's calls may overlap (one that an interrupt cut short waits on): the next waits for it
        self._polling = threading.Lock()
        assert self.proc.stdout is not None and self.proc.stderr is not None
        for fd, tag in ((self.proc.stdout.fileno(), STDOUT), (self.proc.stderr.fileno(), STDERR), (r, CTRL)):
            threading.Thread(target=self._pump, args=(fd, tag, self.events), daemon=True,
                             name=f"gpulease-pump-{tag}").start()

    @staticmethod
    def _pump(fd: int, tag: int, events: queue.Queue[tuple[int, bytes]]) -> None:
        while True:
            try:
                data = os.read(fd, 1 << 16)
            except OSError:
                data = b""
            events.put((tag, data))
            if not data:
                if tag == CTRL:
                    os.close(fd)
                return

    def sees(self, path: str, token: str) -> bool:
        """Whether this node sees the kernel's artifact directory (the marker check: ``base.RootCheck``)."""
        return sees_marker(path, token)

    def info(self) -> dict[str, Any]:
        import ray

        if self.error:
            return {"error": self.error}
        return {"pid": self.proc.pid, "node_ip": ray.util.get_node_ip_address(), "hostname": socket.gethostname(),
                "cuda_visible_devices": self.visible, "actor_pid": os.getpid()}

    def submit(self, job: dict[str, Any]) -> None:
        job = dict(job)
        job["env"] = {**(job.get("env") or {}), "CUDA_VISIBLE_DEVICES": self.visible}
        inputs = job.get("inputs")
        if inputs and inputs.get("inline") is not None:  # values Ray brought to this node: one file, mapped there
            path, spans = transfer.write_buffers([memoryview(b) for b in inputs["inline"]])
            job["inputs"] = {**inputs, "inline": None, "file": path, "spans": spans}
        assert self.proc.stdin is not None
        transfer.send(self.proc.stdin, job)

    def poll(self, timeout: float, after: int = 0) -> tuple[list[tuple[int, int, bytes]], int | None, int]:
        """What the worker wrote that the kernel has not taken: the events numbered after ``after`` (the last the
        kernel took; those up to it are forgotten), waiting up to ``timeout`` for one if there are none; the worker's
        exit status (None while it runs) and how many of its pipes are still open.

        An event stays here until the kernel's next call says it was taken: an interrupt can cut the kernel's wait for
        an answer short while the call runs on here, and what that call took (the cell's answer to the interrupt)
        comes again with the next one (``test_ray_interrupted_wait_loses_nothing_the_relay_was_bringing``)."""
        with self._polling:  # one at a time: the events are numbered in the order the worker's pipes gave them
            self._kept = [e for e in self._kept if e[0] > after]
            if not self._kept and self._open:
                try:
                    self._take(*self.events.get(timeout=timeout))
                except queue.Empty:
                    pass
                while True:
                    try:
                        self._take(*self.events.get_nowait())
                    except queue.Empty:
                        break
            kept, still_open = list(self._kept), self._open
        return kept, (self._wait(5.0) if not still_open else self.proc.poll()), still_open

    def _take(self, tag: int, data: bytes) -> None:
        self._seq += 1
        self._kept.append((self._seq, tag, data))
        if not data:
            self._open -= 1

    def _wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def signal(self, sig: int) -> None:
        self._signal(sig)

    def _signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if sig == signal.SIGINT:  # like a local run: to the worker only (it raises KeyboardInterrupt)
                os.kill(self.proc.pid, sig)
            else:
                os.killpg(self.proc.pid, sig)

    def kill(self, grace: float) -> int | None:
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            self._signal(sig)
            if self._wait(wait) is not None:
                break
        self._signal(signal.SIGKILL)  # what is left of the group (the cell's own children)
        return self.proc.returncode

    def wait(self, timeout: float) -> int | None:
        return self._wait(timeout)


WATCH_SECONDS = 0.1
#: how long the host keeps a loan whose worker has exited and whose kernel has not called for it (a kernel that died
#: with a worker lent: its lease's end stopped the worker, and nobody releases the loan)
STALE_SECONDS = 60.0
#: the host's calls as this package makes them: a host that another version left running (it is detached: it
#: outlives kernels and upgrades) is not reused, its name carries it
HOST_VERSION = 2


class WarmHost:
    """The warm worker host of one GPU node and interpreter: a detached Ray actor that every kernel on the cluster
    shares. It holds one pre-started single-use worker and lends it to a cell, then starts the next one, so that a
    cell pays for neither an actor nor an interpreter start, and a kernel's first cell on a node needs no Ray worker
    process of the kernel's own job (a new Python's ``import ray``: seconds; bench:warm_ray).

    It lives outside every lease's placement group (no CPUs or GPUs of its own, pinned to its node), started by the
    first kernel that needs it and found by name by the next (``get_if_exists``); no kernel owns it. A cell ``claim``s
    a worker with its lease's group and the GPU IDs Ray assigned in it (the lease view's, from the broker; else the
    kernel asks the group); while it is lent, a thread watches the group and kills the worker's process group once
    the group is removed (the lease ended: released, revoked, expired, or its kernel died and the broker ended it), as
    Ray kills an actor in it. ``release`` ends the loan. Every call a cell makes names its claim: a stale handle never
    reaches another cell's worker. The workers start with the node's environment and the interpreter's ``PYTHON*``
    settings (the host's key) only; a kernel's own settings come with each job."""

    def __init__(self, python: str, env: dict[str, str]) -> None:
        self._spec = (python, env)
        self._lock = threading.Lock()
        self._claims = itertools.count(1)
        self._loans: dict[int, tuple[CellProcess, threading.Event, list[float]]] = {}  # claim -> worker, stop, last call
        self._idle: CellProcess | None = self._new()

    def _new(self) -> CellProcess:
        worker = CellProcess.__new__(CellProcess)  # (not an actor: one of this actor's worker processes)
        worker.visible = ""
        worker._start(self._spec[0], [], self._spec[1])
        return worker

    def claim(self, placement_group_id: str, visible: str) -> dict[str, Any]:
        """Lend a worker to a cell of the lease whose group is ``placement_group_id``, with ``visible`` GPUs: its
        info and ``claim`` (the number its calls name); the next worker starts in the background."""
        with self._lock:
            self._purge()
            worker, self._idle = self._idle, None
            if worker is None or (not worker.error and worker.proc.poll() is not None):  # none, or it died waiting
                worker = self._new()
            if worker.error:
                self._idle = worker
                return worker.info()
            claim = next(self._claims)
            worker.visible = visible
            stop = threading.Event()
            self._loans[claim] = (worker, stop, [time.monotonic()])
        threading.Thread(target=self._watch, args=(claim, placement_group_id, stop), daemon=True,
                         name="gpulease-watch").start()
        threading.Thread(target=self._refill, daemon=True, name="gpulease-refill").start()
        return {**worker.info(), "claim": claim}

    def _refill(self) -> None:
        with self._lock:
            if self._idle is None:
                self._idle = self._new()

    def _purge(self) -> None:
        """Forget loans whose worker exited and whose kernel stopped calling (it died: nobody releases them)."""
        now = time.monotonic()
        for claim, (worker, stop, last) in list(self._loans.items()):
            if worker.proc.poll() is not None and now - last[0] > STALE_SECONDS:
                stop.set()
                del self._loans[claim]

    def _watch(self, claim: int, placement_group_id: str, stop: threading.Event) -> None:
        from ray._raylet import PlacementGroupID
        from ray.util.placement_group import PlacementGroup, placement_group_table

        pg = PlacementGroup(PlacementGroupID(bytes.fromhex(placement_group_id)))
        while not stop.wait(WATCH_SECONDS):
            try:
                removed = placement_group_table(pg).get("state") == "REMOVED"
            except Exception:  # the GCS did not answer: ask again
                continue
            if removed:
                loan = self._loans.get(claim)
                if loan is not None and not stop.is_set():  # the lease ended: its GPUs are no longer this worker's
                    loan[0].signal(signal.SIGKILL)
                return

    def _lent(self, claim: int) -> CellProcess | None:
        loan = self._loans.get(claim)
        if loan is None:
            return None
        loan[2][0] = time.monotonic()
        return loan[0]

    def release(self, claim: int) -> None:
        """End the loan: the worker (done with its one cell, else killed) goes."""
        with self._lock:
            loan = self._loans.pop(claim, None)
        if loan is not None:
            loan[1].set()
            if loan[0].proc.poll() is None:
                loan[0].kill(0.5)

    def sees(self, path: str, token: str) -> bool:
        """Whether this node sees the kernel's artifact directory (the marker check: ``base.RootCheck``)."""
        return sees_marker(path, token)

    def submit(self, job: dict[str, Any], claim: int = 0) -> None:
        worker = self._lent(claim)
        if worker is None:
            raise RuntimeError("this worker was not lent to the cell")
        worker.submit(job)

    def poll(self, timeout: float, after: int = 0, claim: int = 0) -> tuple[list[tuple[int, int, bytes]], int | None, int]:
        worker = self._lent(claim)
        return worker.poll(timeout, after) if worker is not None else ([], None, 0)

    def signal(self, sig: int, claim: int = 0) -> None:
        worker = self._lent(claim)
        if worker is not None:
            worker.signal(sig)

    def kill(self, grace: float, claim: int = 0) -> int | None:
        worker = self._lent(claim)
        return worker.kill(grace) if worker is not None else None

    def wait(self, timeout: float, claim: int = 0) -> int | None:
        worker = self._lent(claim)
        return worker.wait(timeout) if worker is not None else None


class RayStartError(RuntimeError):
    """The worker could not be started on the lease's node; the message says why and the fix."""


def _moving_seconds(job: dict[str, Any]) -> float:
    """Time, beyond ``call_timeout``, for the actor to take a job whose values travel in it (a node without the
    shared root): Ray brings them to its node first. At least 20 MB/s."""
    inline = (job.get("inputs") or {}).get("inline") or []
    return sum(memoryview(b).nbytes for b in inline) / 20e6


def _connect(placement: dict[str, Any], client_address: str = "") -> Any:
    """Join the lease's Ray cluster: through Ray Client where ``client_address`` (``ray://head:10001``) is set, else as
    a driver of the broker's cluster address, which needs a Ray node on this host: without one, a one-line error at
    once (``ray.init`` would wait 60 s for one)."""
    defer_iri_grammar()  # a second of CPU less in the kernel's join of the cluster (ray_lazy_import)
    import ray

    with _CONNECT:  # the kernel's first cell and its start (RayExecutor.prepare) may both come here
        if not ray.is_initialized():
            said = logging.getLogger("ray._private.worker")
            said.addFilter(_not_main_thread)
            try:
                _init(ray, placement, client_address)
            finally:
                said.removeFilter(_not_main_thread)
    return ray


def _not_main_thread(record: logging.LogRecord) -> bool:
    """Drops Ray's warning that ``ray.init`` off the main thread sets no SIGTERM handler: the kernel joins the cluster
    in the background on purpose (``RayExecutor.prepare``), and the warning showed in whatever cell ran meanwhile."""
    return "SIGTERM handler is not set" not in record.getMessage()


_CONNECT = threading.Lock()


def _init(ray: Any, placement: dict[str, Any], client_address: str) -> None:
    if client_address:
        ray.init(address=client_address, namespace=placement.get("namespace"), log_to_driver=False,
                 configure_logging=False)
        return
    from ray._private.services import find_node_ids

    if not find_node_ids():  # how ray.init itself looks for this host's raylet
        raise RayStartError(
            f"no Ray node runs on this host, and joining the Ray cluster at {placement['address']} as a driver "
            "needs one: set RayExecutor.client_address = 'ray://<head>:10001' (Ray Client; "
            "$GPULEASE_RAY_CLIENT_ADDRESS), or start a Ray node here (ray start --address=...)")
    extra: dict[str, Any] = {"_node_ip_address": os.environ["GPULEASE_RAY_NODE_IP"]} if os.environ.get("GPULEASE_RAY_NODE_IP") else {}
    ray.init(address=placement["address"], namespace=placement.get("namespace"), log_to_driver=False,
             configure_logging=False, **extra)


class WarmActors:
    """The kernel's handles on the nodes' warm worker hosts (``WarmHost``), one per GPU node and interpreter: started
    by the first kernel that needs one there (a new Ray worker process: see ``ray_lazy_import`` for what keeps that
    short), found by name by every later kernel, so that their first cells on the node start no Ray worker process;
    never killed by a kernel's shutdown (other kernels' cells borrow from them)."""

    def __init__(self) -> None:
        self._hosts: dict[tuple[str, str], Any] = {}
        self._answered: set[tuple[str, str]] = set()  # those that answered once: later calls wait call_timeout
        self._lock = threading.Lock()
        self._gpu_ids: Any = None  # the kernel's own GPU-ID task, where the lease view does not carry them
        #: whether the broker tells the GPU IDs (the lease view's ``gpu_ids``): None not known yet, False once it did
        #: not within IDS_WAIT (an older broker: later cells read the view once and ask Ray at once)
        self._broker_ids: bool | None = None

    @staticmethod
    def _key(node: str, python: str, env: dict[str, str]) -> tuple[str, str]:
        # the kernel's PYTHON* settings act at the interpreter's start: a worker started with others is not lent
        return node, python + repr(sorted((k, v) for k, v in env.items() if k.startswith("PYTHON")))

    @staticmethod
    def host_name(key: tuple[str, str]) -> str:
        """The node's host for an interpreter, in the broker's namespace: ``gpulease-host-<node>-v<version>-<hash>``."""
        return f"gpulease-host-{key[0]}-v{HOST_VERSION}-{hashlib.sha256(key[1].encode()).hexdigest()[:12]}"

    def start(self, ray: Any, node: str, python: str, env: dict[str, str], namespace: str | None) -> None:
        """Find the node's warm host for ``python``, or start it (``lend`` waits for its answer): a node's first cell
        borrows its worker as the next ones do. (Starting a warm actor after a first cell run in an actor of its own
        saved that cell a start, but the cell right after it waited for the warm actor: 116 ms -> 3.9-4.5 s, so Run
        All lost.)"""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        key = self._key(node, python, env)
        with self._lock:
            if key in self._hosts:
                return
            node_id = next((n["NodeID"] for n in ray.nodes() if n.get("Alive") and n["NodeManagerAddress"] == node),
                           None)
            if node_id is None:
                return
            self._hosts[key] = (
                ray.remote(WarmHost)
                .options(num_cpus=0, num_gpus=0, max_restarts=0, max_concurrency=HOST_CALLS, lifetime="detached",
                         get_if_exists=True, name=self.host_name(key), namespace=namespace,
                         scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
                .remote(python, {k: v for k, v in env.items() if k.startswith("PYTHON")})
            )

    def _task(self) -> Any:
        if self._gpu_ids is None:
            import ray

            self._gpu_ids = ray.remote(num_cpus=0)(gpu_ids)
        return self._gpu_ids

    def lend(self, ray: Any, placement: dict[str, Any], bundle: int, pg: Any, python: str, env: dict[str, str],
             start_timeout: float, call_timeout: float,
             reread: Callable[[], dict[str, Any] | None] | None = None) -> tuple[Any, dict[str, Any]] | None:
        """(host, its claim's info) for a cell of the lease: a worker of the node's warm host, lent with the GPU IDs
        Ray assigned in the lease's group; None where it cannot be (no such node, or the host failed: then it is
        killed and a later cell makes a new one), and the cell starts its own actor in the group.

        The IDs: the lease view's (``placement.bundles[i].gpu_ids``, the broker's); where the view at grant came
        before the broker learned them (milliseconds after the group is placed), the lease view read again
        (``reread``), polled for up to ``IDS_WAIT`` (once: an older broker that never tells them costs a kernel that
        wait once); else a task in the group (``ray_ids.in_bundle``), in a Ray worker process of the kernel's job."""
        node = str(placement["bundles"][bundle].get("node") or "")
        key = self._key(node, python, env)
        with self._lock:
            host = self._hosts.get(key)
        if host is None:
            return None
        visible = placement["bundles"][bundle].get("gpu_ids")
        if visible is None and reread is not None:
            visible = _bundle_ids(reread, bundle, placement["placement_group_id"],
                                  0.0 if self._broker_ids is False else IDS_WAIT)
            self._broker_ids = self._broker_ids or visible is not None
        elif visible is not None:
            self._broker_ids = True
        if visible is None:
            try:
                visible = ray.get(in_bundle(self._task(), pg, bundle, float(placement["bundles"][bundle].get("gpus", 1)))
                                  .remote(), timeout=start_timeout)
            except Exception:  # the group is gone (the lease ended) or its node does not answer: the cell's own actor
                return None    # in the group says which
        try:
            info: dict[str, Any] = ray.get(host.claim.remote(placement["placement_group_id"], str(visible)),
                                           timeout=call_timeout if key in self._answered else start_timeout)
        except Exception:
            self._forget(ray, key, host)
            return None
        self._answered.add(key)
        if info.get("error"):  # (the interpreter is missing there: in one line, as a cell's own actor says it)
            raise RayStartError(info["error"])
        return host, info

    def _forget(self, ray: Any, key: tuple[str, str], host: Any) -> None:
        """A host that did not answer (or died) is killed: the next cell starts a new one under its name."""
        with self._lock:
            if self._hosts.get(key) is host:
                del self._hosts[key]
            self._answered.discard(key)
        with contextlib.suppress(Exception):
            ray.kill(host)

    def shutdown(self) -> None:
        """The kernel stops: its handles go; the hosts stay for the other kernels (their loans of this kernel's cells
        were released as the cells ended)."""
        with self._lock:
            self._hosts.clear()
            self._answered.clear()


#: the calls a node's warm host serves at once (every cell lent a worker polls it for output)
HOST_CALLS = 256
#: how long a cell waits (polling the lease view) for the broker to tell a bundle's GPU IDs before asking Ray itself
#: (a task in the group); the broker knows them milliseconds after the group is placed
IDS_WAIT = 3.0
IDS_POLL = 0.02


def _bundle_ids(reread: Callable[[], dict[str, Any] | None], bundle: int, pg_id: str, wait: float) -> str | None:
    """The bundle's GPU IDs in the lease view read again, polled for up to ``wait`` seconds (None: not there by then,
    another group, or no answer)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            placement = reread() or {}
            if placement.get("placement_group_id") != pg_id:
                return None
            ids = placement["bundles"][bundle].get("gpu_ids")
        except Exception:
            return None
        if ids is not None:
            return str(ids)
        if time.monotonic() >= deadline:
            return None
        time.sleep(IDS_POLL)


def kernel_env() -> dict[str, str]:
    """The kernel's own settings a Ray worker starts with (not what a worker must not inherit: unbuffered output and
    the like)."""
    return {k: v for k, v in worker_env().items() if k.startswith(("GPULEASE_", "PYTHON"))}


class RayWorker(RelayedWorker):
    """Kernel side: the Worker interface, for a worker that runs in a Ray actor."""

    local = False  # not a process of this host: nothing to attach to the lease by pid

    def __init__(self, placement: dict[str, Any], python: str | None = None, preload: list[str] | None = None,
                 session: bool = False, bundle: int = 0, lease_id: str = "", start_timeout: float = DEFAULT_START_TIMEOUT,
                 call_timeout: float = DEFAULT_CALL_TIMEOUT, client_address: str = "",
                 warm: WarmActors | None = None, reread: Callable[[], dict[str, Any] | None] | None = None) -> None:
        """``warm``: the kernel's handles on the nodes' warm hosts; a single-use worker is then borrowed from the
        node's (``WarmHost``), else (a session, or the host failing) started in a new actor in the lease's group.
        ``reread``: the lease's placement as the broker shows it now (``WarmActors.lend``)."""
        self.start_timeout, self.call_timeout = start_timeout, call_timeout
        ray = _connect(placement, client_address)
        from ray._raylet import PlacementGroupID
        from ray.util.placement_group import PlacementGroup, get_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if ray.util.client.ray.is_connected():  # Ray Client: the group by its name (in the broker's namespace)
            pg = get_placement_group(placement["placement_group"])
        else:
            pg = PlacementGroup(PlacementGroupID(bytes.fromhex(placement["placement_group_id"])))
        gpus = float(placement["bundles"][bundle].get("gpus", 1))
        args = (["--session"] if session else []) + (["--preload", ",".join(preload)] if preload else [])
        env = kernel_env()
        # the cell may use the rest of its gang (the group's other bundles, on other nodes) through Ray itself
        self._lease_env = {"GPULEASE_RAY_ADDRESS": str(placement.get("address") or ""),
                           "GPULEASE_RAY_NAMESPACE": str(placement.get("namespace") or ""),
                           "GPULEASE_RAY_PLACEMENT_GROUP_ID": placement["placement_group_id"],
                           "GPULEASE_RAY_BUNDLE": str(bundle), "GPULEASE_RAY_BUNDLES": str(len(placement["bundles"]))}
        self.name = worker_name(lease_id or placement.get("placement_group", "gpulease-?")[len("gpulease-"):])
        self._claim = 0  # the loan's number: a worker borrowed from the node's warm actor
        self._kernel_env = {k: v for k, v in env.items() if k.startswith("GPULEASE_")}
        self.info: dict[str, Any]
        node = str(placement["bundles"][bundle].get("node") or "")
        if warm is not None and not session:  # the node's warm actor, started at the kernel's first cell there
            warm.start(ray, node, python or sys.executable, env, placement.get("namespace"))
        lent = None if warm is None or session else warm.lend(
            ray, placement, bundle, pg, python or sys.executable, env, start_timeout, call_timeout, reread)
        if lent is not None:
            self.actor, self.info = lent[0], lent[1]
            self._claim = int(self.info.get("claim") or 0)
        else:
            # owned by the kernel (not detached): a kernel that dies takes its workers with it; the lease's
            # group, owned by the broker, is what outlives a broker restart
            self.actor = (
                ray.remote(CellProcess)
                .options(num_cpus=0, num_gpus=gpus, max_restarts=0, max_concurrency=4, name=self.name,
                         namespace=placement.get("namespace"),
                         scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle))
                .remote(python or sys.executable, args, {**env, **self._lease_env})
            )
            try:
                self.info = ray.get(self.actor.info.remote(), timeout=self.start_timeout)
            except Exception:
                ray.kill(self.actor)
                raise
        self._kw: dict[str, int] = {"claim": self._claim} if self._claim else {}
        if self.info.get("error"):
            self.close()
            raise RayStartError(self.info["error"])
        self.pid: int = self.info["pid"]
        # values through the shared artifact root only where this node sees it, else through Ray's object store
        self._root = RootCheck(lambda path, token: bool(
            ray.get(self.actor.sees.remote(path, token), timeout=self.call_timeout)),
            str(self.info.get("node_ip") or self.info.get("hostname")))
        self.ready: dict[str, Any] | None = None
        self._frames = transfer.FrameReader()
        self._results: list[dict[str, Any]] = []
        self._stderr_tail = b""
        self._decoders = {STDOUT: OutputDecoder(), STDERR: OutputDecoder()}
        self._inbox: deque[tuple[int, Any]] = deque()
        self._taken = 0  # the number of the last event of the worker's that this kernel took (CellProcess.poll)
        self._returncode: int | None = None
        self._done = False  # every pipe closed
        self._dead = ""  # the actor itself is gone: why
        self._how = ""  # for the cell's error, where the exit status does not say it (the actor stopped answering)

    # ---------------------------------------------------------------- state
    def alive(self) -> bool:
        return not self._done and not self._dead and self._returncode is None

    @property
    def returncode(self) -> int | None:
        return self._returncode

    def submit(self, job: dict[str, Any]) -> None:
        import ray

        job = self._root.job(job)
        if self._ended():
            return  # poll() says how
        if self._claim:  # a borrowed worker started before the cell: the kernel's settings now, the lease's
            job["env"] = {**self._kernel_env, **(job.get("env") or {}), **self._lease_env}
        try:
            ray.get(self.actor.submit.remote(job, **self._kw), timeout=self.call_timeout + _moving_seconds(job))
        except ray.exceptions.GetTimeoutError:
            self._hung("take the job")
        except Exception as e:  # RayActorError: the actor (and so the worker) is gone
            self._gone(e)

    def _hung(self, what: str) -> None:
        """The actor did not answer within ``call_timeout``: kill it (the worker's lifeline closes with it)."""
        import ray

        where = self.info.get("node_ip") or "its node"
        self._how = (f"stopped answering: its Ray actor on {where} did not {what} within {self.call_timeout:g} s "
                     "(RayExecutor.call_timeout), so the actor was killed, and the worker with it")
        self._dead = "its Ray actor stopped answering"
        with contextlib.suppress(Exception):
            ray.kill(self.actor, no_restart=True)

    def _gone(self, e: BaseException) -> None:
        self._dead = f"its Ray actor died ({type(e).__name__})"
        self._stderr_tail += f"\n[gpulease] the worker's Ray actor is gone: {e}".encode()[:1000]

    # ---------------------------------------------------------------- output
    def _ended(self) -> bool:
        return bool(self._done or self._dead)

    def _crashed(self) -> WorkerCrashed:
        return WorkerCrashed(self._returncode, "" if self._how else self._tail(), self._how)

    def _fetch(self, timeout: float, out: Sink, err: Sink) -> int:
        """Relay what the actor has; returns how many chunks of output (stdout/stderr) it brought. Each call says the
        last event this kernel took (``_taken``): the actor keeps every later one until then, so an answer lost on
        the way (a wait an interrupt cut short: Ray looks for signals once a second while ``ray.get`` waits) comes
        again with the next call (``CellProcess.poll``)."""
        import ray

        if self._inbox:  # what an interrupted relay left
            return self._relay(out, err)
        try:
            events, code, still_open = ray.get(self.actor.poll.remote(timeout, self._taken, **self._kw),
                                               timeout=timeout + self.call_timeout)
        except ray.exceptions.GetTimeoutError:
            self._hung("hand over the worker's output")
            return 0
        except Exception as e:  # RayActorError: the actor (and so the worker) is gone
            self._gone(e)
            return 0
        fresh = [(tag, data) for seq, tag, data in events if seq > self._taken]
        if not still_open:  # every pipe closed: the worker is gone
            fresh.append((ENDED, code))
        self._inbox.extend(fresh)
        self._taken = max([self._taken, *(seq for seq, _, _ in events)])
        return self._relay(out, err)

    def _end(self, status: Any) -> None:
        self._returncode, self._done = status, True

    def _tail(self) -> str:
        return self._stderr_tail.decode(errors="replace")

    # ---------------------------------------------------------------- stopping
    def interrupt(self) -> None:
        with contextlib.suppress(Exception):
            self.actor.signal.remote(int(signal.SIGINT), **self._kw)

    def kill(self, grace: float = 2.0) -> None:
        import ray

        if not self._dead:  # the actor's kill: SIGTERM, SIGKILL after grace, then up to 5 s for the exit
            with contextlib.suppress(Exception):
                self._returncode = ray.get(self.actor.kill.remote(grace, **self._kw), timeout=grace + 5.0 + self.call_timeout)
        self.close()

    def wait_exit(self, timeout: float = 5.0) -> int | None:
        import ray

        if self._returncode is None and not self._dead:
            with contextlib.suppress(Exception):
                self._returncode = ray.get(self.actor.wait.remote(timeout, **self._kw), timeout=timeout + self.call_timeout)
            if self._returncode is None:
                self.kill(0.5)
        return self._returncode

    def close(self) -> None:
        """Kill the actor: its GPUs go back to the lease's group; the worker's lifeline closes. A borrowed worker's
        loan ends instead (its warm actor kills it if it still runs, and starts the next)."""
        import ray

        if self._claim:  # never the shared host itself: its group's removal, or its purge, ends a loan not released
            claim, self._claim, self._done = self._claim, 0, True
            if not self._dead:
                with contextlib.suppress(Exception):
                    ray.get(self.actor.release.remote(claim), timeout=self.call_timeout)
            return
        self._done = True
        with contextlib.suppress(Exception):
            ray.kill(self.actor)


class RayExecutor(PlacedExecutor):
    """Workers for leases the broker placed with Ray (the lease view's ``placement.kind`` is ``ray``):
    an actor in the Ray placement group that holds the lease's GPUs."""

    kind = "ray"

    client_address = Unicode(
        "",
        config=True,
        help="Ray Client address (ray://<head>:10001) through which the kernel starts its workers, for notebook hosts "
        "that run no Ray node. Empty: the kernel joins the broker's cluster address as a driver, which needs a Ray node "
        "on this host (without one the cell fails at once, naming this option). "
        "Default: $GPULEASE_RAY_CLIENT_ADDRESS, else empty. Example: 'ray://10.0.0.5:10001'.",
    )

    warm = Bool(
        True,
        config=True,
        help="Borrow a pre-started worker from the node's warm host for single-use cells (one detached Ray actor per "
        "GPU node and interpreter, named gpulease-host-<node>-…, outside the leases' placement groups, with no CPUs or "
        "GPUs of its own, shared by every kernel: the first kernel that needs it starts it), instead of starting an "
        "actor and an interpreter per cell (about 2 s). False: a new actor in the lease's placement group for every "
        "cell. Example: False.",
    )

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._warm = WarmActors()

    @default("client_address")
    def _env_client_address(self) -> str:
        return os.environ.get("GPULEASE_RAY_CLIENT_ADDRESS", "")

    connect_early = Bool(
        True,
        config=True,
        help="At the kernel's start, when the broker's leases are placed by Ray: import Ray and join the cluster in "
        "the background (seconds of CPU), so that the kernel's first Ray cell does not wait for it. "
        "False: at the first Ray cell. Example: False.",
    )

    def prepare(self, inventory: dict[str, Any]) -> None:
        if self.connect_early and inventory.get("address"):
            _connect({"address": inventory["address"], "namespace": inventory.get("namespace")}, self.client_address)

    def shutdown(self) -> None:
        self._warm.shutdown()

    def worker(self, lease: LeaseView, python: str | None, preload: list[str] | None,
               session: bool) -> RayWorker:
        assert lease.placement is not None
        client = getattr(self.parent, "client", None)  # the magics' broker client (the Python API's has none here)
        lease_id = lease.id

        def reread() -> dict[str, Any] | None:
            return client.lease(lease_id).placement if client is not None else None

        return RayWorker(lease.placement, python, preload, session=session, lease_id=lease.id,
                         start_timeout=self.start_timeout, call_timeout=self.call_timeout,
                         client_address=self.client_address, warm=self._warm if self.warm else None,
                         reread=reread if client is not None else None)
