"""The GPU worker: a plain Python process that runs one ``%%gpu`` cell (or, for a
``--session``, several) with only the leased GPUs visible.

Started by the kernel as ``python -m jupyter_gpulease.worker [--session] [--preload a,b]``:
- stdin carries framed messages from the kernel (jobs, and its answers once it has copied
  large values: see ``transfer``). It is also the lifeline: when the kernel dies the pipe
  closes and the worker kills its own process group.
- the file descriptor named by ``GPULEASE_CTRL_FD`` carries framed messages back
  (ready, result, where to copy large values); stdout and stderr are plain pipes the
  kernel forwards live.

The worker never imports IPython: it starts fast, and a warm one waits with only the
configured modules imported (never CUDA initialised) until a lease arrives.
"""

from __future__ import annotations

import _ast  # ast without its Python layer: parsing is all a cell needs, and `import ast` costs ~8 ms
import _signal  # signal without its Python layer (enums): loaded with the interpreter
import os
import sys
import threading
import time
from _queue import SimpleQueue  # queue.SimpleQueue without importing queue (heapq, ...)

from gpulease_protocol.private import UnsafePathError

from ..wire import transfer
from .env import lease_dir
from .held import Held

# The worker's start is on the critical path of every cold %%gpu cell: this module imports only
# what a plain cell needs. typing is for the type checker; traceback and linecache (tokenize)
# are loaded off the critical path (see _SourceRegistry).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import IO, Any

_THIS_FILE = os.path.abspath(__file__).rstrip("c")


def _reset_signals() -> None:
    """Undo what the process that started this worker left it: a Ray actor's process starts it with SIGINT ignored
    and blocked (an interrupt would never reach the cell), other launchers with other signals ignored. Nothing
    blocked; what was ignored back to its default action (SIGPIPE and SIGXFSZ stay as Python itself sets them);
    SIGINT raises KeyboardInterrupt, as in any Python program started from a shell."""
    _signal.pthread_sigmask(_signal.SIG_SETMASK, ())
    keep = {_signal.SIGPIPE, getattr(_signal, "SIGXFSZ", _signal.SIGPIPE)}
    for sig in _signal.valid_signals():
        if sig in keep or sig == _signal.SIGINT:
            continue
        try:
            if _signal.getsignal(sig) == _signal.SIG_IGN:
                _signal.signal(sig, _signal.SIG_DFL)
        except (OSError, ValueError):  # SIGKILL, SIGSTOP, real-time signals the platform reserves
            pass
    _signal.signal(_signal.SIGINT, _signal.default_int_handler)


def _kill_own_group() -> None:
    try:
        os.killpg(os.getpgid(0), 9)  # SIGKILL (the signal module's enums cost ~5 ms at start)
    finally:
        os._exit(137)


class _SourceRegistry:
    """Puts each cell's source into linecache (for tracebacks and warnings), in the background.

    linecache imports tokenize; a cold worker should not wait for that before running the
    cell. The error path calls ``flush`` so a traceback always has its source lines.
    """

    def __init__(self) -> None:
        self._pending: list[tuple[str, tuple[int, None, list[str], str]]] = []
        self._lock = threading.Lock()

    def add(self, name: str, entry: tuple[int, None, list[str], str], background: bool = True) -> None:
        with self._lock:
            self._pending.append((name, entry))
        if "linecache" in sys.modules or not background:
            self.flush()
        else:
            threading.Thread(target=self.flush, name="gpulease-linecache", daemon=True).start()

    def flush(self) -> None:
        import linecache

        with self._lock:
            for name, entry in self._pending:
                linecache.cache[name] = entry
            self._pending.clear()


_SOURCES = _SourceRegistry()


def _on_preemption_warning(signum: int, frame: Any) -> None:
    """SIGUSR1 from the broker: a higher priority class takes this lease's GPUs after a grace period."""
    os.environ["GPULEASE_PREEMPTING"] = "1"  # jupyter_gpulease.preempting() reads it
    os.write(2, b"gpulease: this lease is being preempted by a higher priority class: save a checkpoint now, "
                b"the worker is stopped when the grace period ends (jupyter_gpulease.preempting() is True)\n")


class _OnImport:
    """On a shared GPU: applies the lease's memory cap to a framework the moment the cell imports it."""

    def __init__(self, name: str, limit: Callable[[Any], None]) -> None:
        self.name, self.limit = name, limit

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            run = spec.loader.exec_module

            def exec_module(module: Any) -> None:
                run(module)
                self.limit(module)

            spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _limit_torch(torch: Any) -> None:
    try:
        fraction = float(os.environ.get("GPULEASE_MEMORY_FRACTION") or 1)
        if 0 < fraction < 1 and torch.cuda.is_available():
            for device in range(torch.cuda.device_count()):
                torch.cuda.set_per_process_memory_fraction(fraction, device)
    except Exception as e:  # never break the cell's import
        sys.stderr.write(f"gpulease: could not limit PyTorch to its share of the GPU: {e}\n")


