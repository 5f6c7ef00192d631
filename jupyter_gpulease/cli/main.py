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

from gpulease_protocol.address import BROKER_FORMS, broker_url, check_broker_url
from gpulease_protocol.requests import parse_duration, request_fields
from gpulease_protocol.words import clock_text, duration_text

from ..client import BrokerClient, BrokerError
from ..notify import USAGE, notify, notify_text
from ..tables import (
    gpus_table,
    lease_text,
    leases_table,
    queue_table,
    quota_table,
    status_text,
)
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
    if args.wait is not None and lease.phase == "queued":
        start = time.monotonic()
        deadline = start + (wait or 1e9)
        try:
            while lease.phase == "queued" and time.monotonic() < deadline:
                if not args.json:
                    print(f"queued: position {lease.position}{_waiting(lease, ', ')}...", file=sys.stderr)
                lease = c.lease(lease.id, wait=max(0.05, min(30.0, deadline - time.monotonic())))
        except KeyboardInterrupt:
            _cancel(c, lease.id)
            raise CliError(f"interrupted after {duration_text(time.monotonic() - start)} in the queue: request "
                           f"{lease.id} cancelled", 130) from None
        if lease.phase == "queued" and not args.queue:
            _cancel(c, lease.id)
            raise CliError(f"no GPU within --wait {duration_text(wait)} (was position {lease.position}): request {lease.id} "
                           "cancelled; add --queue to keep it waiting, or leave out --wait")
    if args.json:
        return lease.raw
    env = lease.env.get("CUDA_VISIBLE_DEVICES", "")
    out = f"{lease.id} {lease.state}"
    if lease.phase == "queued":
        out += f" (position {lease.position})" + _waiting(lease, "\n")
    elif not lease.holding:
        out += f" ({lease.reason})"
    if env:
        out += f"\nCUDA_VISIBLE_DEVICES={env}"
    if not lease.ended:
        out += "\n" + _rules(c, lease)
    return out


def _waiting(lease: Any, sep: str) -> str:
    """Why a queued lease waits and when it will likely start, in the broker's words (``wait.text``,
    ``estimate_text``); nothing where the broker says nothing."""
    words = [w for w in ((lease.get("wait") or {}).get("text"), lease.get("estimate_text")) if w]
    if not words:
        return ""
    if len(words) == 2:
        return f"{sep}waits: {words[0]}; starts: {words[1]}"
    return f"{sep}waits: {words[0]}" if lease.get("wait") else f"{sep}starts: {words[0]}"


def _rules(c: BrokerClient, lease: Any) -> str:
    """The time limit and the idle rules that will end a lease from the command line, from the lease's own fields
    and the broker's policy (``pressure_idle_timeout_seconds``): nothing heartbeats for it, so it is idle unless a
    process attached to it uses its GPUs."""
    now = time.time()
    limit = duration_text(lease.duration_seconds or 0)
    until = f", until {clock_text(lease.expires_at, now)}" if lease.expires_at else " once granted"
    lines = [f"time limit {limit}{until}: 'gpulease renew {lease.id} --time 1h' sets the time left, "
             f"'gpulease release {lease.id}' gives it back"]
    idle = float(lease.idle_timeout_seconds or 0)
    if not idle:
        return lines[0] + "\nidle: never revoked for idleness (no idle timeout)"
    try:
        pressure = float(c.request("GET", "/api/v1/policy")["policy"].get("pressure_idle_timeout_seconds") or 0)
    except (BrokerError, KeyError, TypeError, ValueError):
        pressure = 0.0
    rule = f"idle: revoked after {duration_text(idle)} idle"
    if 0 < pressure < idle:
        rule += f", and after only {duration_text(pressure)} idle while someone waits for its GPUs"
    lines.append(rule + "; it counts as idle unless a process attached to it (BrokerClient.attach) uses its GPUs")
    return "\n".join(lines)


def _renewed(lease: Any, asked: float | None) -> str:
    """What a renewal did: the time left was set (from now), or the lease already ended later (never shortened)."""
    now = time.time()
    left = (lease.expires_at or now) - now
    until = f"until {clock_text(lease.expires_at, now)}" if lease.expires_at else ""
    if lease.phase == "queued":
        return f"{lease.id} renewed: its time limit is now {duration_text(lease.duration_seconds or 0)} once granted"
    if asked is not None and left > asked + 5:
        return (f"{lease.id} unchanged: it already has {duration_text(left)} left ({until}), more than "
                f"{duration_text(asked)}; a renewal sets the time left and never shortens a lease")
    return f"{lease.id} renewed: time left set to {duration_text(left)} from now ({until})"


