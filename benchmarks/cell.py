"""``%%gpu`` benchmarks in a real kernel (jupyter_client) against a real broker (simulated inventory).

Every figure has its baseline measured in the same run: the same cell inline in the kernel, the broker handing
a GPU from one plain client to the next, or a peer (``cell_peers``: ipyparallel's ``%%px`` on a warm engine, a
local Ray task) started in the same kernel, its cells interleaved round by round with ours.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import threading
import time
from typing import Any

from jupyter_client.manager import KernelManager

from . import cell_peers
from .broker_process import Broker
from .report import Figure, figure

TITLE = "%%gpu cells"


class _Kernel:
    def __init__(self, broker_socket: str, artifacts: str, extra: dict[str, str] | None = None) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPULEASE_")}
        env.update({"GPULEASE_BROKER": "unix://" + broker_socket, "GPULEASE_ARTIFACT_ROOT": artifacts, **(extra or {})})
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


def _rounds(k: _Kernel, cells: dict[str, str], n: int, pause: float,
            reset: dict[str, str] | None = None) -> dict[str, list[float]]:
    """``n`` rounds of every cell (ms each), the order rotated each round so that none always follows another;
    ``reset[name]`` runs (unmeasured) before that cell."""
    out: dict[str, list[float]] = {name: [] for name in cells}
    names = list(cells)
    for i in range(n):
        for name in names[i % len(names):] + names[:i % len(names)]:
            if reset and reset.get(name):
                k.run(reset[name])
            time.sleep(pause)  # a user does not run cells back to back: the warm worker gets refilled
            out[name].append(k.run(cells[name]) * 1000)
    return out


def _added(samples: list[float], baseline: list[float]) -> list[float]:
    base = sorted(baseline)[len(baseline) // 2]
    return [s - base for s in samples]


def _median(samples: list[float]) -> float:
    return statistics.median(samples) if samples else float("nan")


def _exit_to_grant(b: Broker, k: _Kernel, n: int) -> tuple[list[float], list[float]]:
    """Worker exit → the GPU granted to a waiting request; baseline: plain release → waiting grant."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from jupyter_gpulease.client import BrokerClient

    url = "unix://" + b.socket
    samples, base = [], []
    busy = 1  # the session's GPU: one is left for the cells
    probe0 = BrokerClient(url)
    deadline = time.time() + 30
    while int(probe0.gpus()["summary"]["states"].get("leased") or 0) > busy and time.time() < deadline:
        time.sleep(0.01)  # the last cell's lease is released after its worker exits
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

        def leased(probe: BrokerClient = probe) -> bool:  # beyond the session's GPU
            return int(probe.gpus()["summary"]["states"].get("leased") or 0) > busy

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


TRIVIAL_NOTE = ("execute_request → reply + idle, through jupyter_client, minus the median of the same cell (`pass`) "
                "inline, measured in the same rounds (the cells' order rotates each round, {pause} s apart so that a "
                "warm worker is refilled, as between a user's cells).")


def _trivial(k: _Kernel, peers: dict[str, cell_peers.Peer], missing: dict[str, str], n: int) -> list[Figure]:
    cells = {"inline": "pass", "gpu": "%%gpu\npass", "session": "%%gpu --session bench\npass"}
    cells.update({name: p.trivial for name, p in peers.items() if p.name not in missing})
    got = _rounds(k, cells, n, 0.4)
    inline = got["inline"]
    note = TRIVIAL_NOTE.format(pause=0.4)
    px = _added(got["px"], inline) if "px" in got else []
    figures = [figure(
        "trivial cell: added time, fresh %%gpu (warm worker)", "ms", _added(got["gpu"], inline),
        "%%px on a warm ipyparallel engine, added" if px else "the same cell inline (absolute)", px or inline,
        bar=("median", "<=", _median(px)) if px else ("median", "<=", 20.0),
        note=note + " The %%gpu cell leases a GPU, runs `pass` in a pre-started worker (a new process for every "
             "cell), hands the result back and releases the lease once the worker is gone; the bar is %%px's "
             "median added time in this run" + ("." if px else f" ({missing.get(peers['px'].name)}: 20 ms instead)."),
    )]
    figures.append(figure(
        "trivial cell: added time, %%gpu --session", "ms", _added(got["session"], inline),
        "the same cell inline (absolute)", inline, bar=None,
        note="the same rounds; a session keeps its leased worker across cells (no lease round trip, no new process).",
    ))
    if "ray" in got:
        figures.append(figure(
            "trivial cell: added time, Ray task (num_gpus=1)", "ms", _added(got["ray"], inline),
            "the same cell inline (absolute)", inline, bar=None,
            note="the same rounds: `ray.get(f.remote())` on a local Ray instance declaring 1 GPU, started in the "
                 "kernel. Ray runs a task that asks for a GPU in a new worker process each time (max_calls=1 is "
                 "Ray's default for GPU tasks, so GPU memory is freed between tasks).",
        ))
    return figures