def _limit_tensorflow(tf: Any) -> None:
    """TensorFlow takes nearly all GPU memory at its first GPU op: one logical device per GPU capped at the
    lease's GPULEASE_MEMORY_LIMIT (MiB), set before TensorFlow initialises the GPUs (at import, as here)."""
    try:
        limit = int(os.environ.get("GPULEASE_MEMORY_LIMIT") or 0) >> 20
        if limit > 0:
            for gpu in tf.config.list_physical_devices("GPU"):
                tf.config.set_logical_device_configuration(gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=limit)])
    except Exception as e:  # e.g. the GPUs were initialised already: never break the cell's import
        sys.stderr.write(f"gpulease: could not limit TensorFlow to its share of the GPU: {e}\n")


_LIMITS = {"torch": _limit_torch, "tensorflow": _limit_tensorflow}


def _limit_frameworks(env: dict[str, str]) -> None:
    """A shared lease: cap the memory of frameworks that take it all by default (PyTorch and TensorFlow now or
    on import; JAX through its environment)."""
    if "GPULEASE_MEMORY_FRACTION" not in env:
        return
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", env["GPULEASE_MEMORY_FRACTION"])  # JAX, read at start
    for name, limit in _LIMITS.items():
        if name in sys.modules:
            limit(sys.modules[name])
        elif not any(isinstance(f, _OnImport) and f.name == name for f in sys.meta_path):
            sys.meta_path.insert(0, _OnImport(name, limit))


def _lifeline(stdin: IO[bytes], jobs: SimpleQueue[Any]) -> None:
    """Read jobs; when the kernel is gone (EOF), take down this worker and its children."""
    while True:
        try:
            msg = transfer.recv(stdin)
        except Exception:
            msg = None
        if msg is None:
            _kill_own_group()
        jobs.put(msg)


def _strip_own_frames(tb: Any) -> Any:
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename).rstrip("c") == _THIS_FILE:
        tb = tb.tb_next
    return tb


def _compile_cell(code: str, name: str, want_value: bool, header: str = "") -> tuple[Any, Any]:
    """The cell's statements and, like IPython, its last expression separately (unless it ends with ';').

    ``header`` is the cell's magic line: the code is numbered after it, as the notebook shows it.
    """
    source = ("\n" if header else "") + code
    lines = ([header.rstrip("\n") + "\n"] if header else []) + code.splitlines(keepends=True)
    _SOURCES.add(name, (len(source), None, lines, name))
    tree: Any = compile(source, name, "exec", _ast.PyCF_ONLY_AST)
    last = None
    if want_value and tree.body and isinstance(tree.body[-1], _ast.Expr) and not code.rstrip().endswith(";"):
        last = compile(_ast.Expression(tree.body.pop().value), name, "eval")
    return compile(tree, name, "exec"), last


class _SetupError(Exception):
    """The worker cannot run the job as the kernel asked: the cell fails with this one line, no traceback."""


def _prepare(job: dict[str, Any]) -> None:
    os.environ.update(job.get("env") or {})
    _limit_frameworks(job.get("env") or {})
    if os.environ.get("GPULEASE_ARTIFACTS"):  # the lease's artifact directory: made here, off the kernel's path
        try:
            lease_dir(os.environ["GPULEASE_ARTIFACTS"], int(job.get("artifacts_mode") or 0o700))
        except UnsafePathError as e:  # another user's, or a link: the cell's files must not go there
            sys.stderr.write(f"gpulease: {e}; $GPULEASE_ARTIFACTS is not set for this cell\n")
            del os.environ["GPULEASE_ARTIFACTS"]
        except OSError:
            pass  # the cell says so itself if it writes there; the kernel still writes output.log and meta.json
    if job.get("cwd"):
        try:
            os.chdir(job["cwd"])
        except OSError as e:  # never run the cell silently somewhere else
            import socket

            node = os.environ.get("GPULEASE_NODE") or os.environ.get("GPULEASE_NODE_IP") or socket.gethostname()
            raise _SetupError(f"the kernel's working directory {job['cwd']} is not usable on node {node} "
                              f"({e.strerror}): the cell runs there as in the kernel; make that directory exist on "
                              "every GPU node (a shared home or project directory), or change to one that does "
                              "(%cd) before the cell") from None
    for p in reversed(job.get("sys_path") or []):
        if p not in sys.path:
            sys.path.insert(0, p)