def _cancel(c: BrokerClient, lease_id: str) -> None:
    try:
        c.release(lease_id, "cancelled")
    except BrokerError as e:
        if e.status not in (404, 409):  # granted or ended meanwhile is fine; anything else is worth saying
            print(f"gpulease: could not cancel {lease_id}: {e.message}", file=sys.stderr)


def _prepare(argv: list[str]) -> tuple[list[str], bool, str | None]:
    """``--json`` and ``--broker URL`` taken from anywhere (before or after the command, as ``replay`` takes
    ``--json``), and ``--time -5m`` made ``--time=-5m`` so a negative value gets the option's own clear error, not
    argparse's. Returns the rest, whether ``--json`` was given and the ``--broker`` given (None: none)."""
    out: list[str] = []
    as_json = False
    broker: str | None = None
    rest: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i:]
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--json":
            as_json = True
        elif a == "--broker":
            if i + 1 >= len(argv):
                raise CliError("--broker needs a value: " + BROKER_FORMS, 2)
            broker = argv[i + 1]
            i += 1
        elif a.startswith("--broker="):
            broker = a.partition("=")[2]
        elif a in VALUE_OPTIONS and i + 1 < len(argv) and re.match(r"-[\d.]", argv[i + 1]):
            out.append(f"{a}={argv[i + 1]}")
            i += 1
        else:
            out.append(a)
        i += 1
    return out + rest, as_json, broker


def _option_names(message: str) -> str:
    """A broker message with the body's field names replaced by the options that carry them."""
    for name, option in OPTION_OF_FIELD.items():
        message = re.sub(rf"\b{name}\b", option, message)
    return message


def _client(url: str | None) -> BrokerClient:
    """The client of ``--broker URL``, else of ``GPULEASE_BROKER``, else of the default socket: either checked by
    the one rule (``address.check_broker_url``) before anything is sent."""
    try:
        return BrokerClient(check_broker_url(url, "--broker") if url is not None else broker_url())
    except ValueError as e:
        unset = "" if url is not None else " (or unset it for the default socket)"
        raise CliError(f"{e}{unset}", 2) from None


COMMANDS_GROUP = "jupyter_gpulease.commands"
BUILTIN_COMMANDS = ("status", "gpus", "queue", "leases", "request", "release", "renew", "show", "quota", "notify",
                    "admin")
#: words a user may try for a command, and the command that does it, with what it does in a few words
NEAR_MISSES = {
    "usage": ("admin usage", "shows GPU-hours per user, group, label or notebook"),
    "policy": ("admin policy show", "shows the broker's policy"),
    "revoke": ("admin revoke", "ends someone's lease (admins)"),
    "reserve": ("admin reserve create", "books GPUs for a time window"),
    "reservations": ("admin reserve list", "lists the reservations"),
    "cancel": ("release", "cancels a queued request or releases a lease"),
    "extend": ("renew", "gives a lease more time"),
    "list": ("leases", "lists your leases"), "ls": ("leases", "lists your leases"),
    "jobs": ("leases", "lists your leases"), "info": ("status", "shows the GPUs and the queue"),
    "budget": ("quota", "shows what is left of your limits"), "limits": ("quota", "shows what is left of your limits"),
    "replay": ("replay", "replays a GPU trace; it comes with the lease broker, which is not installed here"),
}


def _no_command(name: str) -> str:
    """What to say for ``gpulease NAME`` that no command has: the command meant, in plain words."""
    import difflib

    if name in NEAR_MISSES:
        command, does = NEAR_MISSES[name]
        if command == name:
            return f"gpulease: no command {name!r} here: 'gpulease {name}' {does}"
        return f"gpulease: no command {name!r}: 'gpulease {command}' {does} (gpulease -h lists the commands)"
    close = difflib.get_close_matches(name, [*BUILTIN_COMMANDS, *NEAR_MISSES], n=1, cutoff=0.6)
    if close:
        command = NEAR_MISSES[close[0]][0] if close[0] in NEAR_MISSES else close[0]
        return f"gpulease: no command {name!r}: did you mean 'gpulease {command}'? (gpulease -h lists the commands)"
    return f"gpulease: no command {name!r}: use one of {', '.join(BUILTIN_COMMANDS)} (gpulease -h says what each does)"


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
                print(_no_command(arg), file=sys.stderr)
                return 2
            command: Callable[[list[str]], int] = found[0].load()
            return command(argv[i + 1:] + [a for a in before if a == "--json"])
        before.append(arg)
    return None