def _transfer(k: _Kernel, peers: dict[str, cell_peers.Peer], missing: dict[str, str], size: int,
              reps: int) -> list[Figure]:
    k.run(f"import numpy as np\nx = np.random.default_rng(0).random({size // 8})")
    cells = {"inline": "y = x + 1", "gpu": "%%gpu --in x --out y\ny = x + 1",
             "session": "%%gpu --session bench --in x --out y\ny = x + 1", "copy": "z = x.copy()\ndel z"}
    cells.update({name: p.transfer for name, p in peers.items() if p.name not in missing})
    # each cell starts without the previous round's copies (as a notebook that reassigns them), so that what the
    # peers keep does not crowd the host's memory
    reset = {name: "y = None" for name in cells}
    reset["session"] = "y = None\nget_ipython().run_cell_magic('gpu', '--session bench', 'x = y = None')"
    reset.update({name: p.reset for name, p in peers.items() if p.name not in missing})
    got = _rounds(k, cells, reps, 0.3, reset)
    k.run("del x, y")
    mib = f"{size >> 20} MiB"
    inline, gpu = got["inline"], got["gpu"]
    figures = [figure(
        f"{mib} of numpy in and out (y = x + 1), fresh %%gpu", "ms", gpu, "the same cell inline", inline, bar=None,
        note="buffers travel out of band (pickle protocol 5), copied by the kernel straight into the worker's memory "
             "and back out of it (process_vm_writev/readv, in parallel), into memory faulted in ahead: the warm "
             "worker's memory for its inputs, the kernel's spare for the results (wire/fastpath.py). The cells' "
             "order rotates each round, 0.3 s apart.",
    )]
    figures.append(figure(
        f"{mib} in and out: fresh %%gpu / inline", "×", [_median(gpu) / _median(inline)],
        "(inline + 2 copies) / inline", [(_median(inline) + 2 * _median(got["copy"])) / _median(inline)],
        bar=("median", "<=", 2.5),
        note="ratio of the medians; its baseline is the floor for a worker in another process that copies into "
             "fresh memory: the cell itself plus one copy in and one out (`z = x.copy()`, measured in the same "
             "rounds).",
    ))
    figures.append(figure(
        f"{mib} in and out, %%gpu --session", "ms", got["session"], "the same cell inline", inline, bar=None,
        note="the same rounds, in a session's worker (a new x each time, y replaced).",
    ))
    if "px" in got:
        figures.append(figure(
            f"{mib} in and out, ipyparallel push/execute/pull", "ms", got["px"], "the same cell inline", inline,
            bar=None, note="the same rounds: `view.push({'x': x})`, `view.execute('y = x + 1')`, "
                           "`y = view.pull('y')` on one warm engine, all blocking.",
        ))
    if "ray" in got:
        figures.append(figure(
            f"{mib} in and out: fresh %%gpu vs a Ray task's round trip", "ms", gpu,
            "Ray: y = ray.get(f.remote(x)), num_gpus=1", got["ray"], bar=("median", "<=", _median(got["ray"])),
            note="the same rounds; the bar is Ray's median in this run. Ray puts x into its object store, runs the "
                 "task in a new worker (GPU tasks), and the driver maps the result from the store without a copy.",
        ))
    return figures


def _park(k: _Kernel, size: int, reps: int) -> list[Figure]:
    """A session holding ``size`` bytes of numpy parked by hand (worker pickles into /dev/shm, exits, lease
    released) and resumed by its next cell (new lease, new worker, state loaded back), against numpy writing and
    reading the same bytes to and from /dev/shm in the kernel, in the same rounds."""
    k.run(f"%%gpu --session pk\nimport numpy as np\nw = np.random.default_rng(0).random({size // 8})")
    k.run(f"import numpy as np, os\nx = np.random.default_rng(0).random({size // 8})\n"
          "shm = f'/dev/shm/glbench-{os.getpid()}'")
    parks: list[float] = []
    resumes: list[float] = []
    writes: list[float] = []
    reads: list[float] = []
    try:
        for _ in range(reps):
            time.sleep(0.3)
            parks.append(1000 * k.run("%gpu session park pk"))
            time.sleep(0.3)
            resumes.append(1000 * k.run("%%gpu --session pk\nw.shape"))
            writes.append(1000 * k.run("x.tofile(shm)"))
            reads.append(1000 * k.run("y = np.fromfile(shm)\nos.unlink(shm)\ndel y"))
    finally:
        k.run("%gpu session stop pk\ndel x")
    mib = f"{size >> 20} MiB"
    return [
        figure(f"park a session holding {mib} of numpy (%gpu session park)", "ms", parks,
               "numpy writes the same bytes to /dev/shm in the kernel", writes, bar=("p99", "<=", 5000.0),
               note="from the line magic to its answer: the worker pickles its namespace (buffers out of band into "
                    "one file in /dev/shm, worker/park.py), exits, and the lease is released. Bar: the broker's "
                    "default term_timeout (5 s), the time a worker has to park when the broker ends its lease."),
        figure(f"resume a parked session holding {mib}: its next cell", "ms", resumes,
               "numpy reads the same bytes back from /dev/shm in the kernel", reads, bar=None,
               note="a new lease, a new session worker, the state mapped back from /dev/shm and unpickled, then the "
                    "cell (`w.shape`), in the same rounds as the park. The file is mapped copy-on-write, so the "
                    "array's pages are read when first used, not here: numpy's read copies them all."),
    ]


