"""Processes attached to leases: identity checks, CPU time, and stopping them.

Everything here works from ``/proc`` so it needs no privileges beyond those the
broker already has, and it never signals a process whose start time differs from
the one recorded at attach (a recycled pid is a different process).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

_CLK_TCK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    ppid: int
    pgid: int
    uid: int
    start_ticks: int
    cpu_ticks: int


def proc_info(pid: int) -> ProcInfo | None:
    """Facts about a live process, or None when it is gone (or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("utf-8", "replace")
        st = os.stat(f"/proc/{pid}")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # comm may contain spaces and parentheses: split after the last ')'
    rest = stat[stat.rindex(")") + 2 :].split()
    if rest[0] in ("Z", "X"):
        return None
    return ProcInfo(
        pid=pid,
        ppid=int(rest[1]),
        pgid=int(rest[2]),
        uid=st.st_uid,
        start_ticks=int(rest[19]),
        cpu_ticks=int(rest[11]) + int(rest[12]) + int(rest[13]) + int(rest[14]),
    )


def tree_usage(roots: list[int]) -> dict[int, tuple[int, int, int]]:
    """The processes ``roots`` and their descendants: pid -> (resident bytes, CPU ticks, start ticks). One scan of
    ``/proc``."""
    table: dict[int, tuple[int, int, int, int]] = {}  # pid -> (ppid, rss, cpu, start)
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read().decode("utf-8", "replace")
        except OSError:
            continue
        rest = stat[stat.rindex(")") + 2 :].split()
        if rest[0] in ("Z", "X"):
            continue
        cpu = int(rest[11]) + int(rest[12])  # the process's own user and system time, not its waited-for children
        table[int(name)] = (int(rest[1]), int(rest[21]) * _PAGE, cpu, int(rest[19]))
    kids: dict[int, list[int]] = {}
    for pid, (ppid, *_) in table.items():
        kids.setdefault(ppid, []).append(pid)
    out: dict[int, tuple[int, int, int]] = {}
    todo = [r for r in roots if r in table]
    while todo:
        pid = todo.pop()
        if pid not in out:
            out[pid] = table[pid][1:]
            todo.extend(kids.get(pid, ()))
    return out


def uptime_ticks() -> float:
    """Clock ticks since the host booted (a process's start ticks count from then)."""
    with open("/proc/uptime") as f:
        return float(f.read().split()[0]) * _CLK_TCK


def is_descendant(pid: int, ancestor: int, max_depth: int = 64) -> bool:
    """Whether ``pid`` is ``ancestor`` or one of its descendants."""
    cur = pid
    for _ in range(max_depth):
        if cur == ancestor:
            return True
        info = proc_info(cur)
        if info is None or info.ppid <= 1:
            return False
        cur = info.ppid
    return False


def children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            info = proc_info(int(name))
            if info is not None:
                kids.setdefault(info.ppid, []).append(info.pid)
    return kids


class ProcessTracker:
    """CPU-time deltas per lease (activity of the simulated inventory)."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def cpu_ticks(self, pids: list[int]) -> int:
        """CPU ticks of the processes and of their process groups' members."""
        total = 0
        groups = set()
        for pid in pids:
            info = proc_info(pid)
            if info is not None:
                groups.add(info.pgid)
        if not groups:
            return 0
        for name in os.listdir("/proc"):
            if name.isdigit():
                info = proc_info(int(name))
                if info is not None and (info.pgid in groups or info.pid in pids):
                    total += info.cpu_ticks
        return total

    def cpu_delta(self, lease_id: str, pids: list[int]) -> float:
        ticks = self.cpu_ticks(pids)
        last = self._last.get(lease_id)
        self._last[lease_id] = ticks
        if last is None:
            return 0.0
        return max(0, ticks - last) / _CLK_TCK

    def any_alive(self, pids: list[int]) -> bool:
        return any(proc_info(p) is not None for p in pids)

    def forget(self, lease_id: str) -> None:
        self._last.pop(lease_id, None)


def signal_group(pid: int, start_ticks: int, sig: int) -> bool:
    """Signal the process group led by (or containing) ``pid`` if it is still the same process.

    Returns True when a signal was delivered.
    """
    info = proc_info(pid)
    if info is None or (start_ticks and info.start_ticks != start_ticks):
        return False
    try:
        if info.pgid == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return False


def same_process(pid: int, start_ticks: int) -> bool:
    """Whether ``pid`` is still the process that was recorded (not a later one that reused the pid)."""
    info = proc_info(pid)
    return info is not None and (not start_ticks or info.start_ticks == start_ticks)


def mps_running() -> bool:
    """Whether the CUDA MPS control daemon runs for this host (its control pipe exists)."""
    pipes = os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps"
    return os.path.exists(os.path.join(pipes, "control"))
