"""``%%gpu --session NAME``: one leased worker kept across cells (a model stays on the GPU)
until ``%gpu session stop NAME`` or the broker revokes it for idleness (warned first)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

from ..client import LeaseView
from ..executors.base import Worker
from ..tables import fmt_duration
from .cellrun import LeaseRun


@dataclass
class Session:
    name: str
    run: LeaseRun
    worker: Worker
    cells: int = 0
    parent: Any = None  # the message of the last cell that used it: where warnings go
    warned: bool = False
    ended_reason: str = ""
    created: float = field(default_factory=time.time)

    @property
    def lease_id(self) -> str:
        return self.run.lease.id

    def alive(self) -> bool:
        return not self.ended_reason and self.worker.alive() and self.run.status != "ended"

    def on_heartbeat(self, view: LeaseView, warn_window: float, shell: Any) -> None:
        """Called from the heartbeat thread with the broker's view of the lease."""
        if view.ended_at:
            self.ended_reason = f"{view.state} ({view.reason})"
            self._say(f"gpulease: session {self.name!r} ended: lease {self.lease_id} {self.ended_reason}", shell)
            return
        deadline = view.idle_deadline
        if deadline and not self.warned and deadline - time.time() <= warn_window:
            self.warned = True
            self._say(
                f"gpulease: session {self.name!r} has been idle; its lease {self.lease_id} will be revoked in "
                f"{fmt_duration(deadline - time.time())} unless a cell uses it (or `%gpu session stop "
                f"{self.name}` to give the GPU back now)", shell)

    def _say(self, text: str, shell: Any) -> None:
        tokens = None
        if self.parent is not None and hasattr(shell, "set_thread_parent"):
            tokens = shell.set_thread_parent(self.parent)
        try:
            print(text, file=sys.stderr, flush=True)
        finally:
            if tokens is not None:
                shell.reset_thread_parent(tokens)

    def stop(self, reason: str = "released") -> None:
        try:
            if self.worker.alive():
                self.worker.submit({"type": "stop"})
                if self.worker.wait_exit(2.0) is None:
                    self.worker.kill(1.0)
        except Exception:
            self.worker.kill(0.5)
        finally:
            self.worker.close()
            self.run.end(reason)


class Sessions:
    def __init__(self) -> None:
        self.by_name: dict[str, Session] = {}

    def get(self, name: str) -> Session | None:
        return self.by_name.get(name)

    def add(self, session: Session) -> None:
        self.by_name[session.name] = session

    def stop(self, name: str) -> Session:
        s = self.by_name.pop(name, None)
        if s is None:
            known = ", ".join(sorted(self.by_name)) or "none"
            raise KeyError(f"No session {name!r} (sessions: {known})")
        s.stop()
        return s

    def discard(self, name: str) -> None:
        s = self.by_name.pop(name, None)
        if s is not None:
            s.stop("session_gone")

    def stop_all(self) -> None:
        for name in list(self.by_name):
            self.discard(name)

    def rows(self) -> list[list[Any]]:
        return [[s.name, s.lease_id, "alive" if s.alive() else (s.ended_reason or "ended"), s.cells,
                 fmt_duration(time.time() - s.created)] for s in self.by_name.values()]
