"""``gpulease replay`` / ``python -m lease_broker.replay``: replay a GPU trace through the broker."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any, TextIO

from ..core.errors import LeaseError
from ..core.lease import parse_duration
from .metrics import compare, summarize
from .model import GIB_PER_GPU, RESUME_SECONDS_PER_GIB, SUSPEND_SECONDS_PER_GIB, Cluster, Suspend
from .policy import load_policy
from .report import describe, plot
from .run import replay
from .sim import LIMITS
from .trace import TraceError, load_trace, tile


def _durations(text: str) -> list[float]:
    out = []
    for part in text.split(","):
        try:
            out.append(parse_duration(part.strip(), "idle timeout"))
        except LeaseError as e:
            raise argparse.ArgumentTypeError(e.message) from None
    return out


def _sweep(text: str) -> list[float]:
    key, sep, values = text.partition("=")
    if not sep or key.strip() != "idle":
        raise argparse.ArgumentTypeError(f"Invalid sweep {text!r}: give idle=1m,5m,10m,30m")
    return _durations(values)


def _duration(text: str) -> float:
    return _durations(text)[0] if "," not in text else _fail(text)


def _fail(text: str) -> float:
    raise argparse.ArgumentTypeError(f"Invalid duration {text!r}: give one value like 10m")


def _cluster(text: str) -> Cluster:
    try:
        return Cluster.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


class ProgressLine:
    """A line on the terminal, rewritten in place (``\\r``): the run, the share of its work done, the seconds."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.t0 = time.monotonic()
        self.width = 0

    def __call__(self, mode: str, done: int, total: int) -> None:
        what = "bursts" if mode == "lease" else "sessions"
        pct = 100.0 * done / total if total else 100.0
        text = f"gpulease replay: {mode} run, {pct:5.1f}% of {total:,} {what}, {time.monotonic() - self.t0:.0f} s"
        self.stream.write("\r" + text.ljust(self.width))
        self.stream.flush()
        self.width = len(text)

    def close(self) -> None:
        if self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpulease replay",
        description="Replay a GPU workload trace through the broker's real scheduler and policy on a virtual clock, "
        "and compare leasing with sessions that hold their GPUs.",
    )
    p.add_argument("bursts", help="bursts CSV: session_id,start_s,duration_s,num_gpus (extra columns ignored)")
    p.add_argument("--sessions", help="sessions CSV: session_id,start_s,stop_s,max_gpus (for the baseline, and "
                   "each session's kernel end, which ends the lease it still holds; default: each session spans its "
                   "bursts and holds its largest request, and its last lease lingers to its idle deadline)")
    p.add_argument("--cluster", type=_cluster, default=Cluster(8, 8), help="NODESxGPUS_PER_NODE (default 8x8), or mixed groups "
                   "NODESxGPUS:GPU_NAME[:MEMORY] separated by commas, e.g. 2x8:A100-40GB,1x8:H100")
    p.add_argument("--config", help="broker policy file (traitlets python config: c.LeasePolicy.x = ...)")
    p.add_argument("--idle", type=_duration, default=None,
                   help="idle timeout of a lease, e.g. 10m (default: the policy's default_idle_timeout_seconds)")
    p.add_argument("--baseline", choices=["session", "none"], default="session",
                   help="compare with sessions holding max_gpus from start to stop (default) or nothing")
    p.add_argument("--sweep", type=_sweep, help="replay once per idle timeout, e.g. idle=1m,5m,10m,30m")
    p.add_argument("--plot", metavar="FILE.png", help="with --sweep: plot reclaimed GPU-time vs re-grant rate")
    p.add_argument("--tile", type=int, default=1, metavar="N",
                   help="replay N copies of the trace one after another (a longer synthetic trace)")
    p.add_argument("--limits", choices=LIMITS, default="oracle",
                   help="the time limits the lease mode's requests ask for: 'oracle' (default), what each burst "
                   "needs (burst + idle timeout + 60 s), or 'default', the policy's default_duration_seconds (the "
                   "smallest multiple of it that fits a longer burst), as users who name no --time do; the start "
                   "estimates' figures compare with the time-limit plan, which the oracle limits make unrealistically good")
    p.add_argument("--no-estimates", dest="estimates", action="store_false",
                   help="do not score the start estimates (each request that queues costs a walk of the head of "
                   "the queue: a long overloaded trace replays faster without)")
    p.add_argument("--suspendable", choices=["auto", "yes", "no"], default="auto",
                   help="whether the lease mode's holders make their requests suspendable (issue 33): 'auto' "
                   "(default) when the policy's preempt_mode is 'suspend' (so other policies decide as before)")
    p.add_argument("--suspend-seconds-per-gib", type=float, default=SUSPEND_SECONDS_PER_GIB, metavar="S",
                   help="seconds a holder takes to suspend per GiB of its GPU-memory footprint (default "
                   f"{SUSPEND_SECONDS_PER_GIB:g}: measured through CUDA checkpoint on an H100, driver 580, "
                   "docs/gpu-checks.md)")
    p.add_argument("--resume-seconds-per-gib", type=float, default=RESUME_SECONDS_PER_GIB, metavar="S",
                   help=f"seconds to resume per GiB (default {RESUME_SECONDS_PER_GIB:g}, the same measurement)")
    p.add_argument("--gib-per-gpu", type=float, default=GIB_PER_GPU, metavar="GIB",
                   help=f"a burst's GPU-memory footprint per GPU when the trace has no gpu_mem_gib column "
                   f"(default {GIB_PER_GPU:g})")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    return p