def main(argv: list[str] | None = None) -> int:
    """``gpulease ...``; the exit status. Output into a pipe closed early (``gpulease status | head -3``) ends
    quietly with 141, as a command killed by SIGPIPE does in a shell."""
    try:
        return _main(sys.argv[1:] if argv is None else list(argv))
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)  # so that the interpreter's last flush does not fail again
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141


def _options(parser: argparse.ArgumentParser) -> list[str]:
    """The long options of a command and of its own commands (``admin usage --since``), ``--help`` aside."""
    out = [o for o in parser._option_string_actions if o.startswith("--") and o != "--help"]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                out += [o for o in _options(child) if o not in out]
    return out


def _stray(argv: list[str], extra: list[str], cmd: str, options: list[str]) -> str:
    """What to say about words argparse could not place (``request 1 --time 5 minutes``): the option whose value
    they follow, the option meant (``--tiem``: ``--time``, from the command's ``options``), else the command's
    own usage."""
    import difflib

    i = argv.index(extra[0]) if extra[0] in argv else -1
    if extra[0].startswith("--"):
        close = difflib.get_close_matches(extra[0].partition("=")[0], options, n=1, cutoff=0.6)
        meant = f": did you mean {close[0]}?" if close else ""
        return f"gpulease {cmd}: no option {extra[0].partition('=')[0]}{meant} (gpulease {cmd} -h lists its options)"
    if i >= 2 and argv[i - 2] in (*VALUE_OPTIONS, "--gpu-type", "--priority"):
        option, value = argv[i - 2], argv[i - 1]
        unit = extra[0][:1].lower()
        example = (f", e.g. {option} {value}{unit}" if option in ("--time", "--idle", "--wait") and unit in "smhd"
                   and value.replace(".", "", 1).isdigit() else "")
        return f"gpulease {cmd}: {option} takes one word, not '{value} {extra[0]}': write it as one{example}"
    return f"gpulease {cmd}: unexpected {' '.join(extra)!r} (gpulease {cmd} -h says what it takes)"


def _main(argv: list[str]) -> int:
    code = _registered_command(argv)
    if code is not None:
        return code
    try:
        argv, as_json, broker = _prepare(argv)
    except CliError as e:
        print(f"gpulease: {e}", file=sys.stderr)
        return e.code
    p = argparse.ArgumentParser(
        prog="gpulease", description="Lease GPUs from the jupyter-gpulease broker.",
        epilog="Where the lease broker is installed, 'gpulease replay' replays a GPU trace through its scheduler "
        "(gpulease replay -h). Admins: gpulease admin -h (policy, revocations, reservations, usage).")
    p.add_argument("--broker", help="broker address, before or after the command: unix:///path/to.sock, a socket "
                   "path, or http://host:port (default: $GPULEASE_BROKER, checked the same way, else the default "
                   "socket)")
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
    qp = sub.add_parser("quota", help="what is left of each limit and budget that applies to you, and when it refills")
    qp.add_argument("--user", help="another user's (admins)")
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
            sp.add_argument("--time", help="set the time left to this, counted from now (e.g. 1h; default: the "
                            "lease's own time limit); it does not add to the time left, and never shortens a lease")
    args, extra = p.parse_known_args(argv)
    if extra:
        print(_stray(argv, extra, args.cmd, _options(sub.choices[args.cmd])), file=sys.stderr)
        return 2
    args.json = args.json or as_json
    try:
        c = _client(broker)
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
        elif args.cmd == "quota":
            quota = c.quota(args.user)
            out = quota if args.json else quota_table(quota)
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
            out = lease.raw if args.json else _renewed(lease, seconds)
        else:
            lease, history = c.lease(args.lease_id), c.history(args.lease_id)
            out = {**lease.raw, "history": history} if args.json else lease_text(lease, history)
    except BrokerError as e:  # the broker's words (a renewal refusal too); a request's fields named as options
        message = _option_names(e.message) if args.cmd == "request" else e.message
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