def run_job(job: dict[str, Any], ns: dict[str, Any], ask: Any = None, into: Any = None) -> dict[str, Any]:
    """Run one job; ``ask(message)`` sends a message to the kernel and returns its answer. Large inputs are copied
    into ``into`` (memory faulted in while the worker waited) when they fit."""
    started = time.monotonic()
    try:
        _prepare(job)
        if job.get("restore"):  # a parked session's state, before the cell that resumes it
            from . import park

            ns.update(park.restore(job["restore"]))
        if job.get("inputs") is not None:
            ns.update(transfer.receive(job["inputs"], ask, into))
        value: Any = None
        if job["kind"] == "call":
            fn, args, kwargs = ns.pop("__gpulease_call__")
            value = fn(*args, **kwargs)
        else:
            body, last = _compile_cell(job["code"], job["cell_name"], job.get("want_value", True),
                                       job.get("header", ""))
            exec(body, ns)
            if last is not None:
                value = eval(last, ns)
        missing = [n for n in job.get("out", []) if n not in ns]
        if missing:
            raise NameError(f"--out names the cell did not define: {', '.join(missing)}")
        outputs = {n: ns[n] for n in job.get("out", [])}
        try:
            # ``inline``: this node does not see the kernel's files (the shared artifact root): in the message
            packed = transfer.dumps_result(outputs, value, job.get("oob_dir"), bool(job.get("vm")),
                                           inline=bool(job.get("inline")))
        except transfer.TransferError as e:  # the cell's code succeeded: one line naming the value, no frames
            return {"type": "result", "status": "error", "ename": "TransferError", "evalue": str(e),
                    "traceback": f"TransferError: {e}\n", "code_ok": True, "elapsed": time.monotonic() - started}
        return {"type": "result", "status": "ok", "payload": packed, "elapsed": time.monotonic() - started,
                "versions": transfer.versions()}
    except _SetupError as e:
        return {"type": "result", "status": "error", "ename": "WorkerSetupError", "evalue": str(e),
                "traceback": f"WorkerSetupError: {e}\n", "elapsed": time.monotonic() - started}
    except BaseException as e:  # the user's error, KeyboardInterrupt included: report, never crash
        import traceback

        _SOURCES.flush()
        tb = _strip_own_frames(e.__traceback__)
        text = "".join(traceback.format_exception(type(e), e, tb))
        return {
            "type": "result",
            "status": "error",
            "ename": type(e).__name__,
            "evalue": str(e),
            "traceback": text,
            "elapsed": time.monotonic() - started,
        }


#: the most a cell's files may weigh to come back with its result from a node without the shared artifact root
#: (bytes; ``$GPULEASE_FILES_BACK_MAX`` where the kernel sets it)
FILES_BACK_MAX = 1 << 30


def _files_back(job: dict[str, Any], result: dict[str, Any]) -> None:
    """On a node that does not see the shared artifact root (the kernel's marker check: the job's ``root_unseen``),
    the files the cell wrote to ``$GPULEASE_ARTIFACTS`` go back with its result (``files``: {relative path: bytes};
    the kernel writes them into the lease's directory, where the summary line says they are); more than
    ``FILES_BACK_MAX`` bytes stay on the node, and the cell's stderr says where, in one line with the fix."""
    unseen, where = job.get("root_unseen"), os.environ.get("GPULEASE_ARTIFACTS")
    if not unseen or not where:
        return
    found: list[tuple[str, str]] = []
    for top, dirs, names in os.walk(where):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found += [(os.path.join(top, n), os.path.relpath(os.path.join(top, n), where)) for n in names
                  if not n.startswith(".")]
    if not found:
        return
    size = sum(os.path.getsize(path) for path, _ in found if os.path.isfile(path))
    if size > int(os.environ.get("GPULEASE_FILES_BACK_MAX") or FILES_BACK_MAX):
        sys.stderr.write(f"gpulease: the cell's {len(found)} file(s) ({size >> 20} MiB) stay on this node in {where}: "
                         f"{unseen}\n")
        return
    files = {}
    for path, rel in found:
        try:
            with open(path, "rb") as f:
                files[rel] = f.read()
        except OSError:
            continue
    result["files"] = files


class _Kernel:
    """The way back to the kernel: ``send`` a message, or ``ask`` and wait for its answer (on stdin)."""

    def __init__(self, ctrl: IO[bytes], jobs: SimpleQueue[Any]) -> None:
        self.ctrl, self.jobs = ctrl, jobs

    def send(self, msg: dict[str, Any]) -> None:
        transfer.send(self.ctrl, msg)

    def ask(self, msg: dict[str, Any]) -> Any:
        transfer.send(self.ctrl, msg)
        return self.jobs.get()

    def hand_over(self, result: dict[str, Any], oob_dir: str | None) -> None:
        """Send the result; buffers it left in place (``vm``) stay alive until the kernel has copied them."""
        hold = (result.get("payload") or {}).pop("_hold", None)
        if hold is None:
            self.send(result)
            return
        try:
            if not self.ask(result).get("ok"):  # direct copies refused: the buffers go through a file after all
                path, spans = transfer.write_buffers(hold, oob_dir)
                self.send({"type": "vm_file", "file": path, "spans": spans})
        except KeyboardInterrupt:  # interrupted while the kernel copied: it has given up on this result
            pass


