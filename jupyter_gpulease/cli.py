"""`gpulease`: the user's command line for the broker."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from . import admin_cli
from .client import BrokerClient, BrokerError
from .format import fmt_bytes, fmt_duration, lease_gpus, table


def _status(c: BrokerClient, args: argparse.Namespace) -> Any:
    info = c.info()
    gpus = c.gpus()["gpus"]
    queue = c.queue()
    reservations = c.reservations()
    if args.json:
        return {"info": info, "gpus": gpus, "queue": queue, "reservations": reservations}
    s = info["summary"]
    sim = " (SIMULATED inventory)" if info["simulated"] else ""
    reserved = f", {s['states']['reserved']} reserved" if s["states"].get("reserved") else ""
    lines = [f"Broker {info['version']} at {c.url}{sim}: {s['free']}/{s['total']} GPUs free{reserved}, "
             f"{s['queued']} queued"]
    rows = []
    for g in gpus:
        holders = ", ".join(h["user"] + ("" if h["fraction"] == 1 else f" ({h['fraction']:g})") for h in g["holders"])
        rows.append([g["node"], g["index"], g["name"] + (" [sim]" if g["simulated"] else ""),
                     f"{fmt_bytes(g['memory_used'])}/{fmt_bytes(g['memory_total'])}", f"{g['utilization']:.0f}%",
                     _gpu_state(g), holders])
    lines.append(table(["NODE", "IDX", "NAME", "MEMORY", "UTIL", "STATE", "HELD BY"], rows))
    if queue:
        lines.append("")
        lines.append(_queue_table(queue))
    if reservations:
        lines.append("")
        lines.append(admin_cli.reservations_table(reservations))
    return "\n".join(lines)


def _gpu_state(g: dict[str, Any]) -> str:
    r = g.get("reservation")
    if g["state"] == "reserved" and r:
        return f"reserved ({r['user'] or '@' + r['group']} until {time.strftime('%H:%M', time.localtime(r['end']))})"
    return str(g["state"])


def _queue_table(queue: list[dict[str, Any]]) -> str:
    rows = [[q["position"], q["user"], q["lease_id"] or "-", lease_gpus(q), q["priority"],
             fmt_duration(q["waited_seconds"]),
             fmt_duration(max(0.0, q["estimated_start"] - time.time())) if q.get("estimated_start") else "?"]
            for q in queue]
    return table(["POS", "USER", "LEASE", "GPUS", "PRIORITY", "WAITED", "EST. START IN"], rows)


def _leases_table(leases: list[dict[str, Any]]) -> str:
    now = time.time()
    rows = []
    for lease in leases:
        left = fmt_duration(lease["expires_at"] - now) if lease.get("expires_at") and not lease["ended_at"] else "-"
        devs = ",".join(f"{d['node']}:{d['index']}" for d in lease["devices"]) or "-"
        rows.append([lease["id"], lease["user"], lease["state"], lease_gpus(lease), devs, left, lease["reason"]])
    return table(["LEASE", "USER", "STATE", "GPUS", "DEVICES", "TIME LEFT", "REASON"], rows)


def _request(c: BrokerClient, args: argparse.Namespace) -> Any:
    wait = 0.0
    lease = c.request_lease(
        args.gpus, duration_seconds=args.time, idle_timeout_seconds=args.idle, priority=args.priority,
        mem=args.mem, locality="any" if args.spread else None,
        heartbeat=False,  # nothing stays behind to heartbeat: the time limit and idleness apply
    )
    if args.wait and lease["state"] == "queued":
        deadline = time.time() + (args.wait_seconds or 1e9)
        while lease["state"] == "queued" and time.time() < deadline:
            wait = min(30.0, deadline - time.time())
            if not args.json:
                print(f"queued: position {lease.get('position')}...", file=sys.stderr)
            lease = c.lease(lease["id"], wait=wait)
    if args.json:
        return lease
    env = lease.get("env", {}).get("CUDA_VISIBLE_DEVICES", "")
    out = f"{lease['id']} {lease['state']}"
    if lease["state"] == "queued":
        out += f" (position {lease.get('position')})"
    if env:
        out += f"\nCUDA_VISIBLE_DEVICES={env}"
    return out


def _replay(argv: list[str]) -> int | None:
    """``gpulease [--json] replay ...`` runs the trace replay (lease_broker.replay), imported only then."""
    before: list[str] = []
    for i, arg in enumerate(argv):
        if arg == "replay":
            from lease_broker.replay.cli import main as replay_main

            return replay_main(argv[i + 1:] + [a for a in before if a == "--json"])
        if not arg.startswith("-") and (not before or before[-1] != "--broker"):
            return None
        before.append(arg)
    return None


def main(argv: list[str] | None = None) -> int:
    code = _replay(sys.argv[1:] if argv is None else list(argv))
    if code is not None:
        return code
    p = argparse.ArgumentParser(prog="gpulease", description="Lease GPUs from the jupyter-gpulease broker.")
    p.add_argument("--broker", help="broker URL (default: $GPULEASE_BROKER or the default socket)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("status", help="GPUs, their state and the queue")
    sub.add_parser("gpus", help="the GPUs")
    sub.add_parser("queue", help="the queue with positions")
    sub.add_parser("replay", help="replay a GPU trace through the broker's scheduler (see gpulease replay -h)")
    lp = sub.add_parser("leases", help="your leases (all with --all, admins only)")
    lp.add_argument("--all", action="store_true", help="every user's leases (admins)")
    lp.add_argument("--ended", type=int, default=0, help="also show this many recent ended leases")
    rp = sub.add_parser("request", help="ask for a lease")
    rp.add_argument("gpus", nargs="?", default="1", help="N, MIN-MAX, or a fraction like 0.5")
    rp.add_argument("--time", help="time limit, e.g. 30m")
    rp.add_argument("--idle", help="idle timeout, e.g. 10m")
    rp.add_argument("--mem", help="memory on a shared GPU, e.g. 10G")
    rp.add_argument("--priority", help="priority class")
    rp.add_argument("--spread", action="store_true", help="allow the GPUs to span nodes")
    rp.add_argument("--wait", nargs="?", const="0", default=None, metavar="SECONDS",
                    help="wait for the grant (at most SECONDS)")
    admin_cli.add_parser(sub)
    for name, hlp in (("release", "release (or cancel) a lease"), ("renew", "extend a lease"),
                      ("show", "one lease with its history")):
        sp = sub.add_parser(name, help=hlp)
        sp.add_argument("lease_id")
        if name == "renew":
            sp.add_argument("--time", help="new time left, e.g. 1h")
    args = p.parse_args(argv)
    if args.cmd == "request":
        args.wait_seconds = float(args.wait) if args.wait not in (None, "0") else 0.0
        args.wait = args.wait is not None
    c = BrokerClient(args.broker)
    try:
        if args.cmd == "status":
            out: Any = _status(c, args)
        elif args.cmd == "gpus":
            out = c.gpus()
        elif args.cmd == "queue":
            q = c.queue()
            out = q if args.json else (_queue_table(q) if q else "The queue is empty.")
        elif args.cmd == "leases":
            leases = c.leases(everyone=args.all, ended=args.ended)
            out = leases if args.json else (_leases_table(leases) if leases else "No leases.")
        elif args.cmd == "request":
            out = _request(c, args)
        elif args.cmd == "release":
            lease = c.release(args.lease_id)
            out = lease if args.json else f"{lease['id']} {lease['state']}"
        elif args.cmd == "admin":
            out = admin_cli.run(c, args)
        elif args.cmd == "renew":
            lease = c.renew(args.lease_id, args.time)
            out = lease if args.json else f"{lease['id']} expires in {fmt_duration(lease['expires_at'] - time.time())}"
        else:
            lease = c.lease(args.lease_id)
            lease["history"] = c.history(args.lease_id)
            out = lease if args.json else json.dumps(lease, indent=2)
    except BrokerError as e:
        if args.json:
            print(json.dumps({"status": e.status, "reason": e.reason, "message": e.message}))
        print(f"gpulease: {e.message}", file=sys.stderr)
        return 1
    except ValueError as e:  # a bad argument that argparse cannot check (an assignment, a time)
        print(f"gpulease: {e}", file=sys.stderr)
        return 2
    print(json.dumps(out, indent=2) if args.json and not isinstance(out, str) else out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
