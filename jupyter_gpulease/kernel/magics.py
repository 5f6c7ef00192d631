"""The ``%%gpu`` cell magic and the ``%gpu`` line magic.

Load with ``%load_ext jupyter_gpulease``, or in every kernel by config
(``c.InteractiveShellApp.extensions = ["jupyter_gpulease"]`` in ``ipython_config.py``).
Options are traitlets: ``c.GpuMagics.preload = ["numpy", "torch"]`` and so on.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
import time
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from traitlets import Bool, Float, Int, List, TraitError, Unicode, observe, validate

from gpulease_protocol.requests import parse_duration, parse_size, request_fields

from .. import artifacts as _artifacts
from ..client import BrokerClient, BrokerError, BrokerUnreachable
from ..executors import executor_class, placement_kind
from ..executors.base import Executor, Worker
from ..executors.local import LocalExecutor, WarmPool
from ..lease_view import LeaseView
from ..wire import fastpath
from ..wire.fastpath import AFTER_ANSWER, later
from .acquire import HOLDINGS, GpuError, Heartbeater, LeaseUnavailable, acquire, gpu_error, kernel_log
from .background import BackgroundJobs
from .cellcode import check_plain_python, select_inputs
from .cellrun import CellError, Job, LeaseRun, summary_line
from .drive import default_sinks
from .linecmd import LINE_COMMANDS, line_command
from .sessions import Session, Sessions, park_dir, park_target, sweep_orphans
from .suspending import local_suspendable


@magics_class
class GpuMagics(Magics):
    broker_url = Unicode(
        "", config=True,
        help="Broker URL: unix:///path/to.sock or http://host:port. Empty: $GPULEASE_BROKER, else "
        "/run/gpulease/broker.sock when a system broker runs, else the per-user socket "
        "($XDG_RUNTIME_DIR/gpulease/broker.sock, else /tmp/gpulease-<uid>/broker.sock).",
    )
    artifact_root = Unicode(
        "", config=True,
        help="Where each lease's artifact directory goes: a local or shared path, or any fsspec URL "
        "(e.g. s3://bucket/gpulease). Empty: $GPULEASE_ARTIFACT_ROOT, else ~/gpulease-artifacts.",
    )
    artifacts_group_readable = Bool(
        False, config=True,
        help="Let the group of each lease's artifact directory read it: the directory 0750 and its files 0640 (the "
        "group is the user's primary group, or the artifact root's when that directory is setgid). False: the "
        "user's only, 0700 and 0600, so that nobody else reads what a cell printed or saved. Example: True, for a "
        "team that shares one artifact root and one group.",
    )
    preload = List(
        Unicode(), ["numpy"], config=True,
        help="Modules the warm worker imports before a lease arrives (import only: CUDA is never "
        "initialised before the lease; a module that is not installed is skipped). "
        "Example: ['numpy', 'torch']. [] starts workers with nothing extra.",
    )
    warm_workers = Int(1, config=True, help="Pre-started single-use workers to keep ready (0: start one per cell).")
    warm_memory = Unicode(
        "4G", config=True,
        help="Most memory, in bytes or a size like '4G', that a warm worker holds faulted in ahead of a lease for "
        "the next cell's large inputs (and as much again as a free block in its heap, for the large values the "
        "cell allocates itself), and the kernel for a cell's large results while it runs: sized from the last 3 "
        "cells' values, so a value is copied or computed into memory that is already there instead of paying a "
        "page fault per page. Taken only while the host keeps 1/8 of its memory (at least 1 GiB) available; a "
        "waiting worker gives it back when memory runs short. 0: none (values go into fresh memory).",
    )
    worker_python = Unicode(
        "", config=True, help="Python interpreter for workers. Empty: the kernel's own (sys.executable)."
    )
    grace = Float(
        5.0, config=True,
        help="Seconds an interrupted cell gets to show its own KeyboardInterrupt before its worker is "
        "killed (the cell's --grace overrides). Example: 5.",
    )
    auto_max_bytes = Int(
        256 << 20, config=True,
        help="--in auto does not send a value larger than this many bytes (name it in --in to send it). "
        "Example: 268435456 (256 MiB).",
    )
    hide_gpus = Bool(
        True, config=True,
        help="Set CUDA_VISIBLE_DEVICES='' in the kernel when the extension loads, so stray GPU use outside "
        "%%gpu fails at once instead of holding a GPU. False leaves the kernel's environment alone.",
    )
    show_summary = Bool(True, config=True, help="Print one summary line (lease, GPUs, times, artifacts) per cell.")
    heartbeat_interval = Float(
        10.0, config=True,
        help="Seconds between heartbeats for held leases (must be well under the broker's heartbeat "
        "timeout). Example: 10.",
    )
    idle_warning_seconds = Float(
        60.0, config=True,
        help="Warn in the cell this many seconds before a session is revoked for idleness. Example: 60.",
    )
    park_sessions = Bool(
        True, config=True,
        help="When a --session lease ends while the session waits for its next cell (idle, a waiting request's "
        "pressure, its time limit, a release), park the session's variables in host memory (tensors on a GPU "
        "too) and give the GPU back; its next cell gets a GPU and the variables again. False: the session's "
        "variables are gone with its lease. Example: False.",
    )

    suspend_leases = Bool(
        True, config=True,
        help="Ask for leases the broker may suspend instead of ending them (when its policy suspends: idle, a "
        "waiting request's pressure, a time limit, a preemption): the cell's or session's worker processes are "
        "stopped where they are, their GPU state checkpointed to host memory on a CUDA host with the driver's "
        "checkpoint API, and resumed on GPUs of the same model when the lease is granted again, every variable "
        "intact. Only for workers on this host that can be suspended (otherwise a session parks, see "
        "park_sessions). False: leases end as without suspension. Example: False.",
    )

    def __init__(self, shell: Any = None, **kwargs: Any) -> None:
        super().__init__(shell=shell, **kwargs)
        self._sh: Any = shell
        self._client: BrokerClient | None = None
        self._heartbeater: Heartbeater | None = None
        self.pool = WarmPool(self.worker_python or None, list(self.preload), self.warm_workers)
        #: placement kind (``local``, ``ray``, ``slurm``) -> its executor, made when a lease first needs it
        self.executors: dict[str, Executor] = {"local": LocalExecutor(self.pool, parent=self)}
        self.sessions = Sessions()
        self.jobs = BackgroundJobs()
        self._memory_changed()
        later(sweep_orphans)  # parked sessions of this user's kernels that were killed

    @validate("warm_memory")
    def _valid_memory(self, proposal: Any) -> str:
        try:
            parse_size(proposal["value"], "GpuMagics.warm_memory")
        except ValueError as e:
            raise TraitError(str(e)) from None
        return str(proposal["value"])

    @observe("warm_memory")
    def _memory_changed(self, change: Any = None) -> None:
        fastpath.INPUTS.limit = fastpath.RESULTS.limit = parse_size(self.warm_memory)
        if change is not None:  # `%config GpuMagics.warm_memory = 0`: what is held under the old limit goes now
            fastpath.RESULTS.drop()
            self._pool_changed(change)

    @observe("warm_workers", "preload", "worker_python")
    def _pool_changed(self, change: Any) -> None:
        pool = getattr(self, "pool", None)
        if pool is not None:  # `%config GpuMagics.warm_workers = 0` takes effect at once
            pool.shutdown()
            pool.python, pool.preload, pool.size = self.worker_python or None, list(self.preload), self.warm_workers
            pool.fill()

    # ---------------------------------------------------------------- plumbing
    @property
    def client(self) -> BrokerClient:
        if self._client is None:
            self._client = BrokerClient(self.broker_url or None)
        return self._client

    @property
    def heartbeater(self) -> Heartbeater:
        if self._heartbeater is None:
            self._heartbeater = Heartbeater(self.client, self.heartbeat_interval)
        return self._heartbeater

    def _start_worker(self, lease: LeaseView, session: bool = False) -> Worker:
        """A worker where the lease's GPUs are: this host, or a node of the engine that placed it (Ray, Slurm)."""
        kind = placement_kind(lease.placement)
        executor = self.executors.get(kind)
        if executor is None:
            executor = self.executors[kind] = executor_class(kind)(parent=self)
        preload = list(self.preload) if session else None  # single-use workers preload in the warm pool
        return executor.start(lease, self.worker_python or None, preload, session=session)

    def prepare_engine(self) -> None:
        """(In the background at load.) The executor of the engine that places the broker's leases (Ray, Slurm)
        gets ready, so that the kernel's first remote cell does not pay for it (Ray: import and join the cluster)."""
        try:
            inventory = self.client.info().get("inventory") or {}
            kind = placement_kind({"kind": inventory.get("kind")})
            if kind != "local" and kind not in self.executors:
                executor = self.executors.setdefault(kind, executor_class(kind)(parent=self))
                executor.prepare(inventory)
        except Exception:  # no broker yet, an engine this kernel cannot use: the first cell says why
            return

    def _root(self) -> str:
        return self.artifact_root or _artifacts.default_root()

    def _cell_name(self) -> str:
        n = max(1, int(getattr(self._sh, "execution_count", 1)) - 1)
        return f"<gpu In[{n}]>"

    # ---------------------------------------------------------------- %gpu / %%gpu
    @magic_arguments()
    @argument("gpus", nargs="?", default="1",
              help="GPUs: a count (2), a range for incremental allocation (1-4), or a fraction of a shared GPU (0.25)")
    @argument("--mem", help="memory on a shared GPU, e.g. 10G (implies a shared GPU)")
    @argument("--gpu-type", help="GPU model or MIG profile every GPU must be, e.g. H100 or 1g.10gb (`%%gpu status`)")
    @argument("--gpu-mem", help="memory every GPU must have at least, e.g. 40G")
    @argument("--time", help="time limit of the lease, e.g. 30m (default: the broker's policy)")
    @argument("--idle", help="idle timeout, e.g. 10m (default: the broker's policy)")
    @argument("--in", dest="inputs", default="auto",
              help="kernel variables to send, comma-separated, or 'auto' (default): the free names the cell uses")
    @argument("--out", default="", help="variables to bring back into the kernel, comma-separated")
    @argument("--session", help="keep a leased worker with this name across cells")
    @argument("--bg", help="run in the background under this name; output still lands in this cell")
    @argument("--priority", help="priority class (see `%%gpu status`)")
    @argument("--wait", help="give up if no GPU is granted within this long, e.g. 5m (default: wait)")
    @argument("--grace", help="after an interrupt, how long the cell may take to stop, e.g. 5s")
    @line_cell_magic
    def gpu(self, line: str, cell: str | None = None) -> Any:
        """Run this cell on leased GPUs, in a worker that sees only them; release them when it ends."""
        if cell is None:
            return line_command(self, line)
        args = parse_options(self.gpu, negative_values(line))
        opts = self._options(args)
        if not cell.strip():
            raise UsageError("%%gpu: the cell is empty")
        try:
            check_plain_python(self._sh, cell)
        except SyntaxError as e:
            raise UsageError(str(e)) from None
        explicit = None if args.inputs.strip() == "auto" else _names(args.inputs)
        try:
            sel = select_inputs(cell, self._sh.user_ns, explicit, self.auto_max_bytes)
        except NameError as e:
            raise UsageError(str(e)) from None
        if args.session:
            sel.unknown = []  # names the cell uses may live in the session's worker
        if sel.note():
            print(sel.note())  # a note, not an error: stdout (stderr shows as an error in a notebook)
        job = Job("cell", cell, self._cell_name(), sel.send, _names(args.out), header=f"%%gpu {line}".rstrip())
        if args.bg:
            return self.jobs.start(args.bg, self._sh, lambda granted: self._once(opts, job, granted=granted),
                                   self.show_summary)
        try:
            if args.session:
                outcome = self._in_session(args.session, opts, job)
            else:
                outcome = self._once(opts, job)
        except CellError as e:  # a failed cell also says where it ran and where its log is
            if self.show_summary and e.outcome is not None:
                print(summary_line(e.outcome, failed=e.ename, not_back=e.code_ok))
            raise
        self._sh.user_ns.update(outcome.outputs)
        if self.show_summary:
            print(summary_line(outcome))
        return outcome.value

    def _options(self, args: Any) -> dict[str, Any]:
        try:
            # the kernel's leases end with it; a range is what is free at the grant, kept: a cell's worker sees
            # only the GPUs it started with
            request = request_fields(args.gpus, mem=args.mem, time=args.time, idle=args.idle, gpu_type=args.gpu_type,
                                     gpu_mem=args.gpu_mem, flag="--", ends_with_caller=True)
            request["heartbeat"] = True
            if self.suspend_leases and local_suspendable():  # the broker asks only leases that say so
                request["suspendable"] = True
            if args.priority:
                request["priority"] = args.priority
            wait = parse_duration(args.wait, "--wait") if args.wait else None
            grace = parse_duration(args.grace, "--grace") if args.grace else self.grace
            for flag in ("session", "bg"):
                name = getattr(args, flag)
                if name is not None and not name.replace("-", "_").isidentifier():
                    raise ValueError(f"invalid --{flag} name {name!r}: use letters, digits, - and _")
            _names(args.out)
            if args.inputs.strip() != "auto":
                _names(args.inputs)
        except ValueError as e:
            raise UsageError(f"%%gpu: {e}") from None
        if args.session and args.bg:
            raise UsageError("%%gpu: --session and --bg cannot be combined")
        labels = {"source": "%%gpu", "cell": self._cell_name().strip("<>")}
        cell_id = _front_end_cell_id(self._sh)
        if cell_id:
            labels["cell_id"] = cell_id  # the sidebar's "Open notebook" selects this cell, not a stale In[n]
        if args.bg:
            labels["bg"] = args.bg  # the broker tells its owner when it ends (gpulease notify: bg)
        if os.environ.get("JPY_SESSION_NAME"):
            labels["notebook"] = os.environ["JPY_SESSION_NAME"][-200:]
        if args.session:
            labels["session"] = args.session  # the sidebar says what releasing would stop
        request["labels"] = labels
        return {"request": request, "wait": wait, "grace": grace, "gpus": args.gpus}

    def _acquire(self, opts: dict[str, Any]) -> tuple[LeaseView, float]:
        t0 = time.monotonic()
        try:
            lease = acquire(self.client, opts["request"], opts["wait"], f"%%gpu {opts['gpus']}")
        except LeaseUnavailable as e:  # cancelled elsewhere, or --wait ran out: no mistake in the arguments
            raise type(e)(f"%%gpu: {e}") from None
        except BrokerUnreachable as e:
            raise gpu_error("BrokerUnreachable", f"%%gpu: {e}") from None
        except BrokerError as e:
            if e.status == 400:  # the broker refused what the arguments ask for (more GPUs than exist, no such type)
                raise UsageError(f"%%gpu: {e}") from None
            raise gpu_error("LeaseRefused", f"%%gpu: {e}") from None
        except ValueError as e:  # the broker's address (GPULEASE_BROKER, GpuMagics.broker_url)
            raise UsageError(f"%%gpu: {e}") from None
        return lease, time.monotonic() - t0

    def _once(self, opts: dict[str, Any], job: Job, sinks: Any = None, granted: Any = None) -> Any:
        """Run ``job`` on a lease of its own; ``granted(lease_id)`` is called once the lease is held."""
        lease, queued = self._acquire(opts)
        if granted is not None:
            granted(lease.id)
        run = LeaseRun(self.client, self.heartbeater, lease, self._root(), queued, self.artifacts_group_readable)
        run.suspender.enabled = bool(opts["request"].get("suspendable"))
        try:
            worker = self._start_worker(lease)
            return run.run(worker, job, sinks or default_sinks(), opts["grace"])
        finally:
            run.end()
            self._after_cell()

    def _in_session(self, name: str, opts: dict[str, Any], job: Job) -> Any:
        s = self.sessions.get(name)
        if s is not None and not s.alive():
            with s.turn(default_sinks().err):  # a park in flight ends first
                pass
            if s.find_parked() is None:
                print(f"gpulease: session {name!r} ended ({s.ended_reason or 'worker gone'}); starting a new one — "
                      "its variables are gone")
                self.sessions.discard(name)
                s = None
            else:
                print(f"gpulease: session {name!r} was parked {s.parked_where()} ({s.describe_parked()}); "
                      "getting a GPU for it again")
                s.resume(*self._session_lease(opts))
                self._beat_for(s)
        if s is None:
            s = Session(name, *self._session_lease(opts))
            try:
                target = park_dir(s.worker, self._root()) if self.park_sessions else None
            except OSError as e:  # another user's directory in this user's place (UnsafePathError): never used
                print(f"gpulease: session {name!r} cannot be parked ({e}): its variables will be gone with its lease",
                      file=sys.stderr)
                target = None
            if target is not None:
                s.park_target = park_target(target)
            self.sessions.add(s)
            self._beat_for(s)
        s.parent = self._sh.get_parent() if hasattr(self._sh, "get_parent") else None
        s.shell = self._sh
        s.warned = False
        s.cells += 1
        with s.turn(default_sinks().err):
            try:
                s.resume_suspended(opts["wait"], f"%%gpu --session {name}")
            except GpuError:
                if not s.alive():  # its state was lost: the session ended
                    self.sessions.discard(name)
                raise
            s.busy, s.pool = True, False  # the worker gives back a prepared checkpoint region at its next job
            try:
                outcome = s.run.run(s.worker, job, default_sinks(), opts["grace"], single_use=False,
                                    extra=s.job_extra())
            except CellError as e:
                if e.ename == "RestoreError":  # the parked state stays for the next try; this lease goes
                    s.park("could not restore the session")
                    raise
                s.restored()
                raise
            finally:
                s.busy = False
                if not s.worker.alive() and s.find_parked() is None:
                    self.sessions.discard(name)
                elif s.worker.alive():
                    self._after_cell(s.worker)
            s.restored()
            return outcome

    def _session_lease(self, opts: dict[str, Any]) -> tuple[LeaseRun, Worker]:
        """A lease and a started session worker on it."""
        lease, queued = self._acquire(opts)
        run = LeaseRun(self.client, self.heartbeater, lease, self._root(), queued, self.artifacts_group_readable)
        run.suspender.enabled = bool(opts["request"].get("suspendable"))
        try:
            return run, self._start_worker(lease, session=True)
        except Exception:
            run.end()
            raise

    def _beat_for(self, s: Session) -> None:
        """Heartbeats for a session's lease: its idle warning, and what to do when the broker ends it."""
        idle = s.run.lease.idle_timeout_seconds
        if idle:
            self.heartbeater.at_most(max(0.2, idle / 4))
        window = min(self.idle_warning_seconds, idle / 2) if idle else self.idle_warning_seconds
        self.heartbeater.add(s.lease_id, active=False,
                             on_reply=lambda view, s=s: s.on_heartbeat(view, window, self._sh),
                             on_gone=lambda s=s: s.on_gone(self._sh))

    def _after_cell(self, session: Worker | None = None) -> None:
        """Once the kernel has answered the cell: a warm worker for the next one (or memory for a session's next
        inputs), and memory for the next large results (``fastpath``)."""
        if session is None:
            self.pool.fill(AFTER_ANSWER)
        elif session.local:
            session.submit(fastpath.hold_message() or {"type": "hold", "nbytes": 0, "heap": 0})
        if fastpath.RESULTS.expected():
            fastpath.RESULTS.prepare(AFTER_ANSWER)

    def shutdown(self) -> None:
        """At the kernel's clean exit (atexit) or the extension's unload: give back every lease this kernel holds
        (sessions, ``--bg`` cells, the Python API's) before it exits, and say so in the kernel's log. (A kernel that
        dies without this, killed or restarted, is the broker's to notice: its leases end with its process.)"""
        held = HOLDINGS.held()
        self.sessions.stop_all(SHUTDOWN_REASON)  # their workers first: nothing to park at an exit
        HOLDINGS.release_all(SHUTDOWN_REASON)
        if held:
            n = len(held)
            kernel_log(f"gpulease: released {n} lease{'s' if n != 1 else ''} at kernel shutdown: "
                       + ", ".join(f"{lease_id} ({what})" for lease_id, what in held.items()))
        fastpath.RESULTS.drop()
        for executor in self.executors.values():
            executor.shutdown()


