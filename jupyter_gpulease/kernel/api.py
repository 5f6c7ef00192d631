"""The Python API, for code outside magics.

    with jupyter_gpulease.lease(2) as lease:          # a lease you hold for a block
        result = lease.run(train, config)             # runs train(config) in a worker on those GPUs

    @jupyter_gpulease.on_gpu(1, time="30m")           # HopsML's experiment.launch shape
    def train(lr): ...
    train(0.1)                                        # leases, runs in a worker, releases

    results = jupyter_gpulease.map(train, [0.1, 0.01, 0.001], gpus_per_call=1, max_gpus=4)

``map`` holds one incremental lease (``gpus_per_call``-``max_gpus``): it starts with what is free, and as
the broker grows the lease toward ``max_gpus`` it runs more trials at once, each in its own worker on its
own ``gpus_per_call`` GPUs. Results come back in input order.

Each call's worker starts where the lease's GPUs are, through the executor the ``%%gpu`` magic would use for that
lease (``executors.placement_kind``): a child of this process for a lease on this host, a Ray actor or a Slurm step on
the node that Ray or Slurm placed it on. The executors take their options (``RayExecutor.start_timeout`` and the
like) from this IPython session's configuration, where there is one. ``map`` on a lease placed on another node runs
its calls one at a time, each on all of the lease's GPUs there.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

from gpulease_protocol.requests import parse_duration, request_fields

from .. import artifacts as _artifacts
from ..client import BrokerClient
from ..executors import executor_class, placement_kind
from ..executors.base import Executor, Worker
from ..executors.local import LocalWorker
from .acquire import Heartbeater, acquire
from .cellrun import Job, LeaseRun
from .drive import Sinks, default_sinks

_heartbeaters: dict[str, Heartbeater] = {}
_lock = threading.Lock()
#: placement kind (``ray``, ``slurm``) -> its executor, made when a lease first needs it (as the magics keep theirs)
_executors: dict[str, Executor] = {}


def _heartbeater(client: BrokerClient) -> Heartbeater:
    with _lock:
        hb = _heartbeaters.get(client.url)
        if hb is None:
            hb = _heartbeaters[client.url] = Heartbeater(BrokerClient(client.url, client.token))
        return hb


def _start_worker(lease: Any) -> Worker:
    """A single-use worker where the lease's GPUs are (``lease``: a ``LeaseView``): the magics' choice of executor."""
    kind = placement_kind(lease.placement)
    if kind == "local":
        return LocalWorker()
    with _lock:
        executor = _executors.get(kind)
        if executor is None:
            executor = _executors[kind] = executor_class(kind)(config=_ipython_config())
    return executor.start(lease)


def _ipython_config() -> Any:
    """This IPython session's configuration (``%config RayExecutor.start_timeout = 30`` applies), else none."""
    from traitlets.config import Config

    try:
        from IPython import get_ipython
    except ImportError:
        return Config()
    shell = get_ipython()
    return shell.config if shell is not None else Config()


def _request(gpus: Any, time_limit: str | float | None, idle: str | float | None, mem: str | int | None,
             priority: str | None, labels: dict[str, str] | None, gpu_type: str | None = None,
             gpu_mem: str | int | None = None, grow: bool = False) -> dict[str, Any]:
    # a lease of this process ends with it (a kernel's: shut down, restarted or killed)
    req = request_fields(gpus, mem=mem, time=time_limit, idle=idle, gpu_type=gpu_type, gpu_mem=gpu_mem,
                         ends_with_caller=True, grow=grow)
    req.update(heartbeat=True, labels=labels or {"source": "api"})
    if priority:
        req["priority"] = priority
    return req


