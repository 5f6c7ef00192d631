"""Human-readable sizes, durations and tables: what the ``gpulease`` CLI and the ``%gpu`` magic print."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from gpulease_protocol.requests import format_size
from gpulease_protocol.words import clock_text, duration_text, gpus_text, hours_text

from .lease_view import LeaseView

fmt_bytes = format_size  # the one size formatter, shared with the worker's notes


def lease_gpus(item: Mapping[str, Any]) -> str:
    """'2', '1-4' or '0.25', with the GPU type and memory asked for: '2 H100 >=40.0 GiB'."""
    if item.get("fraction", 1.0) < 1.0:
        text = f"{item['fraction']:g}"
    else:
        lo, hi = item.get("min_gpus", 1), item.get("max_gpus", 1)
        text = str(lo) if lo == hi else f"{lo}-{hi}"
    if item.get("gpu_type"):
        text += f" {item['gpu_type']}"
    if item.get("gpu_mem"):
        text += f" >={fmt_bytes(item['gpu_mem'])}"
    return text


def table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [headers] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)).rstrip() for r in cells)


def status_text(url: str, status: dict[str, Any]) -> str:
    """The broker's GPUs, queue and reservations (``BrokerClient.status()``) as text."""
    info = status["info"]
    s = info["summary"]
    sim = " (SIMULATED inventory)" if info["simulated"] else ""
    reserved = f", {s['states']['reserved']} reserved" if s["states"].get("reserved") else ""
    lines = [f"Broker {info['version']} at {url}{sim}: {s['free']}/{s['total']} GPUs free{reserved}, "
             f"{s['queued']} queued"]
    lines.append(gpus_table(status["gpus"]))
    if status["queue"]:
        lines.append("")
        lines.append(queue_table(status["queue"]))
    if status["reservations"]:
        lines.append("")
        lines.append(reservations_table(status["reservations"]))
    return "\n".join(lines)


def gpus_table(gpus: list[dict[str, Any]], now: float | None = None) -> str:
    """The GPUs (``BrokerClient.gpus()["gpus"]``): node, index, name, memory, utilisation, state, holders."""
    if not gpus:
        return "No GPUs."
    rows = []
    for g in gpus:
        holders = ", ".join(h["user"] + ("" if h["fraction"] == 1 else f" ({h['fraction']:g})") for h in g["holders"])
        rows.append([g["node"], g["index"], g["name"] + (" [sim]" if g["simulated"] else ""),
                     f"{fmt_bytes(g['memory_used'])}/{fmt_bytes(g['memory_total'])}", f"{g['utilization']:.0f}%",
                     _gpu_state(g, time.time() if now is None else now), holders])
    return table(["NODE", "IDX", "NAME", "MEMORY", "UTIL", "STATE", "HELD BY"], rows)


def lease_text(lease: LeaseView, history: list[dict[str, Any]], now: float | None = None) -> str:
    """One lease (``gpulease show``): its fields with local times and durations, then its history."""
    now = time.time() if now is None else now

    def when(t: float | None) -> str:
        return clock_text(t, now) if t else "-"

    devs = ", ".join(f"{d.get('node')}:{d.get('index')}" for d in lease.devices) or "-"
    end = lease.ended_at or now
    rows: list[list[Any]] = [
        ["lease", lease.id],
        ["user", lease.user],
        ["state", state_text(lease)],
        ["gpus", f"{lease_gpus(lease)} [{devs}]" + (" (simulated)" if lease.simulated else "")],
        ["priority", lease.priority],
        ["requested", when(lease.created_at)],
    ]
    if lease.phase == "queued":
        rows.append(["position", f"{lease.position or '?'}, waited {duration_text(now - lease.created_at)}"])
        if lease.get("estimate_text"):
            rows.append(["starts", lease["estimate_text"]])
    if lease.granted_at:
        rows.append(["granted", f"{when(lease.granted_at)} (queued {duration_text(lease.granted_at - lease.created_at)})"])
    if lease.expires_at and not lease.ended_at:
        rows.append(["expires", f"{when(lease.expires_at)} (in {duration_text(lease.expires_at - now)})"])
    if lease.ended_at:
        held = f" (held {duration_text(end - lease.granted_at)})" if lease.granted_at else ""
        rows.append(["ended", when(lease.ended_at) + held])
    rows.append(["time limit", duration_text(lease.duration_seconds) if lease.duration_seconds else "-"])
    rows.append(["idle timeout", duration_text(lease.idle_timeout_seconds) if lease.idle_timeout_seconds else "-"])
    rows += usage_rows(lease.usage, ended=bool(lease.ended_at))
    if lease.labels:
        rows.append(["labels", ", ".join(f"{k}={v}" for k, v in sorted(lease.labels.items()))])
    width = max(len(r[0]) for r in rows)
    lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
    if history:
        start = history[0]["at"]
        hist = [[when(h["at"]), "+" + duration_text(h["at"] - start), f"{h.get('from') or '-'} -> {h['to']}",
                 h.get("reason") or ""] for h in history]
        lines += ["", table(["TIME", "AFTER", "TRANSITION", "REASON"], hist)]
    return "\n".join(lines)


def usage_rows(usage: Mapping[str, Any] | None, ended: bool = False) -> list[list[Any]]:
    """``gpulease show``'s lines of what a lease used (none before it was granted); an ended lease's figures are
    final, so what was not measured is "not measured", never "not measured yet"."""
    if not usage:
        return []
    yet = "" if ended else " yet"
    source = f" ({usage['source']} figures)" if usage.get("source") == "device" else ""
    held = f" of {fmt_bytes(usage['held_memory'])} held" if usage.get("held_memory") else ""
    memory = (f"peak {fmt_bytes(usage['peak_memory'])}{held}" if usage.get("peak_memory") is not None
              else "not measured" + yet)
    mean = usage.get("mean_utilization")
    util = (f"mean {mean:.0f}%, peak {usage['peak_utilization']:.0f}%" if mean is not None
            else "not measured" + (" (a MIG slice has no counter)" if usage.get("samples") else yet))
    return [["gpu memory", memory + source], ["gpu util", util]]