#: options whose value may look like a negative number (``--time -5m``): argparse would take it for an option
VALUE_OPTIONS = ("--time", "--idle", "--mem", "--gpu-mem", "--wait", "--grace")
_NEGATIVE = re.compile(r"(?<!\S)(" + "|".join(VALUE_OPTIONS) + r")\s+(-[\d.]\S*)")


def negative_values(line: str) -> str:
    """``--time -5m`` as ``--time=-5m``, so a negative value gets the option's own clear error."""
    return _NEGATIVE.sub(r"\1=\2", line)


def parse_options(magic: Any, line: str, name: str = "%%gpu") -> Any:
    """The magic's arguments; a mistake is a one-line ``UsageError`` that names the magic and, for a misspelt
    option, suggests the nearest one (``%%gpu: unknown option --tiem (did you mean --time?)``)."""
    try:
        return parse_argstring(magic, line)
    except UsageError as e:
        text = str(e)
        if text.startswith("unrecognized arguments:"):
            known = [o for o in magic.parser._option_string_actions if o.startswith("--")]
            unknown = [w.split("=", 1)[0] for w in text.split(":", 1)[1].split() if w.startswith("-")]
            if unknown:
                near = [difflib.get_close_matches(w, known, n=1, cutoff=0.75) for w in unknown]
                text = "; ".join(f"unknown option {w}" + (f" (did you mean {m[0]}?)" if m else "")
                                 for w, m in zip(unknown, near, strict=True))
                if not any(near):
                    text += f". Options: {', '.join(sorted(known))}"
        raise UsageError(f"{name}: {text}") from None


