"""Traces: loading and validating the bursts and sessions CSVs, and tiling them into longer ones.

A *burst* is one cell execution: ``session_id,start_s,duration_s,num_gpus`` (``session_id``
optional; ``gpu_mem_gib`` optional: its GPU-memory footprint per GPU, for the suspension costs; extra columns
ignored; ``num_gpus`` 0 = a CPU-only cell, which asks for no GPU).
A *session* is a notebook's life: ``session_id,start_s,stop_s,max_gpus``. Every error names
the file, the line and the bad value.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import random
from collections.abc import Iterable, Sequence
from pathlib import Path

BURST_COLUMNS = ("start_s", "duration_s", "num_gpus")
SESSION_COLUMNS = ("session_id", "start_s", "stop_s", "max_gpus")


class TraceError(ValueError):
    """A trace that cannot be replayed; the message names the file, line and value."""


@dataclasses.dataclass(frozen=True)
class Burst:
    session: str  # "" = no session: the burst stands alone
    start: float
    duration: float
    gpus: int
    user: str = ""  # defaults to the session
    line: int = 0  # line in its file, for messages
    mem_gib: float = 0.0  # its GPU-memory footprint per GPU (optional column gpu_mem_gib; 0: not given)

    @property
    def owner(self) -> str:
        return self.user or self.session or f"burst@{self.line}"


@dataclasses.dataclass(frozen=True)
class Session:
    id: str
    start: float
    stop: float
    max_gpus: int
    user: str = ""
    line: int = 0  # line in its file, for messages


@dataclasses.dataclass(frozen=True)
class Trace:
    bursts: tuple[Burst, ...]
    sessions: tuple[Session, ...] = ()
    name: str = ""
    bursts_file: str = "bursts"  # for messages
    sessions_file: str = "sessions"

    @property
    def span(self) -> float:
        ends = [b.start + b.duration for b in self.bursts] + [s.stop for s in self.sessions]
        starts = [b.start for b in self.bursts] + [s.start for s in self.sessions]
        return (max(ends) - min(starts)) if ends else 0.0


def _rows(path: Path, required: Sequence[str]) -> Iterable[tuple[int, dict[str, str]]]:
    try:
        f = path.open(newline="", encoding="utf-8")
    except OSError as e:
        raise TraceError(f"{path}: cannot read: {e.strerror or e}") from None
    with f:
        reader = csv.DictReader(f)
        header = [h.strip() for h in (reader.fieldnames or [])]
        if not header:
            raise TraceError(f"{path}: empty file: expected a header with columns {', '.join(required)}")
        reader.fieldnames = header
        missing = [c for c in required if c not in header]
        if missing:
            raise TraceError(
                f"{path}:1: missing column(s) {', '.join(missing)} (header is {','.join(header)}; "
                f"need {','.join(required)})"
            )
        for row in reader:
            if not any((v or "").strip() for v in row.values() if isinstance(v, str)):
                continue  # blank line
            yield reader.line_num, row


def _number(path: Path, line: int, row: dict[str, str], column: str, *, integer: bool = False) -> float:
    raw = (row.get(column) or "").strip()
    try:
        value = float(raw)
    except ValueError:
        raise TraceError(f"{path}:{line}: {column}={raw!r} is not a number") from None
    if not math.isfinite(value):
        raise TraceError(f"{path}:{line}: {column}={raw!r} is not a finite number")
    if value < 0:
        raise TraceError(f"{path}:{line}: {column}={raw!r} is negative")
    if integer and not value.is_integer():
        raise TraceError(f"{path}:{line}: {column}={raw!r} is not a whole number of GPUs")
    return value


def load_bursts(path: str | Path) -> list[Burst]:
    p = Path(path)
    out: list[Burst] = []
    for line, row in _rows(p, BURST_COLUMNS):
        out.append(
            Burst(
                session=(row.get("session_id") or "").strip(),
                start=_number(p, line, row, "start_s"),
                duration=_number(p, line, row, "duration_s"),
                gpus=int(_number(p, line, row, "num_gpus", integer=True)),
                user=(row.get("user") or "").strip(),
                line=line,
                mem_gib=_number(p, line, row, "gpu_mem_gib") if (row.get("gpu_mem_gib") or "").strip() else 0.0,
            )
        )
    if not out:
        raise TraceError(f"{p}: no bursts")
    return out


def load_sessions(path: str | Path) -> list[Session]:
    p = Path(path)
    out: list[Session] = []
    seen: dict[str, int] = {}
    for line, row in _rows(p, SESSION_COLUMNS):
        sid = (row.get("session_id") or "").strip()
        if not sid:
            raise TraceError(f"{p}:{line}: empty session_id")
        if sid in seen:
            raise TraceError(f"{p}:{line}: session_id={sid!r} repeats line {seen[sid]}")
        seen[sid] = line
        start, stop = _number(p, line, row, "start_s"), _number(p, line, row, "stop_s")
        if stop < start:
            raise TraceError(f"{p}:{line}: stop_s={stop:g} is before start_s={start:g}")
        gpus = int(_number(p, line, row, "max_gpus", integer=True))
        out.append(Session(sid, start, stop, gpus, user=(row.get("user") or "").strip(), line=line))
    return out


def derive_sessions(bursts: Iterable[Burst]) -> list[Session]:
    """Sessions implied by the bursts: first start to last end, holding the largest request."""
    spans: dict[str, list[float]] = {}
    users: dict[str, str] = {}  # the session's user: its bursts' (the same as the lease replay asks as)
    for i, b in enumerate(bursts):
        key = b.session or f"#burst{i}"  # a burst without a session is a session of its own
        s = spans.setdefault(key, [b.start, b.start + b.duration, 0.0])
        s[0], s[1], s[2] = min(s[0], b.start), max(s[1], b.start + b.duration), max(s[2], b.gpus)
        users.setdefault(key, b.user)
    return [Session(k, v[0], v[1], int(v[2]), user=users[k]) for k, v in spans.items()]


def load_trace(bursts: str | Path, sessions: str | Path | None = None) -> Trace:
    bs = load_bursts(bursts)
    ss = load_sessions(sessions) if sessions else []
    if ss:
        known = {s.id for s in ss}
        for b in bs:
            if b.session and b.session not in known:
                raise TraceError(f"{bursts}:{b.line}: session_id={b.session!r} is not in {sessions}")
    return Trace(tuple(bs), tuple(ss), name=Path(bursts).name, bursts_file=str(bursts),
                 sessions_file=str(sessions or "sessions"))


def check_fits(trace: Trace, total_gpus: int) -> None:
    """Refuse requests that no cluster state could ever grant."""
    bursts_file, sessions_file = trace.bursts_file, trace.sessions_file
    for b in trace.bursts:
        if b.gpus > total_gpus:
            raise TraceError(
                f"{bursts_file}:{b.line}: num_gpus={b.gpus} is more than the cluster's {total_gpus} GPUs"
            )
    for s in trace.sessions:
        if s.max_gpus > total_gpus:
            raise TraceError(
                f"{sessions_file}:{s.line}: max_gpus={s.max_gpus} is more than the cluster's {total_gpus} GPUs"
            )


def tile(trace: Trace, copies: int, shift: float | None = None) -> Trace:
    """A longer trace: ``copies`` copies, each shifted by ``shift`` seconds (default: the span)."""
    if copies < 1:
        raise ValueError(f"copies={copies!r}: need at least 1")
    step = trace.span if shift is None else shift
    bursts: list[Burst] = []
    sessions: list[Session] = []
    for k in range(copies):
        off = k * step
        sfx = f"#{k}" if k else ""
        for b in trace.bursts:
            bursts.append(dataclasses.replace(
                b, session=b.session + sfx if b.session else "", user=b.user + sfx if b.user else "",
                start=b.start + off))
        for s in trace.sessions:
            sessions.append(dataclasses.replace(s, id=s.id + sfx, user=s.user + sfx if s.user else "",
                                                start=s.start + off, stop=s.stop + off))
    return dataclasses.replace(trace, bursts=tuple(bursts), sessions=tuple(sessions), name=f"{trace.name} x{copies}")


def jitter(trace: Trace, seed: int, shift: float = 1800.0) -> Trace:
    """A copy of the trace with every session moved by its own random offset within ±``shift`` seconds (its bursts
    with it; a burst without a session by its own), kept at or after 0: the same work meeting different neighbours,
    to tell a policy's effect from the luck of one arrival order. ``seed`` makes it repeatable."""
    rng = random.Random(seed)
    offsets = {s.id: rng.uniform(-shift, shift) for s in trace.sessions}

    def moved(t: float, key: str) -> float:
        if key not in offsets:
            offsets[key] = rng.uniform(-shift, shift)
        return max(0.0, t + offsets[key])

    sessions = tuple(dataclasses.replace(s, start=moved(s.start, s.id), stop=moved(s.stop, s.id))
                     for s in trace.sessions)
    bursts = tuple(dataclasses.replace(b, start=moved(b.start, b.session or f"#{b.line}:{b.start}"))
                   for b in trace.bursts)
    return dataclasses.replace(trace, bursts=bursts, sessions=sessions, name=f"{trace.name} jitter {seed}")