def usage_csv(rows: list[Mapping[str, Any]], by: str) -> str:
    """The usage report as CSV for chargeback: one row per user, group, label value or notebook."""
    import csv
    import io

    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow([by, "gpu_hours_held", "gpu_hours_busy", "leases", "revocations", "preempted", "peak_memory_bytes",
                "mean_utilization_percent"])
    for r in rows:
        w.writerow([r["key"], f"{r['gpu_hours_held']:.4f}", f"{r['gpu_hours_busy']:.4f}", r["leases"],
                    r["revocations"], r["preempted"], "" if r["peak_memory"] is None else r["peak_memory"],
                    "" if r["mean_utilization"] is None else f"{r['mean_utilization']:.2f}"])
    return out.getvalue().rstrip("\n")


def _gpu_state(g: dict[str, Any], now: float) -> str:
    r = g.get("reservation")
    if g["state"] == "reserved" and r:
        return f"reserved ({r['user'] or '@' + r['group']} until {clock_text(r['end'], now)})"
    return str(g["state"])


def why(item: Mapping[str, Any]) -> str:
    """The broker's words for why a lease is suspended (``suspended.text``: since when, why, when it resumes), is
    asked to suspend (``suspend.text``), waits (``wait.text``) or ended (``reason_text``). Never made here, and
    never a reason slug: the broker's view carries the words."""
    return str((item.get("suspended") or {}).get("text") or (item.get("suspend") or {}).get("text")
               or (item.get("wait") or {}).get("text") or item.get("reason_text") or "")


def state_text(lease: Mapping[str, Any]) -> str:
    """A lease's state in the broker's words: its ``reason_text`` (which names the state: "revoked: idle for 10 min
    while others waited"), a suspended lease's ``suspended.text`` ("suspended since 14:05 (idle); resumes with its
    next cell"), else the state and why it waits ("queued: every GPU it could use is held")."""
    suspended = (lease.get("suspended") or {}).get("text")
    return str(lease.get("reason_text") or suspended or lease["state"] + (f": {why(lease)}" if why(lease) else ""))


def suspended_lines(leases: list[LeaseView]) -> str:
    """The caller's suspended leases, one line each with the broker's words (``%gpu status``); '' when none."""
    rows = [[lease.id, lease_gpus(lease), str((lease.suspended or {}).get("text") or lease.state)]
            for lease in leases if lease.phase == "suspended"]
    return table(["SUSPENDED", "GPUS", "WHY"], rows) if rows else ""


def queue_table(queue: list[dict[str, Any]]) -> str:
    """The queue (``BrokerClient.queue()``): the broker's start estimate (``estimate_text``) and why each waits."""
    rows = [[q["position"], q["user"], q["lease_id"] or "-", lease_gpus(q), q["priority"],
             duration_text(q["waited_seconds"]), q.get("estimate_text") or "-", why(q) or "-"]
            for q in queue]
    return table(["POS", "USER", "LEASE", "GPUS", "PRIORITY", "WAITED", "STARTS", "WAITS FOR"], rows)


def quota_table(quota: Mapping[str, Any], now: float | None = None) -> str:
    """What is left of each limit that applies to the user (``BrokerClient.quota()``): the broker's words, what is
    used of what limit, and when it refills."""
    now = time.time() if now is None else now
    if not quota.get("limits"):
        return f"No limits apply to {quota.get('user') or 'you'}."

    def amount(x: float | None, unit: str) -> str:
        if x is None:
            return "no limit"
        return gpus_text(x) if unit == "gpus" else hours_text(x * 3600)

    rows = []
    for q in quota["limits"]:
        limit = q.get("limit")
        left = "-" if limit is None else amount(max(0.0, limit - q["used"]), q["unit"])
        refills = clock_text(q["refills_at"], now) if q.get("refills_at") else "-"
        rows.append([q["text"], amount(q["used"], q["unit"]), amount(limit, q["unit"]), left, refills])
    return f"Limits of {quota['user']}:\n" + table(["LIMIT", "USED", "OF", "LEFT", "REFILLS"], rows)


def leases_table(leases: list[LeaseView]) -> str:
    """One row a lease; HOLDER is the broker's words for who holds it ('process 1234', 'process 1234 is gone',
    'no heartbeat for 45 s …'), so that a lease whose holder went shows as such until it ends."""
    now = time.time()
    rows = []
    for lease in leases:
        left = duration_text(lease.expires_at - now) if lease.expires_at and lease.holding else "-"
        devs = ",".join(f"{d['node']}:{d['index']}" for d in lease.devices) or "-"
        holder = (lease.get("holder") or {}).get("text") or "-"
        rows.append([lease.id, lease.user, lease.state, lease_gpus(lease), devs, left, holder, why(lease) or "-"])
    return table(["LEASE", "USER", "STATE", "GPUS", "DEVICES", "TIME LEFT", "HOLDER", "WHY"], rows)


def reservations_table(rs: list[dict[str, Any]], now: float | None = None) -> str:
    now = time.time() if now is None else now
    rows = [[r["id"], r["user"] or "@" + r["group"], r["gpus"], clock_text(r["start"], now), clock_text(r["end"], now),
             duration_text(r["end"] - r["start"]), r["state"], r.get("note", "")] for r in rs]
    return table(["RESERVATION", "FOR", "GPUS", "START", "END", "LENGTH", "STATE", "NOTE"], rows)
