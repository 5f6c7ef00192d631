"""`gpulease`: the user's command line for the broker."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable
from typing import Any

from gpulease_protocol.requests import parse_duration, request_fields

from ..client import BrokerClient, BrokerError
from ..notify import USAGE, notify, notify_text
from ..tables import fmt_duration, gpus_table, lease_text, leases_table, queue_table, status_text
from . import admin

#: the request options and the body fields they carry: a broker's message about a field names the option instead
OPTION_OF_FIELD = {"duration_seconds": "--time", "idle_timeout_seconds": "--idle", "mem_bytes": "--mem", "mem": "--mem",
                   "wait_seconds": "--wait", "gpu_type": "--gpu-type", "gpu_mem": "--gpu-mem"}
#: options whose value may look like a negative number (``--time -5m``), which argparse would take for an option
VALUE_OPTIONS = ("--time", "--idle", "--mem", "--gpu-mem", "--wait")


class CliError(Exception):
    """A one-line error for the user, with the exit status."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def _request(c: BrokerClient, args: argparse.Namespace) -> Any:
    try:
        fields = request_fields(args.gpus, mem=args.mem, time=args.time, idle=args.idle, gpu_type=args.gpu_type,
                                gpu_mem=args.gpu_mem, flag="--")
        wait = parse_duration(args.wait, "--wait") if args.wait not in (None, "0") else 0.0
    except ValueError as e:  # the broker would refuse it the same way (400): same exit status
        raise CliError(str(e)) from None
    if args.queue and args.wait is None:
        raise CliError("--queue only makes sense with --wait SECONDS: without --wait the request stays queued anyway",
                       2)
    lease = c.request_lease(
        fields.pop("gpus"), priority=args.priority, locality="any" if args.spread else None,
        heartbeat=False,  # nothing stays behind to heartbeat: the time limit and idleness apply
        **fields,
    )
    if args.wait is not None and lease.state == "queued":
        start = time.monotonic()
        deadline = start + (wait or 1e9)
        try:
            while lease.state == "queued" and time.monotonic() < deadline:
                if not args.json:
                    print(f"queued: position {lease.position}...", file=sys.stderr)
                lease = c.lease(lease.id, wait=max(0.05, min(30.0, deadline - time.monotonic())))
        except KeyboardInterrupt:
            _cancel(c, lease.id)
            raise CliError(f"interrupted after {fmt_duration(time.monotonic() - start)} in the queue: request "
                           f"{lease.id} cancelled", 130) from None
        if lease.state == "queued" and not args.queue:
            _cancel(c, lease.id)
            raise CliError(f"no GPU within --wait {fmt_duration(wait)} (was position {lease.position}): request {lease.id} "
                           "cancelled; add --queue to keep it waiting, or leave out --wait")
    if args.json:
        return lease.raw
    env = lease.env.get("CUDA_VISIBLE_DEVICES", "")
    out = f"{lease.id} {lease.state}"
    if lease.state == "queued":
        out += f" (position {lease.position})"
    elif not lease.holding:
        out += f" ({lease.reason})"
    if env:
        out += f"\nCUDA_VISIBLE_DEVICES={env}"
    return out


def _cancel(c: BrokerClient, lease_id: str) -> None:
    try:
        c.release(lease_id, "cancelled")
    except BrokerError as e:
        if e.status not in (404, 409):  # granted or ended meanwhile is fine; anything else is worth saying
            print(f"gpulease: could not cancel {lease_id}: {e.message}", file=sys.stderr)


def _prepare(argv: list[str]) -> tuple[list[str], bool]:
    """``--json`` taken from anywhere (before or after the command, as ``replay`` takes it), and ``--time -5m``
    made ``--time=-5m`` so a negative value gets the option's own clear error, not argparse's."""
    out: list[str] = []
    as_json = False
    rest: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i:]
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--json" and not (out and out[-1] == "--broker"):
            as_json = True
        elif a in VALUE_OPTIONS and i + 1 < len(argv) and re.match(r"-[\d.]", argv[i + 1]):
            out.append(f"{a}={argv[i + 1]}")
            i += 1
        else:
            out.append(a)
        i += 1
    return out + rest, as_json


def _option_names(message: str) -> str:
    """A broker message with the body's field names replaced by the options that carry them."""
    for name, option in OPTION_OF_FIELD.items():
        message = re.sub(rf"\b{name}\b", option, message)
    return message


def _client(url: str | None) -> BrokerClient:
    try:
        return BrokerClient(url)
    except ValueError:
        given, where = (url, "--broker") if url else (os.environ.get("GPULEASE_BROKER", ""), "GPULEASE_BROKER")
        raise CliError(f"{where}={given!r} is not a broker address: use unix:///path/to.sock or http://host:port "
                       "(or unset it for the default socket)", 2) from None