class _Parking:
    """Where a session worker parks its state (the kernel names it in every job: ``park``), and SIGTERM while it
    waits for a job (the broker ending its lease) parks it before the worker exits; while a job runs, SIGTERM ends
    the worker as it would without parking."""

    def __init__(self, jobs: SimpleQueue[Any]) -> None:
        self.jobs = jobs
        self.target: dict[str, Any] | None = None
        self.busy = False

    def on_term(self, signum: int, frame: Any) -> None:
        if self.target is not None and not self.busy:
            self.busy = True  # a second SIGTERM ends the worker
            self.jobs.put({"type": "park", **self.target})  # SimpleQueue.put may be called from a signal handler
            return
        _signal.signal(_signal.SIGTERM, _signal.SIG_DFL)
        os.kill(os.getpid(), _signal.SIGTERM)

    def park(self, ns: dict[str, Any], job: dict[str, Any], kernel: _Kernel) -> None:
        from . import park

        self.busy = True
        try:
            kernel.send({"type": "parked", **park.park(ns, job["dir"], job["to"])})
        except BaseException as e:  # say why; the session's variables are gone
            try:
                kernel.send({"type": "park_failed", "error": f"{type(e).__name__}: {e}"})
            except OSError:
                pass  # the kernel is gone


def main(argv: list[str] | None = None) -> None:
    _reset_signals()
    argv = list(sys.argv[1:] if argv is None else argv)
    session = "--session" in argv
    preload: list[str] = []
    if "--preload" in argv:
        preload = [m for m in argv[argv.index("--preload") + 1].split(",") if m]
    ctrl_fd = int(os.environ.pop("GPULEASE_CTRL_FD"))
    os.set_inheritable(ctrl_fd, False)
    ctrl = os.fdopen(ctrl_fd, "wb", buffering=0)
    # stdin is the control pipe: keep it private, give user code (and its children) /dev/null
    stdin = os.fdopen(os.dup(0), "rb", buffering=0)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    sys.stderr.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    failed = {}
    for mod in preload:
        try:
            __import__(mod)
        except Exception as e:  # a missing optional module must not stop the worker
            failed[mod] = f"{type(e).__name__}: {e}"
    if preload:  # a warm worker waits anyway: load now what errors and warnings need later
        import linecache  # noqa: F401
    _signal.signal(_signal.SIGUSR1, _on_preemption_warning)  # the default action would end the worker at once
    jobs: SimpleQueue[Any] = SimpleQueue()
    threading.Thread(target=_lifeline, args=(stdin, jobs), name="gpulease-lifeline", daemon=True).start()
    transfer.send(ctrl, {"type": "ready", "pid": os.getpid(), "versions": transfer.versions(), "preload_failed": failed})
    ns: dict[str, Any] = {"__name__": "__main__", "__builtins__": __builtins__}
    kernel = _Kernel(ctrl, jobs)
    held = Held()
    parking = _Parking(jobs)
    pooled = False  # a checkpoint region is prepared (worker/ckpt_pool.py)
    if session:
        _signal.signal(_signal.SIGTERM, parking.on_term)
    while True:
        job = held.wait(jobs)
        if job.get("type") == "stop":
            break
        if job.get("type") == "park":
            parking.park(ns, job, kernel)
            break
        if job.get("park"):
            parking.target = job["park"]
        if job.get("type") == "ckpt_pool":  # the checkpoint's host memory, faulted in before a suspension
            from . import ckpt_pool

            reply = ckpt_pool.prepare(int(job["nbytes"]))
            pooled = pooled or bool(reply.get("ok"))
            kernel.send({"type": "ckpt_pool", **reply})
            continue
        if pooled:  # a job: the session is in use again, give back a region no checkpoint took
            from . import ckpt_pool

            ckpt_pool.drop()
            pooled = False
        if job.get("type") == "hold":  # memory for the next job's values, faulted in while this worker waits
            held.make(int(job["nbytes"]), int(job.get("heap") or 0), lambda: not jobs.empty())
            continue
        parking.busy = True
        result = run_job(job, ns, kernel.ask, held.inputs)
        held.after_job()
        _files_back(job, result)
        sys.stdout.flush()
        sys.stderr.flush()
        kernel.hand_over(result, job.get("oob_dir"))
        if not session:
            # hand the result over first, then leave without interpreter teardown: the GPU
            # memory is freed the moment the process is gone
            os._exit(0 if result["status"] == "ok" else 1)
        if job.get("kind") == "cell":
            ns.pop("__gpulease_call__", None)
        parking.busy = False
    sys.stdout.flush()
    os._exit(0)

