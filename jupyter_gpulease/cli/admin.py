"""`gpulease admin`: policy, revocations, reservations and usage, over the broker's REST API.

    gpulease admin policy show [OPTION ...]
    gpulease admin policy set max_gpus_per_user=4 user_limits.alice.max_gpus=8 preempt_grace_seconds='{"high": 300}'
    gpulease admin policy audit
    gpulease admin revoke LEASE_ID --reason "maintenance"
    gpulease admin reserve create 2 --user alice --start +1h --time 2h
    gpulease admin reserve list [--all]
    gpulease admin reserve cancel RESERVATION_ID
    gpulease admin usage --since 30d --by user|group|label|notebook [--label KEY] [--csv]

The broker decides who may do what: policy changes and revocations are for admins; users may reserve GPUs
for themselves within policy (``user_reservation_max_gpus``) and see their own usage.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import time
import urllib.parse
from typing import Any

from gpulease_protocol.words import clock_text, gpus_text

from ..client import BrokerClient
from ..tables import fmt_bytes, reservations_table, table, usage_csv


def _value(text: str) -> Any:
    """A policy value from the command line: JSON (4, 2.5, true, {"high": 300}, ["a"]), else the plain string."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_assignments(pairs: list[str], current: dict[str, Any]) -> dict[str, Any]:
    """``["a=1", "user_limits.alice.max_gpus=8"]`` -> the options to send; a dotted name sets one key of a
    dict option, keeping its other keys (``current`` is the policy now)."""
    changes: dict[str, Any] = {}
    for pair in pairs:
        name, sep, raw = pair.partition("=")
        if not sep or not name:
            raise ValueError(f"invalid assignment {pair!r}: write OPTION=VALUE, e.g. max_gpus_per_user=4")
        option, *path = name.split(".")
        if option not in current:
            raise ValueError(f"unknown policy option {option!r}: see `gpulease admin policy show`")
        if not path:
            changes[option] = _value(raw)
            continue
        base = changes.get(option, current[option])
        if not isinstance(base, dict):
            raise ValueError(f"{option} is not a dict: set it whole, e.g. {option}=VALUE")
        root = node = json.loads(json.dumps(base))  # a copy
        for key in path[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ValueError(f"{name}: {key!r} is not a dict")
        node[path[-1]] = _value(raw)
        changes[option] = root
    return changes


def when(text: str | None, now: float) -> float | str | None:
    """'now', '+2h' (passed on), epoch seconds, or a local date-time like '2025-03-01 09:00' -> epoch."""
    if text is None:
        return None
    t = text.strip()
    if t == "now" or t.startswith("+"):
        return t
    try:
        return float(t)
    except ValueError:
        pass
    try:
        return dt.datetime.fromisoformat(t).timestamp()
    except ValueError:
        raise ValueError(f"invalid time {text!r}: give 'now', '+2h', epoch seconds or '2025-03-01 09:00'") from None


def _policy_show(c: BrokerClient, args: argparse.Namespace) -> Any:
    policy = c.request("GET", "/api/v1/policy")["policy"]
    if args.options:
        unknown = [o for o in args.options if o not in policy]
        if unknown:
            raise ValueError(f"unknown policy option(s): {', '.join(unknown)}")
        policy = {k: policy[k] for k in args.options}
    if args.json:
        return policy
    return table(["OPTION", "VALUE"], [[k, json.dumps(v)] for k, v in sorted(policy.items())])


def _policy_set(c: BrokerClient, args: argparse.Namespace) -> Any:
    current = c.request("GET", "/api/v1/policy")["policy"]
    out = c.request("PUT", "/api/v1/policy", {"policy": parse_assignments(args.assignments, current)})
    if args.json:
        return out
    if not out["changed"]:
        return "Nothing changed."
    return "\n".join(f"{k}: {json.dumps(old)} -> {json.dumps(new)}" for k, (old, new) in sorted(out["changed"].items()))


def _policy_audit(c: BrokerClient, args: argparse.Namespace) -> Any:
    audit = c.request("GET", f"/api/v1/policy/audit?limit={args.limit}")["audit"]
    if args.json:
        return audit
    rows = [[clock_text(a["at"], time.time()), a["who"], a["source"],
             "; ".join(f"{k}: {json.dumps(o)} -> {json.dumps(n)}" for k, (o, n) in sorted(a["diff"].items()))]
            for a in audit]
    return table(["WHEN", "WHO", "SOURCE", "CHANGES"], rows) if rows else "No policy changes yet."


def _revoke(c: BrokerClient, args: argparse.Namespace) -> Any:
    lease = c.revoke(args.lease_id, args.reason)
    return lease.raw if args.json else f"{lease.id} {lease.state} ({lease.reason})"


def _reserve(c: BrokerClient, args: argparse.Namespace) -> Any:
    if args.action == "list":
        q = "?all=1" if args.all else ""
        rs = c.request("GET", "/api/v1/reservations" + q)["reservations"]
        return rs if args.json else (reservations_table(rs) if rs else "No reservations.")
    if args.action == "cancel":
        r = c.request("DELETE", f"/api/v1/reservations/{urllib.parse.quote(args.reservation_id)}")
        return r if args.json else f"{r['id']} cancelled"
    now = time.time()
    body: dict[str, Any] = {"gpus": args.gpus, "start": when(args.start, now)}
    if args.user:
        body["user"] = args.user
    if args.group:
        body["group"] = args.group
    if args.end:
        body["end"] = when(args.end, now)
    else:
        body["duration_seconds"] = args.time
    if args.note:
        body["note"] = args.note
    r = c.request("POST", "/api/v1/reservations", body)
    if args.json:
        return r
    return (f"{r['id']}: {gpus_text(r['gpus'])} for {r['user'] or '@' + r['group']} "
            f"from {clock_text(r['start'], time.time())} to {clock_text(r['end'], time.time())}")


def _usage(c: BrokerClient, args: argparse.Namespace) -> Any:
    query = {"since": args.since, "by": args.by, **({"label": args.label} if args.label else {})}
    out = c.request("GET", "/api/v1/usage?" + urllib.parse.urlencode(query))
    if args.json:
        return out
    if args.csv:
        return usage_csv(out["rows"], args.label if args.by == "label" else args.by)
    rows = []
    for u in out["rows"]:
        held, busy = u["gpu_hours_held"], u["gpu_hours_busy"]
        mean = u["mean_utilization"]
        rows.append([u["key"] or "-", f"{held:.2f}", f"{busy:.2f}", f"{100 * busy / held:.0f}%" if held else "-",
                     fmt_bytes(u["peak_memory"]) if u["peak_memory"] is not None else "-",
                     f"{mean:.0f}%" if mean is not None else "-", u["leases"], u["revocations"], u["preempted"]])
    head = f"GPU use since {clock_text(out['since'], time.time())}"
    if not rows:
        return head + ": none."
    what = (args.label if args.by == "label" else args.by).upper()
    return head + "\n" + table([what, "GPU-H HELD", "GPU-H BUSY", "BUSY", "PEAK MEM", "MEAN UTIL", "LEASES",
                                "REVOKED", "PREEMPTED"], rows)


def add_parser(sub: Any) -> None:
    """The ``admin`` command and its subcommands, on the ``gpulease`` parser's subparsers."""
    ap = sub.add_parser("admin", help="admin: policy, revoke, reservations, usage (see gpulease admin -h)",
                        description="Broker administration. Policy changes and revocations need an admin.")
    asub = ap.add_subparsers(dest="admin_cmd", required=True)
    pp = asub.add_parser("policy", help="show, change or audit the broker's policy")
    psub = pp.add_subparsers(dest="policy_cmd", required=True)
    show = psub.add_parser("show", help="every policy option and its value (or only the named ones)")
    show.add_argument("options", nargs="*", metavar="OPTION")
    pset = psub.add_parser("set", help="change options at once, without dropping leases: OPTION=VALUE ...",
                           description="VALUE is JSON (4, true, '{\"high\": 300}') or a plain string. "
                           "A dotted OPTION sets one key of a dict option: user_limits.alice.max_gpus=8.")
    pset.add_argument("assignments", nargs="+", metavar="OPTION=VALUE")
    audit = psub.add_parser("audit", help="who changed the policy, when, and what")
    audit.add_argument("--limit", type=int, default=50)
    rv = asub.add_parser("revoke", help="revoke a lease (its holder sees the reason)")
    rv.add_argument("lease_id")
    rv.add_argument("--reason", required=True, help="why, e.g. 'maintenance'")
    rs = asub.add_parser("reserve", help="book GPUs for a user or group for a time window; list; cancel")
    rsub = rs.add_subparsers(dest="action", required=True)
    cr = rsub.add_parser("create", help="book N GPUs")
    cr.add_argument("gpus", type=int, metavar="N")
    who = cr.add_mutually_exclusive_group(required=True)
    who.add_argument("--user", help="for this user")
    who.add_argument("--group", help="for the members of this group")
    cr.add_argument("--start", default="now", help="'now', '+2h', or a local time '2025-03-01 09:00' (default now)")
    length = cr.add_mutually_exclusive_group()
    length.add_argument("--end", help="end time (same forms as --start)")
    length.add_argument("--time", default="1h", help="length of the window, e.g. 4h (default 1h)")
    cr.add_argument("--note", help="shown in the list, e.g. 'paper deadline'")
    ls = rsub.add_parser("list", help="reservations that have not ended")
    ls.add_argument("--all", action="store_true", help="cancelled ones too")
    cn = rsub.add_parser("cancel", help="cancel a reservation")
    cn.add_argument("reservation_id")
    us = asub.add_parser("usage", help="per user, group, label or notebook: GPU-hours held and busy, peak memory, "
                         "utilisation, leases, revocations (--csv for chargeback)")
    us.add_argument("--since", default="7d", help="how far back, e.g. 24h, 7d, 30d (default 7d)")
    us.add_argument("--by", choices=["user", "group", "label", "notebook"], default="user",
                    help="one row per user (default), group (a lease counts in each of its user's groups), value of "
                    "the label --label, or notebook")
    us.add_argument("--label", default="", help="with --by label: the label key, e.g. project")
    us.add_argument("--csv", action="store_true", help="CSV for a spreadsheet or a chargeback script")


def run(c: BrokerClient, args: argparse.Namespace) -> Any:
    if args.admin_cmd == "policy":
        return {"show": _policy_show, "set": _policy_set, "audit": _policy_audit}[args.policy_cmd](c, args)
    return {"revoke": _revoke, "reserve": _reserve, "usage": _usage}[args.admin_cmd](c, args)