COMMANDS_GROUP = "jupyter_gpulease.commands"
BUILTIN_COMMANDS = ("status", "gpus", "queue", "leases", "request", "release", "renew", "show", "notify", "admin")


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
    argv = sys.argv[1:] if argv is None else list(argv)
    code = _registered_command(argv)
    if code is not None:
        return code
    argv, as_json = _prepare(argv)
    p = argparse.ArgumentParser(
        prog="gpulease", description="Lease GPUs from the jupyter-gpulease broker.",
        epilog="Other packages add commands (entry point group jupyter_gpulease.commands): the lease broker adds "
        "'gpulease replay' (replay a GPU trace through the broker's scheduler; see gpulease replay -h).")
    p.add_argument("--broker", help="broker URL (default: $GPULEASE_BROKER or the default socket)")
    p.add_argument("--json", action="store_true",
                   help="print JSON instead of tables (before or after the command: gpulease leases --json)")
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
    rp.add_argument("--gpu-type", help="GPU model or MIG profile every GPU must be, e.g. H100 or 1g.10gb")
    rp.add_argument("--gpu-mem", help="memory every GPU must have at least, e.g. 40G")
    rp.add_argument("--priority", help="priority class")
    rp.add_argument("--spread", action="store_true", help="allow the GPUs to span nodes")
    rp.add_argument("--wait", nargs="?", const="0", default=None, metavar="SECONDS",
                    help="wait for the grant, at most SECONDS (e.g. 90, 5m); not granted by then: the request is "
                    "cancelled and the exit status is 1 (see --queue)")
    rp.add_argument("--queue", action="store_true",
                    help="with --wait SECONDS: keep the request queued when the wait ends (exit status 0)")
    np_ = sub.add_parser("notify", help="what the broker tells you about when JupyterLab is closed",
                         description=USAGE)
    np_.add_argument("words", nargs="*", metavar="show|on|off|KIND[,KIND]",
                     help="nothing or show: your choice; on/off: every kind or none; else the kinds to keep")
    admin.add_parser(sub)
    for name, hlp in (("release", "release (or cancel) a lease"), ("renew", "extend a lease"),
                      ("show", "one lease with its history")):
        sp = sub.add_parser(name, help=hlp)
        sp.add_argument("lease_id")
        if name == "renew":
            sp.add_argument("--time", help="new time left, e.g. 1h")
    args = p.parse_args(argv)
    args.json = args.json or as_json
    try:
        c = _client(args.broker)
        if args.cmd == "status":
            status = c.status()
            out: Any = status if args.json else status_text(c.url, status)
        elif args.cmd == "gpus":
            gpus = c.gpus()
            out = gpus if args.json else gpus_table(gpus["gpus"])
        elif args.cmd == "queue":
            q = c.queue()
            out = q if args.json else (queue_table(q) if q else "The queue is empty.")
        elif args.cmd == "leases":
            leases = c.leases(everyone=args.all, ended=args.ended)
            out = [x.raw for x in leases] if args.json else (leases_table(leases) if leases else "No leases.")
        elif args.cmd == "request":
            out = _request(c, args)
        elif args.cmd == "release":
            lease = c.release(args.lease_id, "released with gpulease release")
            out = lease.raw if args.json else f"{lease.id} {lease.state}"
        elif args.cmd == "admin":
            out = admin.run(c, args)
        elif args.cmd == "notify":
            answer = notify(c, args.words)
            out = answer if args.json else notify_text(answer)
        elif args.cmd == "renew":
            try:
                seconds = parse_duration(args.time, "--time") if args.time is not None else None
            except ValueError as e:
                raise CliError(str(e)) from None
            lease = c.renew(args.lease_id, seconds)
            out = lease.raw if args.json else f"{lease.id} expires in {fmt_duration((lease.expires_at or 0) - time.time())}"
        else:
            lease, history = c.lease(args.lease_id), c.history(args.lease_id)
            out = {**lease.raw, "history": history} if args.json else lease_text(lease, history)
    except BrokerError as e:
        message = _option_names(e.message) if args.cmd in ("request", "renew") else e.message
        if args.json:
            print(json.dumps({"status": e.status, "reason": e.reason, "message": message}))
        print(f"gpulease: {message}", file=sys.stderr)
        return 1
    except CliError as e:
        print(f"gpulease: {e}", file=sys.stderr)
        return e.code
    except ValueError as e:  # a bad argument that argparse cannot check (an assignment, a time)
        print(f"gpulease: {e}", file=sys.stderr)
        return 2
    print(json.dumps(out, indent=2) if args.json and not isinstance(out, str) else out)
    return 0
