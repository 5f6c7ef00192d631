"""An idle ``%%gpu --session`` suspended and resumed end to end on a real GPU (issue 33, item 7's last step).

Run by ``scripts/gpu_check.py`` (``make gpu-check``) after it has put the project's dependencies on ``PYTHONPATH``;
by hand, from the repository root, with the machine's own ``python3``:

    python3 scripts/gpu_check_session.py --out DIR [--inventory nvml] [--payload cuda] [--tensors 10 --tensor-mib 1024]

A real broker on the NVML inventory (``--LeasePolicy.suspend_idle=True``) and a real IPython kernel (jupyter_client,
the extension loaded) whose ``%%gpu --session m --idle 3s`` cell leaves ~10 GiB of seeded torch tensors, a captured
CUDA graph, a generator and a held lock in its worker. The broker finds the session idle and asks it to suspend; the
kernel checkpoints the worker through ``jupyter_gpulease/worker/suspend.py`` and stops it. The check shows through
NVML that the GPU's memory is free, lets another process take most of it on a lease of its own, then runs the
session's next cell, which resumes it: every tensor bit-identical (regenerated from the seeds), the graph replaying
to the same bits, the generator going on, the lock still held. Then ``%gpu session suspend m`` / ``resume m`` by
hand, timed, and the same check. Everything goes to ``DIR/session.json``; the broker's and the kernel's logs beside it.

``--inventory simulated --payload cpu`` runs the same steps on a machine without a GPU (numpy arrays, no graph; the
processes are only stopped), which is how this script is tried before a device run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from jupyter_gpulease.worker.suspend import _proc_state as proc_state  # noqa: E402  (the shipped module's)
from jupyter_gpulease.worker.suspend import _rss as rss  # noqa: E402

RESULT: dict[str, Any] = {"errors": []}
OUT = Path(".")

# The session's cells. ``make`` regenerates a tensor from its seed, so the check compares exact bits.
COMMON = {
    "cuda": """
import os, json, threading, time, torch
N, PER = {n}, ({mib} << 20) // 4
def make(i):
    g = torch.Generator(device="cuda")
    g.manual_seed(1000 + i)
    return torch.randn(PER, device="cuda", generator=g)
def checksum(t):
    v = t.view(torch.int32)
    return sum(int(v[j:j + (64 << 20)].sum(dtype=torch.int64)) for j in range(0, v.numel(), 64 << 20))