def run(args: argparse.Namespace, progress: ProgressLine | None = None) -> dict[str, Any]:
    trace = load_trace(args.bursts, args.sessions)
    if args.tile > 1:
        trace = tile(trace, args.tile)
    policy = load_policy(args.config)
    try:
        suspend = Suspend({"auto": None, "yes": True, "no": False}[args.suspendable], args.suspend_seconds_per_gib,
                          args.resume_seconds_per_gib, args.gib_per_gpu)
    except ValueError as e:
        raise TraceError(str(e)) from None
    idles = args.sweep or [policy.default_idle_timeout_seconds if args.idle is None else args.idle]
    t0 = time.perf_counter()
    baseline = None
    if args.baseline == "session":
        baseline = summarize(replay(trace, args.cluster, policy, mode="session", progress=progress))
    runs = []
    for idle in idles:
        s = summarize(replay(trace, args.cluster, policy, mode="lease", idle=idle, progress=progress,
                             limits=args.limits, estimates=args.estimates, suspend=suspend))
        if baseline is not None:
            s.update(compare(s, baseline))
        runs.append(s)
    out: dict[str, Any] = {
        "trace": {"bursts": args.bursts, "sessions": args.sessions, "tile": args.tile, "n_bursts": len(trace.bursts)},
        "cluster": str(args.cluster),
        "baseline": baseline,
        "runs": runs,
        "wall_s": time.perf_counter() - t0,
    }
    if args.plot:
        if baseline is None:
            raise TraceError("--plot needs the session baseline (drop --baseline none)")
        written = plot(runs, baseline, args.plot)
        out["plot"] = written
        if written is None:
            out["plot_error"] = "matplotlib is not installed: pip install matplotlib (or the 'test' extra)"
    return out


def _clean(x: Any) -> Any:
    """JSON without NaN: NaN (no values) becomes null."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    return x


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.plot and not args.sweep:
        args.sweep = [args.idle if args.idle is not None else 600.0]
    progress = ProgressLine(sys.stderr) if not args.json and sys.stderr.isatty() else None
    try:
        out = run(args, progress)
    except (TraceError, LeaseError) as e:
        out = {"error": e.message if isinstance(e, LeaseError) else str(e)}
    finally:
        if progress is not None:
            progress.close()  # before anything else is printed
    if "error" in out:
        if args.json:
            print(json.dumps({"error": out["error"]}))
        print(f"gpulease replay: {out['error']}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(_clean(out), indent=2))
        return 0
    print(describe(out["runs"], out["baseline"]))
    if args.plot:
        print(f"plot: {out['plot']}" if out.get("plot") else f"plot not written: {out['plot_error']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
