"""Suspending an idle ``--session`` against parking it by pickling, in a real kernel (jupyter_client) against a real
broker (simulated inventory, so CPU-only: the worker's processes are stopped and continued, SIGSTOP/SIGCONT).

The session holds ~200 MiB of numpy arrays, a generator half-way through and a held lock. Each round: give its GPU
back (``%gpu session suspend``: the worker stopped, the broker told, the GPU free; against ``%gpu session park``:
the worker pickles its namespace into /dev/shm and exits, the lease released) and then run its next cell (a new
grant and SIGCONT; against a new lease, a new worker and the state unpickled), timing from the execute request to
the cell's first line. Parking loses the generator and the lock (they cannot be pickled); suspending keeps them,
and every round checks that they are intact.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Any

from .broker_process import Broker
from .cell import _Kernel
from .report import Figure, figure

TITLE = "Suspended sessions: suspend and resume against parking by pickling (CPU-only)"

#: the session's state: numpy arrays of ``{mib}`` MiB in all, a generator, a lock (the last two cannot be pickled)
SETUP = ("%%gpu --session {name}\nimport numpy as np, threading, time\n"
         "arrays = [np.random.default_rng(i).random({per} // 8) for i in range(4)]\n{extra}")
UNPICKLABLE = "gen = (i for i in range(10**9))\nnext(gen)\nlock = threading.Lock()\nlock.acquire()\n"
#: the next cell: its first line reports when it ran
FIRST_LINE = "%%gpu --session {name}\nprint('first-line', time.time())\n{check}"


def _first_line(k: _Kernel, code: str) -> float:
    """Seconds from the execute request to the cell's first line (the time it printed, on this host's clock)."""
    printed: list[str] = []

    def hook(msg: dict[str, Any]) -> None:
        if msg["msg_type"] == "stream":
            printed.append(msg["content"]["text"])

    t0 = time.time()
    reply = k.kc.execute_interactive(code, timeout=600, output_hook=hook)
    if reply["content"]["status"] != "ok":
        raise RuntimeError(f"benchmark cell failed: {code[:60]!r}: {reply['content'].get('evalue')}")
    for line in "".join(printed).splitlines():
        if line.startswith("first-line "):
            return float(line.split()[1]) - t0
    raise RuntimeError(f"the cell printed no first line: {''.join(printed)[:200]!r}")


def run(opts: Any) -> list[Figure]:
    quick = bool(opts.quick)
    reps = 3 if quick else 8
    size = (32 << 20) if quick else (200 << 20)
    tmp = tempfile.mkdtemp(prefix="glsuspend")
    b = Broker(os.path.join(tmp, "broker"), gpus=2, nodes=1)
    os.makedirs(b.workdir)
    b.args.append("--tick=0.1")
    b.start()
    k = _Kernel(b.socket, os.path.join(tmp, "artifacts"))
    suspends: list[float] = []
    parks: list[float] = []
    resumes: list[float] = []
    unparks: list[float] = []
    try:
        k.run("%config GpuMagics.heartbeat_interval = 1.0")
        k.run(SETUP.format(name="sus", per=size // 4, extra=UNPICKLABLE))
        k.run(SETUP.format(name="pk", per=size // 4, extra=""))
        step = 1
        for _ in range(reps):
            time.sleep(0.3)  # an idle session: nothing runs in it
            suspends.append(1000 * k.run("%gpu session suspend sus"))
            time.sleep(0.3)
            parks.append(1000 * k.run("%gpu session park pk"))
            time.sleep(0.3)
            step += 1
            resumes.append(1000 * _first_line(k, FIRST_LINE.format(
                name="sus", check=f"assert next(gen) == {step - 1} and lock.locked() and len(arrays) == 4")))
            unparks.append(1000 * _first_line(k, FIRST_LINE.format(name="pk", check="assert len(arrays) == 4")))
    finally:
        for name in ("sus", "pk"):
            try:
                k.run(f"%gpu session stop {name}")
            except Exception:
                pass
        k.stop()
        b.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    mib = f"{size >> 20} MiB"
    return [
        figure(f"give an idle session's GPU back, holding {mib} of numpy, a generator and a lock: suspend", "ms",
               suspends, "park the same session by pickling (without the generator and the lock)", parks,
               bar=("median", "<=", sorted(parks)[len(parks) // 2]),
               note="from `%gpu session suspend` to its answer: the worker's processes stopped (SIGSTOP; CPU-only "
                    "host, simulated inventory), the broker told and the GPU free; against `%gpu session park`: the "
                    "worker pickles its namespace into /dev/shm and exits, the lease released, in the same rounds. "
                    "Bar: no slower than parking. The broker asks an idle suspendable session the same way (an idle, "
                    "pressure or time-limit revocation); the line magic leaves out the idle timeout."),
        figure(f"the suspended session's next cell: to its first line ({mib})", "ms", resumes,
               "a parked session's next cell: to its first line", unparks,
               bar=("median", "<=", sorted(unparks)[len(unparks) // 2]),
               note="from the execute request to the cell's first line: the lease granted again (POST .../resume) "
                    "and the worker continued (SIGCONT), every variable intact (the cell checks the generator "
                    "goes on and the lock is still held); against a new lease, a new session worker and the "
                    "parked state loaded back (the generator and lock are lost there). Bar: no slower than the "
                    "parked session's."),
    ]