class Lease:
    """A granted lease: its ``id``, ``devices``, ``env``; ``run(fn, ...)`` runs a function on it."""

    def __init__(self, run: LeaseRun, grace: float = 5.0) -> None:
        self._run, self.grace = run, grace
        self.info = run.lease

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def devices(self) -> list[dict[str, Any]]:
        """The GPUs it holds now (an incremental lease grows: see ``refresh``)."""
        return list(self._run.lease.devices)

    def refresh(self) -> "Lease":
        """Read the lease from the broker again: an incremental lease (``lease("1-4")``) gets more GPUs as
        they free up (heartbeats also bring them in, every few seconds)."""
        view = self._run.client.lease(self.id)
        self._run.on_beat(view)
        self.info = self._run.lease
        return self

    @property
    def env(self) -> dict[str, str]:
        return self._run.env()

    @property
    def placed(self) -> bool:
        """Whether an engine (Ray, Slurm) placed the lease on a node of its own: its calls run there."""
        return placement_kind(self._run.lease.placement) != "local"

    @property
    def artifacts(self) -> str:
        return self._run.artifacts.display_path

    def run(self, fn: Callable[..., Any], *args: Any, _sinks: Sinks | None = None, _visible: str | None = None,
            **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` in a fresh worker that sees only this lease's GPUs, where they are (this host,
        or the node Ray or Slurm placed the lease on); return its result. (``_visible``: a CUDA_VISIBLE_DEVICES value
        of some of them, for one of several concurrent calls on this host.)"""
        if self._run.status == "ended":
            raise RuntimeError(f"Lease {self.id} has been released")
        job = Job("call", code=getattr(fn, "__qualname__", repr(fn)), inputs={"__gpulease_call__": (fn, args, kwargs)})
        env = {"CUDA_VISIBLE_DEVICES": _visible} if _visible is not None else None
        outcome = self._run.run(_start_worker(self._run.lease), job, _sinks or default_sinks(), self.grace, single_use=True, release=False,
                                env=env)
        return outcome.value

    def release(self) -> None:
        self._run.end()

    def __repr__(self) -> str:
        devs = ", ".join(f"{d.get('node')}:{d.get('index')}" for d in self.devices)
        return f"<Lease {self.id} [{devs}] {self._run.status}>"


@contextlib.contextmanager
def lease(gpus: int | str | float = 1, *, time: str | float | None = None, idle: str | float | None = None,
          mem: str | int | None = None, priority: str | None = None, wait: str | float | None = None,
          broker: str | None = None, artifact_root: str | None = None, gpu_type: str | None = None,
          gpu_mem: str | int | None = None, grow: bool = True) -> Iterator[Lease]:
    """Hold a lease for a block; released when the block ends, however it ends (the process's end too).
    ``gpu_type`` ('H100', '1g.10gb') and ``gpu_mem`` ('40G') narrow the GPUs it may get. ``grow``: a range
    ('1-4') grows toward its maximum as GPUs free up (``refresh`` and each ``run`` see them); False: what was
    free at the grant, kept."""
    client = BrokerClient(broker)
    req = _request(gpus, time, idle, mem, priority, None, gpu_type, gpu_mem, grow)
    t0 = _now()
    granted = acquire(client, req, parse_duration(wait, "wait") if wait is not None else None, f"lease({gpus})")
    run = LeaseRun(client, _heartbeater(client), granted, artifact_root or _artifacts.default_root(), _now() - t0)
    held = Lease(run)
    try:
        yield held
    finally:
        held.release()


def on_gpu(gpus: int | str | float = 1, **options: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: each call leases ``gpus``, runs the function in a worker on them, and releases. A range
    ('1-4') gets what is free up to its maximum and keeps it: the call's worker sees only the GPUs it started
    with."""
    options.setdefault("grow", False)

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            with lease(gpus, **options) as held:
                return held.run(fn, *args, **kwargs)

        return call

    return wrap


def map(fn: Callable[[Any], Any], params: Iterable[Any], gpus_per_call: int = 1, max_gpus: int = 4,
        **options: Any) -> list[Any]:
    """``[fn(p) for p in params]`` on one incremental lease of ``gpus_per_call`` to ``max_gpus`` GPUs.

    The lease is granted with what is free (at least ``gpus_per_call``) and grows as GPUs free up; every
    ``gpus_per_call`` GPUs it holds run one call at a time, each in its own worker. A failed call raises its
    error after the others finished (the others' results are not lost: see the exception's ``results``).
    """
    items = list(params)
    if not items:
        return []
    per = max(1, int(gpus_per_call))
    most = max(per, min(int(max_gpus), per * len(items)) // per * per)  # never more than the calls can use
    results: list[Any] = [None] * len(items)
    errors: dict[int, BaseException] = {}

    def one(held: Lease, i: int, visible: str | None) -> None:
        def prefixed(stream: Any) -> Callable[[str], None]:
            def write(text: str) -> None:
                stream.write("".join(f"[{i}] {line}" for line in text.splitlines(keepends=True)))
                stream.flush()

            return write

        try:
            results[i] = held.run(fn, items[i], _sinks=Sinks(prefixed(sys.stdout), prefixed(sys.stderr)),
                                  _visible=visible)
        except BaseException as e:  # collected and raised once every call has finished
            errors[i] = e

    with lease(str(per) if most == per else f"{per}-{most}", **{**options, "grow": True}) as held:
        pool = ThreadPoolExecutor(max_workers=most // per, thread_name_prefix="gpulease-map")
        todo = list(range(len(items)))[::-1]
        busy: dict[int, Future[None]] = {}  # slot (a group of ``per`` GPUs of the lease) -> its call
        try:
            while todo or busy:
                visible = [d for d in held.env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
                if held.placed:  # on another node: one call at a time, on all of the lease's GPUs there
                    if 0 not in busy and todo:
                        busy[0] = pool.submit(one, held, todo.pop(), None)
                for k in range(0 if held.placed else len(visible) // per):
                    if k not in busy and todo:
                        busy[k] = pool.submit(one, held, todo.pop(), ",".join(visible[k * per:(k + 1) * per]))
                wait(list(busy.values()), timeout=1.0, return_when=FIRST_COMPLETED)
                busy = {k: f for k, f in busy.items() if not f.done()}
                if todo and not held.placed and len(visible) < most:
                    held.refresh()  # grown? more calls at once
        except BaseException:
            held.release()  # the broker stops the calls' workers: the pool below finishes at once
            raise
        finally:
            pool.shutdown(wait=True)
    if errors:
        first = min(errors)
        err = errors[first]
        err.results = results  # type: ignore[attr-defined]
        raise err
    return results


def _now() -> float:
    return time.monotonic()