def footprint():
    torch.cuda.synchronize()
    return {{"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved()}}
""",
    "cpu": """
import os, json, threading, time, numpy as np
N, PER = {n}, ({mib} << 20) // 4
def make(i):
    return np.random.default_rng(1000 + i).standard_normal(PER, dtype=np.float32)
def checksum(t):
    return int(t.view(np.int32).sum(dtype=np.int64))
def footprint():
    return {{"allocated": sum(t.nbytes for t in ts), "reserved": None}}
""",
}
SETUP = {
    "cuda": """
ts = [make(i) for i in range(N)]
sums = [checksum(t) for t in ts]
torch.cuda.empty_cache()  # the checksums' temporaries: the footprint is the tensors, the graph and the context
gg = torch.Generator(device="cuda")
gg.manual_seed(7)
x1, w = (torch.randn(2048, 2048, device="cuda", generator=gg) for _ in range(2))
sx = x1.clone()
def f(x):
    return torch.tanh(x @ w) * 0.5 + x
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    for _ in range(3):
        f(sx)
torch.cuda.current_stream().wait_stream(s)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    sy = f(sx)
graph.replay()
ref = sy.clone()
def replayed():
    sx.copy_(x1)
    graph.replay()
    torch.cuda.synchronize()
    return bool(torch.equal(sy, ref))
""",
    "cpu": """
ts = [make(i) for i in range(N)]
sums = [checksum(t) for t in ts]
def replayed():
    return True
""",
}
TAIL_SETUP = """
gen = (i * i for i in range(10))
next(gen)
lock = threading.Lock()
lock.acquire()
print("@@" + json.dumps({"pid": os.getpid(), **footprint()}))
"""
CHECK = """%%gpu --session m
import time as _t
print("@@" + json.dumps({"first_line": _t.time()}))
_bad = [i for i in range(N) if not bool((ts[i] == make(i)).all())]
_now = [checksum(t) for t in ts]
if "torch" in globals():
    torch.cuda.empty_cache()  # the regenerated copies: the same footprint for the next suspension
print("@@" + json.dumps({"pid": os.getpid(), "tensors_differing": _bad, "checksums_equal": _now == sums,
                         "graph_replays_bit_identical": replayed(), "generator_next": next(gen),
                         "lock_held": lock.locked(), **footprint()}))
"""


def log(msg: str) -> None:
    print(f"[session {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def save() -> None:
    (OUT / "session.json").write_text(json.dumps(RESULT, indent=1, default=str))


def records(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[2:]) for line in text.splitlines() if line.startswith("@@")]


def gpu_used() -> int | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used)
    except Exception:
        return None


def main() -> int:
    global OUT
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "/tmp/gpulease-gpu-check")
    ap.add_argument("--inventory", default="nvml", help="the broker's inventory (nvml; simulated to try it)")
    ap.add_argument("--payload", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tensors", type=int, default=10)
    ap.add_argument("--tensor-mib", type=int, default=1024)
    ap.add_argument("--idle", type=float, default=8.0, help="the session's idle timeout, seconds")
    ap.add_argument("--warn", type=float, default=4.0, help="the broker's warning before an idle revocation, seconds")
    a = ap.parse_args()
    OUT = Path(a.out)
    OUT.mkdir(parents=True, exist_ok=True)
    RESULT["command"] = "python3 scripts/gpu_check_session.py " + " ".join(sys.argv[1:])
    RESULT["inventory"], RESULT["payload"] = a.inventory, a.payload
    RESULT["tensor_bytes"] = a.tensors * (a.tensor_mib << 20)

    from kernels import Kernel

    from jupyter_gpulease.client import BrokerClient

    work = Path(tempfile.mkdtemp(prefix="glsess"))
    sock = work / "b.sock"
    broker_log = open(OUT / "session-broker.log", "ab")
    inv = [f"--inventory={a.inventory}", *(["--gpus=1"] if a.inventory == "simulated" else [])]
    broker = subprocess.Popen([sys.executable, "-m", "lease_broker", f"--socket={sock}", f"--db={work}/l.db", *inv,
                               "--tick=0.1", "--LeasePolicy.suspend_idle=True", f"--LeasePolicy.warn_before_seconds={a.warn:g}",
                               "--log-level=INFO"], stdout=broker_log, stderr=subprocess.STDOUT, cwd=work)
    kernel: Any = None
    try:
        t = time.monotonic()
        while not sock.exists() and broker.poll() is None and time.monotonic() - t < 40:
            time.sleep(0.05)
        client = BrokerClient(f"unix://{sock}", timeout=30)
        RESULT["broker_start_s"] = round(time.monotonic() - t, 2)
        RESULT["gpus"] = client.gpus()
        t = time.monotonic()
        kernel = Kernel(f"unix://{sock}", str(work / "art"), log=str(OUT / "session-kernel.log"))
        RESULT["kernel_start_s"] = round(time.monotonic() - t, 2)
        assert kernel.run("%config GpuMagics.heartbeat_interval = 0.3").status == "ok"
        RESULT["gpu_used_idle"] = gpu_used()

        # 1. the session: its cell leaves the tensors, the graph, a generator and a held lock in its worker
        code = (f"%%gpu --session m --idle {a.idle:g}s\n" + COMMON[a.payload].format(n=a.tensors, mib=a.tensor_mib)
                + SETUP[a.payload] + TAIL_SETUP)
        t = time.monotonic()
        r = kernel.run(code, timeout=240)
        RESULT["setup"] = {"status": r.status, "wall_s": round(time.monotonic() - t, 2), "stderr": r.stderr[-1500:]}
        if r.status != "ok" or not records(r.stdout):
            raise RuntimeError(f"the session's first cell failed: {r.error or r.stdout[-1500:]}")
        setup = records(r.stdout)[-1]
        pid = setup["pid"]
        RESULT["setup"].update(setup, gpu_used=gpu_used(), worker_rss=rss(pid))
        lease_id = next(x.id for x in client.leases() if x.labels.get("session") == "m")
        log(f"session worker {pid}, lease {lease_id}: {RESULT['setup']}")
        save()

        # 2. idle: the broker asks, the kernel checkpoints and stops the worker, the lease is suspended
        asked = done = None
        rss_before_ask = 0  # the worker's resident memory until the ask: its checkpoint region faulted in ahead
        view: dict[str, Any] = {}
        deadline = time.monotonic() + a.idle + 120
        while time.monotonic() < deadline:
            view = client.lease(lease_id).raw
            if asked is None and (view.get("suspend") or view.get("phase") == "suspended"):
                asked = time.monotonic()
            if asked is None:
                rss_before_ask = max(rss_before_ask, rss(pid))
            if view.get("phase") == "suspended":
                done = time.monotonic()
                break
            if view.get("phase") == "ended":
                break
            time.sleep(0.05)
        idle: dict[str, Any] = {"phase": view.get("phase"), "suspended": view.get("suspended"),
                                "reason": view.get("reason")}
        RESULT["idle_suspend"] = idle
        if done is None:
            raise RuntimeError(f"the idle session was not suspended: {view}")
        idle.update(asked_to_suspended_s=round(done - (asked or done), 3), worker_rss_before_ask=rss_before_ask,
                    worker_state=proc_state(pid),
                    worker_rss=rss(pid), gpu_used=gpu_used())
        log(f"idle suspension: {idle}")
        save()

        # 3. its GPU serves another request meanwhile: another process takes most of the GPU's memory
        other = client.request_lease(1, wait=30)
        env = {**os.environ, **(other.env or {})}
        t = time.monotonic()
        hog_cmd = ([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--hog", "fill", "1024"]
                   if a.payload == "cuda" else [sys.executable, "-c", "print('@@{\"allocated\": 0}')"])
        h = subprocess.run(hog_cmd, env=env, capture_output=True, text=True, timeout=120)
        RESULT["other_lease"] = {"holding": other.holding, "env": other.env, "wall_s": round(time.monotonic() - t, 2),
                                 "hog": (records(h.stdout) or [{"error": h.stderr[-800:]}])[-1]}
        client.release(other.id)
        log(f"another lease meanwhile: {RESULT['other_lease']}")
        save()

        # 4. the session's next cell resumes it: to its first line, then every check
        def check(name: str, gen_next: int) -> dict[str, Any]:
            t_submit = time.time()
            r = kernel.run(CHECK, timeout=240)
            recs = records(r.stdout)
            row: dict[str, Any] = {"status": r.status, "wall_s": round(time.time() - t_submit, 3),
                                   "stderr": r.stderr[-800:]}
            if recs and "first_line" in recs[0]:
                row["to_first_line_s"] = round(recs[0]["first_line"] - t_submit, 3)
            if len(recs) > 1:
                row.update(recs[-1])
            row["passed"] = bool(r.status == "ok" and row.get("pid") == pid and row.get("tensors_differing") == []
                                 and row.get("checksums_equal") and row.get("graph_replays_bit_identical")
                                 and row.get("generator_next") == gen_next and row.get("lock_held"))
            RESULT[name] = row
            log(f"{name}: {row}")
            save()
            return row

        check("next_cell", 1)
        RESULT["after_resume"] = {"lease": client.lease(lease_id).raw.get("reason"), "gpu_used": gpu_used(),
                                  "worker_state": proc_state(pid)}

        # 5. by hand: %gpu session suspend / resume, timed from the magic to its answer
        hand: dict[str, Any] = {}
        t = time.monotonic()
        r = kernel.run("%gpu session suspend m", timeout=180)
        hand["suspend_s"] = round(time.monotonic() - t, 3)
        hand.update(suspend_status=r.status, suspend_out=(r.stdout + r.stderr)[-600:], gpu_used_suspended=gpu_used(),
                    worker_state_suspended=proc_state(pid), worker_rss_suspended=rss(pid),
                    view=client.lease(lease_id).raw.get("suspended"))
        t = time.monotonic()
        r = kernel.run("%gpu session resume m", timeout=180)
        hand["resume_s"] = round(time.monotonic() - t, 3)
        hand.update(resume_status=r.status, resume_out=(r.stdout + r.stderr)[-600:], gpu_used_resumed=gpu_used())
        RESULT["by_hand"] = hand
        log(f"by hand: {hand}")
        save()
        check("after_hand_resume", 4)  # the generator goes on: 0, 1, 4
        kernel.run("%gpu session stop m", timeout=60)
    except Exception as e:
        RESULT["errors"].append(f"{type(e).__name__}: {e}")
        log(f"ERROR {type(e).__name__}: {e}")
    finally:
        if kernel is not None:
            try:
                kernel.stop()
            except Exception:
                pass
        broker.terminate()
        try:
            broker.wait(15)
        except subprocess.TimeoutExpired:
            broker.kill()
        save()
    ok = not RESULT["errors"] and all(RESULT.get(k, {}).get("passed") for k in ("next_cell", "after_hand_resume"))
    RESULT["passed"] = ok
    save()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