def _run_all(tmp: str, n: int, blocks: int) -> list[Figure]:
    """Run All: trivial ``%%gpu`` cells back to back (each sent the moment the last answered) in a kernel on a
    one-GPU broker, where each cell's request comes while the last cell's lease is still being given back,
    against the same in a kernel on a two-GPU broker (the other GPU is free: no request waits), in alternating
    blocks of ``n`` cells."""
    kernels: dict[int, tuple[Broker, _Kernel]] = {}
    ms: dict[int, list[float]] = {1: [], 2: []}
    try:
        for gpus in (1, 2):
            b = Broker(os.path.join(tmp, f"runall{gpus}"), gpus=gpus, nodes=1)
            os.makedirs(b.workdir)
            b.args.append("--tick=0.1")
            b.start()
            kernels[gpus] = (b, _Kernel(b.socket, os.path.join(tmp, f"runall{gpus}-art")))
            kernels[gpus][1].run("%%gpu\npass")
        for i in range(blocks):
            for gpus in ((1, 2) if i % 2 == 0 else (2, 1)):
                k = kernels[gpus][1]
                time.sleep(0.3)  # the last block's leases are given back, the warm workers ready
                ms[gpus] += [1000 * k.run("%%gpu\npass") for _ in range(n)]
    finally:
        for b, k in kernels.values():
            k.stop()
            b.stop()
    return [figure(
        "Run All: back-to-back trivial %%gpu cells on one GPU", "ms", ms[1],
        "the same on two GPUs (no request waits)", ms[2], bar=("median", "<=", 1.25 * statistics.median(ms[2])),
        note=f"bar: within 25 % of the two-GPU median. {blocks} blocks of {n} cells each sent the moment the last one answered, through jupyter_client; "
             "on one GPU each cell's request arrives while the last cell's worker exits and its lease is given back: "
             "the request queues for that GPU and is granted at the release.",
    )]


def run(opts: Any) -> list[Figure]:
    quick = bool(opts.quick)
    n = 3 if quick else 15
    tmp = tempfile.mkdtemp(prefix="glcell")
    size = (64 << 20) if quick else (1 << 30)
    figures: list[Figure] = []
    b = Broker(os.path.join(tmp, "broker"), gpus=2, nodes=1)  # one for the session, one for the fresh cells
    os.makedirs(b.workdir)
    b.args.append("--tick=0.1")
    b.start()
    peers = {"px": cell_peers.PX, "ray": cell_peers.ray_peer(os.path.join(tmp, "ray"), 2 * size + (512 << 20))}
    k = _Kernel(b.socket, os.path.join(tmp, "artifacts"), cell_peers.env(os.path.join(tmp, "ipython")))
    started: list[cell_peers.Peer] = []
    try:
        k.run("%%gpu\npass")  # first lease, imports
        missing = cell_peers.start(k, list(peers.values()))
        started = [p for p in peers.values() if p.name not in missing]
        for name, why in missing.items():
            print(f"   {name}: {why}", flush=True)
        figures += _trivial(k, peers, missing, 3 if quick else 30)  # ms-scale figures: more rounds, a steadier median
        k.run("%config GpuMagics.warm_workers = 0")
        inline, cold = (list(v) for v in _rounds(k, {"inline": "pass", "cold": "%%gpu\npass"}, n, 0.2).values())
        figures.append(figure(
            "trivial cell: added time, cold worker", "ms", _added(cold, inline), "the same cell inline (absolute)",
            inline, bar=("median", "<=", 80.0),
            note="as above with GpuMagics.warm_workers = 0: a fresh interpreter per cell.",
        ))
        k.run("%config GpuMagics.warm_workers = 1")
        figures += _transfer(k, peers, missing, size, 3 if quick else 15)
        samples, base = _exit_to_grant(b, k, 3 if quick else 15)  # the session holds the other GPU meanwhile
        k.run("%gpu session stop bench")
        figures += _park(k, size, 3 if quick else 8)
        figures.append(figure(
            "worker exit → GPU granted to the next waiting request", "ms", samples,
            "plain client release → waiting request granted", base, bar=("p99", "<=", 500.0),
            note="from the last statement of a %%gpu cell (time.time() in the worker) to the moment a request "
                 "long-polling on the only GPU returns granted; includes handing the result over, the worker's "
                 "exit, the release and the scheduling pass.",
        ))
        figures += _run_all(tmp, 5 if quick else 20, 2 if quick else 6)
    finally:
        cell_peers.stop(k, started)
        k.stop()
        b.stop()
        cell_peers.kill_leftovers(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
    return figures
