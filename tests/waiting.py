"""Polling until something becomes true, for the tests that watch real processes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def wait_for(cond: Callable[[], T], timeout: float = 10.0, what: str = "", interval: float = 0.05) -> T:
    """The first truthy value of ``cond()`` within ``timeout`` seconds; AssertionError naming ``what`` if none."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or 'the condition'}")
        time.sleep(interval)


def holds_for(cond: Callable[[], object], seconds: float, what: str = "", interval: float = 0.1) -> None:
    """``cond()`` stays truthy for ``seconds`` (a thing that must NOT happen, watched as long as it would take to
    show); AssertionError naming ``what`` the first time it is not."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not cond():
            raise AssertionError(f"no longer true: {what or 'the condition'}")
        time.sleep(interval)


async def wait_until(cond: Callable[[], T], timeout: float = 10.0, what: str = "", interval: float = 0.005) -> T:
    """:func:`wait_for` inside a test's event loop: the loop runs (the broker's work goes on) between tries."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or 'the condition'}")
        await asyncio.sleep(interval)


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):  # gone (also while /proc is read)
        return False


def largest_anonymous_rss(pid: int) -> int:
    """The resident bytes of the process's largest anonymous mapping (``/proc/PID/smaps``): e.g. a checkpoint
    region faulted in (``worker/ckpt_pool``)."""
    best, anonymous = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and ":" not in head[0]:  # a mapping's first line; 5 fields: no file behind it
            anonymous = len(head) == 5
        elif line.startswith("Rss:") and anonymous:
            best = max(best, int(line.split()[1]) * 1024)
    return best
