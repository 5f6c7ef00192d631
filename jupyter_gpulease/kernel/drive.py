"""Driving a worker through one job: send it, forward its output live, copy big values straight between the
kernel and the worker (or through files when that is refused), and pass an interrupt on to it."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..executors.base import Sink, Worker
from ..wire import fastpath, transfer, vmcopy


@dataclass
class Sinks:
    out: Sink
    err: Sink


def default_sinks() -> Sinks:
    def w(stream: Any) -> Sink:
        def write(text: str) -> None:
            stream.write(text)
            stream.flush()

        return write

    return Sinks(w(sys.stdout), w(sys.stderr))


def drive(worker: Worker, job: dict[str, Any], sinks: Sinks, grace: float,
          notices: Callable[[], list[str]] | None = None) -> dict[str, Any]:
    """Send the job and forward output until the result arrives.

    An interrupt is forwarded to the worker as SIGINT (its own KeyboardInterrupt traceback
    shows); after ``grace`` seconds, or at a second interrupt, its process group is killed.
    ``notices`` gives lines from the broker (a preemption warning) to show in the cell meanwhile.
    """
    hold = (job.get("inputs") or {}).pop("_hold", None)  # input buffers the worker will ask to be copied
    worker.submit(job)
    if job.get("vm"):
        fastpath.INPUTS.note(sum(b.nbytes for b in hold or []))
    results = _Results(bool(job.get("vm")))
    try:
        return _drive(worker, job, hold, sinks, grace, notices, results)
    finally:
        results.close()


def _drive(worker: Worker, job: dict[str, Any], hold: list[Any] | None, sinks: Sinks, grace: float,
           notices: Callable[[], list[str]] | None, results: _Results) -> dict[str, Any]:
    interrupted_at: float | None = None
    waiting: dict[str, Any] | None = None  # a result whose buffers could not be copied: they come as a file
    while True:
        try:
            for text in notices() if notices is not None else ():
                sinks.err(text)
            if interrupted_at is not None and time.monotonic() >= interrupted_at + grace:
                worker.kill(0.5)
                raise KeyboardInterrupt
            msg = worker.poll(0.5, sinks.out, sinks.err)
            if msg is None:
                continue
            kind = msg.get("type")
            if kind == "ckpt_pool":  # a late answer to a prepare the session stopped waiting for (worker.ckpt_pool)
                continue
            if kind == "vm_dest":
                reply = _copying(worker, transfer.push, worker.pid, hold or [], msg, job["oob_dir"])
                if reply is None:
                    continue  # the worker died meanwhile: the next poll says how
                if reply.get("file"):
                    job["inputs"]["file"] = reply["file"]  # removed by the caller if the worker never maps it
                    _refused(sinks)
                worker.submit(reply)
                hold = None
                continue
            if kind == "vm_file" and waiting is not None:
                waiting["payload"].update(file=msg["file"], spans=msg["spans"], vm=None)
                msg, waiting = waiting, None
            elif kind == "result" and (msg.get("payload") or {}).get("vm"):
                ok = _copying(worker, transfer.pull, worker.pid, msg["payload"], results.taken(msg["payload"]["vm"]))
                if ok is None:
                    continue
                worker.submit({"type": "vm_done", "ok": ok})
                if not ok:
                    _refused(sinks)
                    waiting = msg
                    continue
            theirs = msg.get("versions") or (worker.ready or {}).get("versions")
            if theirs:
                transfer.check_versions(transfer.versions(), theirs)
            return msg
        except KeyboardInterrupt:
            if interrupted_at is not None or not worker.alive():
                worker.kill(0)
                raise
            interrupted_at = time.monotonic()
            worker.interrupt()


class _Results:
    """Notes the size of a job's large results (``fastpath.RESULTS``) and copies them into the spare that
    the kernel faulted in after the last cells, when there is one."""

    def __init__(self, vm: bool) -> None:
        self.vm, self.noted = vm, False

    def taken(self, spans: list[tuple[int, int]]) -> fastpath.Prefaulted | None:
        fastpath.RESULTS.note(sum(n for _, n in spans))
        self.noted = True
        return fastpath.RESULTS.spare()

    def close(self) -> None:
        if self.vm and not self.noted:
            fastpath.RESULTS.note(0)


def _refused(sinks: Sinks) -> None:
    sinks.err(f"gpulease: copying values straight between the kernel and its worker was refused "
              f"({vmcopy.why_not()}); large values go through files in {transfer.shm_dir()} from now on, "
              "which is slower (on Linux, Yama's kernel.yama.ptrace_scope must be 0 or 1)\n")


def _copying(worker: Worker, step: Callable[..., Any], *args: Any) -> Any:
    """A copy between the kernel and the worker, or None if the worker died meanwhile. An interrupt in the
    middle ends the worker at once (it waits for the copy's end and could not show its own traceback)."""
    try:
        return step(*args)
    except KeyboardInterrupt:
        worker.kill(0)
        raise
    except OSError:
        if worker.alive():
            raise
        return None
