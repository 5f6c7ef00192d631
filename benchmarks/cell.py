"""``%%gpu`` benchmarks in a real kernel (jupyter_client) against a real broker (simulated inventory).

Every figure has its baseline measured in the same run: the same cell inline in the kernel, or the
broker handing a GPU from one plain client to the next.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from typing import Any

from jupyter_client.manager import KernelManager

from .broker import Broker
from .report import Figure, figure

TITLE = "%%gpu cells"


class _Kernel:
    def __init__(self, broker_socket: str, artifacts: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPULEASE_")}
        env.update({"GPULEASE_BROKER": "unix://" + broker_socket, "GPULEASE_ARTIFACT_ROOT": artifacts})
        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(env=env)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)
        self.run("%load_ext jupyter_gpulease\n%config GpuMagics.show_summary = False")

    def run(self, code: str, timeout: float = 600) -> float:
        """Seconds from execute_request to the reply and the kernel's idle (what a user waits)."""
        t0 = time.perf_counter()
        reply = self.kc.execute_interactive(code, timeout=timeout, output_hook=lambda msg: None)
        took = time.perf_counter() - t0
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"benchmark cell failed: {code[:60]!r}: {reply['content'].get('evalue')}")
        return took

    def stop(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


def _interleaved(k: _Kernel, a: str, b: str, n: int, pause: float) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for _ in range(n):
        time.sleep(pause)  # a user does not run cells back to back: the warm worker gets refilled
        xs.append(k.run(a) * 1000)
        time.sleep(pause)
        ys.append(k.run(b) * 1000)
    return xs, ys


def _added(samples: list[float], baseline: list[float]) -> list[float]:
    base = sorted(baseline)[len(baseline) // 2]
    return [s - base for s in samples]


def _exit_to_grant(b: Broker, k: _Kernel, n: int) -> tuple[list[float], list[float]]:
    """Worker exit → the GPU granted to a waiting request; baseline: plain release → waiting grant."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from jupyter_gpulease.client import BrokerClient

    url = "unix://" + b.socket
    samples, base = [], []
    for _ in range(n):
        got: dict[str, float] = {}
        waiter = BrokerClient(url)

        def wait_grant(w: BrokerClient = waiter, got: dict[str, float] = got) -> None:
            lease = w.request_lease(1, wait=60, heartbeat=False)
            got["t"] = time.time()
            w.release(lease["id"])

        k.run("%%gpu\nimport time\n_t = [0.0]")  # warm up
        k.run("_gpulease_marks = []")
        probe = BrokerClient(url)

        def leased(probe: BrokerClient = probe) -> bool:
            return bool(probe.gpus()["summary"]["states"].get("leased"))

        deadline = time.time() + 30
        while leased() and time.time() < deadline:  # the warm-up's lease is released after its worker exits
            time.sleep(0.005)
        k.kc.execute("%%gpu --out _t\nimport time, os\ntime.sleep(0.5)\n_t = [time.time()]")
        while not leased() and time.time() < deadline:  # now the cell holds it
            time.sleep(0.005)
        t = threading.Thread(target=wait_grant)
        t.start()
        t.join(60)
        while k.kc.iopub_channel.msg_ready():
            k.kc.get_iopub_msg(timeout=1)
        k.kc.get_shell_msg(timeout=60)
        def hook(m: dict[str, Any], got: dict[str, float] = got) -> None:
            if m["msg_type"] == "stream":
                got["w"] = float(m["content"]["text"])

        k.kc.execute_interactive("print(_t[0])", output_hook=hook, timeout=30)
        samples.append((got["t"] - got["w"]) * 1000)
        # baseline: a plain client releases, the waiting one is granted
        holder = BrokerClient(url)
        held = holder.request_lease(1, heartbeat=False)
        got2: dict[str, float] = {}
        t = threading.Thread(target=wait_grant, kwargs={"got": got2, "w": BrokerClient(url)})
        t.start()
        time.sleep(0.2)
        t_rel = time.time()
        holder.release(held["id"])
        t.join(60)
        base.append((got2["t"] - t_rel) * 1000)
    return samples, base


def run(opts: Any) -> list[Figure]:
    quick = bool(opts.quick)
    n = 3 if quick else 15
    tmp = tempfile.mkdtemp(prefix="glcell")
    figures: list[Figure] = []
    b = Broker(os.path.join(tmp, "broker"), gpus=1, nodes=1)
    os.makedirs(b.workdir)
    b.args.append("--tick=0.1")
    b.start()
    k = _Kernel(b.socket, os.path.join(tmp, "artifacts"))
    try:
        k.run("%%gpu\npass")  # first lease, imports
        inline, warm = _interleaved(k, "pass", "%%gpu\npass", n, 0.4)
        figures.append(figure(
            "trivial cell: added time, warm worker", "ms", _added(warm, inline), "the same cell inline (absolute)",
            inline, bar=("median", "<=", 20.0),
            note="execute_request → reply + idle, through jupyter_client; the %%gpu cell leases a GPU, runs `pass` "
                 "in the pre-started worker, waits for its exit and releases. 0.4 s pause between cells so the "
                 "warm worker is refilled (as between a user's cells).",
        ))
        k.run("%config GpuMagics.warm_workers = 0")
        inline, cold = _interleaved(k, "pass", "%%gpu\npass", n, 0.2)
        figures.append(figure(
            "trivial cell: added time, cold worker", "ms", _added(cold, inline), "the same cell inline (absolute)",
            inline, bar=("median", "<=", 80.0),
            note="as above with GpuMagics.warm_workers = 0: a fresh interpreter per cell.",
        ))
        k.run("%config GpuMagics.warm_workers = 1")
        size = (64 << 20) if quick else (1 << 30)
        k.run(f"import numpy as np\nx = np.random.default_rng(0).random({size // 8})")
        reps = 3 if quick else 15
        inline_t, gpu_t, copy_t = [], [], []
        for _ in range(reps):
            inline_t.append(k.run("y = x + 1") * 1000)
            time.sleep(0.3)
            gpu_t.append(k.run("%%gpu --in x --out y\ny = x + 1") * 1000)
            time.sleep(0.3)
            copy_t.append(k.run("z = x.copy()") * 1000)
        k.run("del x, y, z")
        figures.append(figure(
            f"{size >> 20} MiB of numpy in and out (y = x + 1)", "ms", gpu_t, "the same cell inline", inline_t,
            bar=None, note="ratio bar: median ≤ 2× the inline median (see the ratio line below the table); buffers "
                           "travel out of band (pickle protocol 5), copied by the kernel straight into the worker's "
                           "memory and back out of it (process_vm_writev/readv, in parallel, into huge-page memory).",
        ))
        figures.append(figure(
            f"{size >> 20} MiB copied into fresh memory, inline (z = x.copy())", "ms", copy_t, "y = x + 1 inline",
            inline_t, bar=None,
            note="what one transfer costs at least (a copy into new memory); `y = x + 1` is itself one pass over x "
                 "into new memory, so a cell that ships x in and y out costs about three of these.",
        ))
        med = {name: sorted(v)[len(v) // 2] for name, v in (("gpu", gpu_t), ("inline", inline_t), ("copy", copy_t))}
        ratio = med["gpu"] / max(1e-9, med["inline"])
        floor = (med["inline"] + 2 * med["copy"]) / max(1e-9, med["inline"])
        figures.append(figure(
            f"{size >> 20} MiB in and out: %%gpu / inline", "×", [ratio], "(inline + 2 copies) / inline", [floor],
            bar=("median", "<=", 2.0),
            note="ratio of the medians above; its baseline is the floor for a worker in another process: the cell "
                 "itself plus one copy in and one copy out, from the medians measured in this run.",
        ))
        samples, base = _exit_to_grant(b, k, 3 if quick else 15)
        figures.append(figure(
            "worker exit → GPU granted to the next waiting request", "ms", samples,
            "plain client release → waiting request granted", base, bar=("p99", "<=", 500.0),
            note="from the last statement of a %%gpu cell (time.time() in the worker) to the moment a request "
                 "long-polling on the only GPU returns granted; includes handing the result over, the worker's "
                 "exit, the release and the scheduling pass.",
        ))
    finally:
        k.stop()
        b.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return figures
