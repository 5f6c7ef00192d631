"""A ``%%gpu`` cell's lease request leaves as the kernel starts the cell.

IPython announces a cell (its ``pre_run_cell`` event) before it stores it in the history, compiles it and calls
the magic, which then parses its line and checks the cell: measured in a kernel on a 2-core VM, 0.4 ms before the
magic would send its request, of a trivial cell's 4.5 ms. So at ``pre_run_cell`` a cell that starts with
``%%gpu`` is read as the magic will read it and, if it will ask for a lease (not ``--session``, not ``--bg``), the
request is sent then; the magic picks up the answer (``take``) when it asks for the same lease. Nothing is sent for a cell the magic would refuse
(a bad option, a syntax error, an unknown name): ``GpuMagics.prepare`` checks it first, and prints nothing.

A request the magic does not pick up (the cell turned out different, or failed before the magic ran) is released
when the cell ends (``post_run_cell``), or at the next cell at the latest.
"""

from __future__ import annotations

from typing import Any, Protocol

from ..client import BrokerClient, LeaseView, Pending
from .acquire import release_quietly


class _Magics(Protocol):
    @property
    def client(self) -> BrokerClient: ...

    def prepare(self, line: str, cell: str) -> tuple[Any, dict[str, Any], Any, Any]: ...


class EarlyRequests:
    def __init__(self, magics: _Magics) -> None:
        self.magics = magics
        self._sent: tuple[dict[str, Any], Pending] | None = None  # the request's body, and the request sent
        self.counts = {"sent": 0, "taken": 0, "abandoned": 0}

    def register(self, events: Any) -> None:
        events.register("pre_run_cell", self.pre_run_cell)
        events.register("post_run_cell", self.post_run_cell)

    def unregister(self, events: Any) -> None:
        for name, callback in (("pre_run_cell", self.pre_run_cell), ("post_run_cell", self.post_run_cell)):
            try:
                events.unregister(name, callback)
            except ValueError:
                pass
        self.drop()

    def pre_run_cell(self, info: Any) -> None:
        self.drop()
        split = magic_cell(getattr(info, "raw_cell", None) or "")
        if split is None:
            return
        line, cell = split
        try:
            args, opts, _, _ = self.magics.prepare(line, cell)
            if args.session or args.bg:
                return  # a session's worker has its lease; a background cell asks from its own thread
            self._sent = (opts["request"], self.magics.client.send_lease_request(**opts["request"]))
            self.counts["sent"] += 1
        except Exception:  # the magic finds the same problem and reports it in the cell
            return

    def take(self, request: dict[str, Any]) -> Pending | None:
        """The request sent as this cell started, if it asked for this lease (else the magic sends its own)."""
        sent, self._sent = self._sent, None
        if sent is None:
            return None
        if sent[0] == request:
            self.counts["taken"] += 1
            return sent[1]
        self._abandon(sent[1])
        return None

    def post_run_cell(self, result: Any = None) -> None:
        self.drop()

    def drop(self) -> None:
        sent, self._sent = self._sent, None
        if sent is not None:
            self._abandon(sent[1])

    def _abandon(self, pending: Pending) -> None:
        self.counts["abandoned"] += 1
        try:
            lease = LeaseView.from_json(pending.result())
        except Exception:  # refused, or the broker is away: there is nothing to give back
            return
        release_quietly(self.magics.client, lease.id, "cancelled")


def magic_cell(raw: str) -> tuple[str, str] | None:
    """(line, cell) as IPython hands them to the ``%%gpu`` magic, for a cell that starts with it; else None."""
    if not raw.startswith("%%gpu"):
        return None
    first, _, cell = (raw if raw.endswith("\n") else raw + "\n").partition("\n")  # IPython ends a cell with one
    name, _, line = first[2:].rstrip().partition(" ")
    return (line, cell) if name == "gpu" else None
