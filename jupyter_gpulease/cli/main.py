"""`gpulease`: the user's command line for the broker."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from ..client import BrokerClient, BrokerError
from ..tables import fmt_duration, leases_table, queue_table, status_text
from . import admin


def _request(c: BrokerClient, args: argparse.Namespace) -> Any:
    lease = c.request_lease(
        args.gpus, duration_seconds=args.time, idle_timeout_seconds=args.idle, priority=args.priority,
        mem=args.mem, locality="any" if args.spread else None,
        heartbeat=False,  # nothing stays behind to heartbeat: the time limit and idleness apply
    )
    if args.wait and lease.state == "queued":
        deadline = time.time() + (args.wait_seconds or 1e9)
        while lease.state == "queued" and time.time() < deadline:
            wait = min(30.0, deadline - time.time())
            if not args.json:
                print(f"queued: position {lease.position}...", file=sys.stderr)
            lease = c.lease(lease.id, wait=wait)
    if args.json:
        return lease.raw
    env = lease.env.get("CUDA_VISIBLE_DEVICES", "")
    out = f"{lease.id} {lease.state}"
    if lease.state == "queued":
        out += f" (position {lease.position})"
    if env:
        out += f"\nCUDA_VISIBLE_DEVICES={env}"
    return out


COMMANDS_GROUP = "jupyter_gpulease.commands"
BUILTIN_COMMANDS = ("status", "gpus", "queue", "leases", "request", "release", "renew", "show", "admin")


def _registered_command(argv: list[str]) -> int | None:
    """``gpulease [--json] NAME ...`` where another package registers NAME in the entry point group
    ``jupyter_gpulease.commands`` (the broker's ``replay``): loaded only when named, and run with the rest."""
    before: list[str] = []
    for i, arg in enumerate(argv):
        if not arg.startswith("-") and (not before or before[-1] != "--broker"):
            if arg in BUILTIN_COMMANDS:
                return None
            from importlib.metadata import entry_points

            found = [ep for ep in entry_points(group=COMMANDS_GROUP) if ep.name == arg]
            if not found:
                print(f"gpulease: no command {arg!r}: use one of {', '.join(BUILTIN_COMMANDS)} (gpulease -h), or "
                      "install the package that adds it: 'replay' comes with the lease broker (lease_broker, "
                      "registered in the entry point group jupyter_gpulease.commands)", file=sys.stderr)
                return 2
            command: Callable[[list[str]], int] = found[0].load()
            return command(argv[i + 1:] + [a for a in before if a == "--json"])
        before.append(arg)
    return None


def main(argv: list[str] | None = None) -> int:
    code = _registered_command(sys.argv[1:] if argv is None else list(argv))
    if code is not None:
        return code
    p = argparse.ArgumentParser(
        prog="gpulease", description="Lease GPUs from the jupyter-gpulease broker.",
        epilog="Other packages add commands (entry point group jupyter_gpulease.commands): the lease broker adds "
        "'gpulease replay' (replay a GPU trace through the broker's scheduler; see gpulease replay -h).")
    p.add_argument("--broker", help="broker URL (default: $GPULEASE_BROKER or the default socket)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("status", help="GPUs, their state and the queue")
    sub.add_parser("gpus", help="the GPUs")
    sub.add_parser("queue", help="the queue with positions")
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
    admin.add_parser(sub)
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
            status = c.status()
            out: Any = status if args.json else status_text(c.url, status)
        elif args.cmd == "gpus":
            out = c.gpus()
        elif args.cmd == "queue":
            q = c.queue()
            out = q if args.json else (queue_table(q) if q else "The queue is empty.")
        elif args.cmd == "leases":
            leases = c.leases(everyone=args.all, ended=args.ended)
            out = [x.raw for x in leases] if args.json else (leases_table(leases) if leases else "No leases.")
        elif args.cmd == "request":
            out = _request(c, args)
        elif args.cmd == "release":
            lease = c.release(args.lease_id)
            out = lease.raw if args.json else f"{lease.id} {lease.state}"
        elif args.cmd == "admin":
            out = admin.run(c, args)
        elif args.cmd == "renew":
            lease = c.renew(args.lease_id, args.time)
            out = lease.raw if args.json else f"{lease.id} expires in {fmt_duration((lease.expires_at or 0) - time.time())}"
        else:
            shown = {**c.lease(args.lease_id).raw, "history": c.history(args.lease_id)}
            out = shown if args.json else json.dumps(shown, indent=2)
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