def _names(text: str) -> list[str]:
    names = [n.strip() for n in (text or "").split(",") if n.strip()]
    for n in names:
        if not n.isidentifier():
            raise ValueError(f"invalid variable name {n!r}")
    return names


def _front_end_cell_id(shell: Any) -> str:
    """The id of the notebook cell being run, as JupyterLab sends it (the execute request's ``metadata.cellId``);
    "" outside a front end that sends one."""
    get_parent = getattr(shell, "get_parent", None)
    parent = get_parent() if callable(get_parent) else None
    metadata = parent.get("metadata") if isinstance(parent, dict) else None
    cell_id = metadata.get("cellId") if isinstance(metadata, dict) else None
    return cell_id[:200] if isinstance(cell_id, str) else ""


GpuMagics.gpu.__doc__ = (GpuMagics.gpu.__doc__ or "") + LINE_COMMANDS

#: the reason of the leases a kernel gives back at its clean exit (``GpuMagics.shutdown``)
SHUTDOWN_REASON = "kernel_shutdown"

_loaded: dict[int, GpuMagics] = {}


def load_ipython_extension(ipython: Any) -> None:
    magics = GpuMagics(ipython)
    if magics.hide_gpus and "CUDA_VISIBLE_DEVICES" not in os.environ:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    ipython.register_magics(magics)
    _loaded[id(ipython)] = magics
    magics.pool.fill()
    later(magics.prepare_engine)
    import atexit

    atexit.register(magics.shutdown)


def unload_ipython_extension(ipython: Any) -> None:
    magics = _loaded.pop(id(ipython), None)
    if magics is not None:
        magics.shutdown()


__all__ = ["GpuMagics", "load_ipython_extension", "unload_ipython_extension"]
