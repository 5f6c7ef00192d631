"""Getting, keeping and giving back a lease from the kernel's side.

``acquire`` asks the broker and, while queued, shows the position, the time waited
and the broker's estimate (a widget in a notebook, a text line in a terminal);
an interrupt cancels the request. ``Heartbeater`` keeps every lease this process
holds alive with one thread, telling the broker which ones are running a cell. ``HOLDINGS`` knows every lease
this process holds or waits for, so that a clean kernel shutdown gives them back itself.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

from gpulease_protocol.words import duration_text

from ..client import BrokerClient, BrokerError
from ..lease_view import LeaseView


class GpuError(Exception):
    """An error that is no mistake in the magic's arguments (no GPU within --wait, the request cancelled elsewhere,
    the broker down or refusing): IPython shows its one line, not a traceback. (A mistake in the arguments is
    IPython's ``UsageError``.)"""

    def _render_traceback_(self) -> list[str]:
        return [f"{type(self).__name__}: {self}"]


class LeaseUnavailable(GpuError):
    """No lease: cancelled (by an interrupt elsewhere, the sidebar, ``gpulease cancel``) or not granted within
    --wait."""


def gpu_error(ename: str, message: str) -> GpuError:
    """A ``GpuError`` under the name a notebook shows as the error's type (``BrokerUnreachable``, ``LeaseRefused``)."""
    cls: type[GpuError] = type(ename, (GpuError,), {"__module__": "gpu"})
    return cls(message)


class QueueCancelled(KeyboardInterrupt):
    """An interrupt while queued: the request was withdrawn.

    Still a ``KeyboardInterrupt`` (the cell counts as interrupted, Run All stops), but IPython shows only its one
    line (``_render_traceback_``), not the frames of the HTTP call the interrupt happened to land in.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def _render_traceback_(self) -> list[str]:
        return [self.message]


def _interrupted() -> type[QueueCancelled]:
    """``QueueCancelled`` under the name a notebook shows for an interrupt (the error's ename)."""
    return type("KeyboardInterrupt", (QueueCancelled,), {"__module__": "gpu"})


class WaitDisplay:
    """Queue position, time waited and the estimate: a widget in a notebook, a text line elsewhere."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.widget: Any = None
        self._text = False
        try:
            from IPython import get_ipython

            shell = get_ipython()
            if shell is not None and getattr(shell, "kernel", None) is not None:
                import ipywidgets
                from IPython.display import display

                self.widget = ipywidgets.HTML()
                display(self.widget)
        except Exception:
            self.widget = None

    def show(self, text: str) -> None:
        """One line of text (made by the caller from the broker's words)."""
        if self.widget is not None:
            self.widget.value = f"<code>{text}</code> <small>(interrupt the kernel to stop waiting)</small>"
        else:
            self._text = True
            sys.stderr.write("\r" + text + " " * 4)
            sys.stderr.flush()

    def update(self, lease: LeaseView, waited: float) -> None:
        # the broker's words for why it waits and when it may start (the lease view's ``wait.text`` and
        # ``estimate_text``): shown as they are, never re-derived here; an older broker's view has neither
        why = (lease.get("wait") or {}).get("text")
        est = lease.get("estimate_text")
        text = (f"⏳ {self.label}: queued, position {lease.position or '?'}, waited {duration_text(waited)}"
                + (f", estimated start {est}" if est else "") + (f" · {why}" if why else ""))
        if self.widget is not None:
            self.widget.value = f"<code>{text}</code> <small>(interrupt the kernel to cancel)</small>"
        else:
            self._text = True
            sys.stderr.write("\r" + text + " " * 4)
            sys.stderr.flush()

    def close(self, final: str = "") -> None:
        if self.widget is not None:
            self.widget.value = f"<code>{final}</code>" if final else ""
            if not final:
                self.widget.close()
        elif self._text:
            sys.stderr.write("\r" + (final or "") + " " * 20 + "\n")
            sys.stderr.flush()


class Holdings:
    """Every lease this process holds or waits for, whatever holds it (a cell, a ``--bg`` cell, a session, the
    Python API): what a clean kernel shutdown gives back itself (``GpuMagics.shutdown``) before the kernel exits.
    (A kernel that dies without its shutdown is the broker's to notice: it watches the process that asked.)"""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._leases: dict[str, tuple[BrokerClient, str]] = {}  # lease id -> (its client, what holds it)
        self._giving_back: set[str] = set()  # held leases whose release waits only for their worker's exit

    def add(self, client: BrokerClient, lease_id: str, what: str) -> None:
        with self._lock:
            self._leases[lease_id] = (client, what)

    def discard(self, lease_id: str) -> None:
        with self._lock:
            self._leases.pop(lease_id, None)
            self._giving_back.discard(lease_id)

    def giving_back(self, lease_id: str) -> None:
        """Note that a held lease is released the moment its worker is gone (a finished cell's, ``LeaseRun._reap``):
        a request made meanwhile may be waiting for exactly those GPUs."""
        with self._lock:
            if lease_id in self._leases:
                self._giving_back.add(lease_id)

    def any_giving_back(self) -> bool:
        with self._lock:
            return bool(self._giving_back)

    def held(self) -> dict[str, str]:
        """lease id -> what holds it (``--bg job1``, ``--session m``, ``Python API``, a cell's name)."""
        with self._lock:
            return {lease_id: what for lease_id, (_, what) in self._leases.items()}

    def release_all(self, reason: str) -> None:
        """Release (or withdraw, if queued) every lease still held."""
        with self._lock:
            leases, self._leases = self._leases, {}
        for lease_id, (client, _) in leases.items():
            release_quietly(client, lease_id, reason)


HOLDINGS = Holdings()


def kernel_log(text: str) -> None:
    """A line in the kernel's log (its own stderr), not in a cell's output: what an admin reads, no user waits on."""
    log = sys.__stderr__ or sys.stderr
    log.write(text + "\n")
    log.flush()


def holder_text(request: dict[str, Any]) -> str:
    """What holds a lease, from its request's labels, for the kernel's log: ``--bg job1``, ``--session m``, a
    cell, or the Python API."""
    labels = request.get("labels") or {}
    if labels.get("bg"):
        return f"--bg {labels['bg']}"
    if labels.get("session"):
        return f"--session {labels['session']}"
    if labels.get("source") == "api":
        return "Python API"
    return str(labels.get("cell") or labels.get("source") or "cell")


#: seconds of each poll while no wait display is shown yet: the first one of a resume, and those of a request that
#: queued while this kernel gives a lease back (see ``QUIET_FOR``)
FIRST_POLL = 0.2

#: the longest a queued request shows no wait display while this kernel is still giving a lease back: the GPU it
#: waits for may be the one its own last cell releases as that cell's worker exits (Run All on a full cluster), which
#: takes a few milliseconds on an idle host and has taken over 0.2 s on a loaded one
QUIET_FOR = 5.0


def acquire(client: BrokerClient, request: dict[str, Any], max_wait: float | None, label: str) -> LeaseView:
    """Request a lease and wait for its grant. Cancels it on interrupt, error or timeout.

    An interrupt while queued raises ``QueueCancelled`` (a ``KeyboardInterrupt``) with one line saying so.
    """
    try:
        lease = client.request_lease(**request)
    except KeyboardInterrupt:
        raise _interrupted()(f"{label.split()[0]}: interrupted before the broker answered the request (`%gpu leases` "
                             "shows whether it was queued)") from None
    HOLDINGS.add(client, lease.id, holder_text(request))
    if lease.state == "granted":
        return lease
    start = time.monotonic()
    display: WaitDisplay | None = None
    granted = False
    try:
        try:
            while lease.phase == "queued":
                waited = time.monotonic() - start
                if max_wait is not None and waited >= max_wait:
                    raise LeaseUnavailable(
                        f"No GPU within --wait {duration_text(max_wait)} (position {lease.position} in the "
                        "queue); the request was cancelled. Try again later, ask for fewer GPUs, or wait longer."
                    )
                if display is None and waited < QUIET_FOR and HOLDINGS.any_giving_back():
                    # the GPU may come the moment this kernel's own release is stored: no wait display before
                    poll = FIRST_POLL if max_wait is None else min(FIRST_POLL, max_wait - waited)
                    lease = client.lease(lease.id, wait=poll)
                    continue
                if display is None:
                    display = WaitDisplay(label)
                display.update(lease, waited)
                poll = 1.0 if max_wait is None else max(0.05, min(1.0, max_wait - waited))
                lease = client.lease(lease.id, wait=poll)
        except KeyboardInterrupt:  # withdrawn in ``finally``; one line instead of the HTTP call's frames
            where = f" (was position {lease.position})" if lease.position else ""
            raise _interrupted()(f"{label.split()[0]}: cancelled after {duration_text(time.monotonic() - start)} "
                                 f"in the queue{where}") from None
        if not lease.holding:
            raise LeaseUnavailable(f"lease {lease.id} ended while queued: {ended_text(lease)}")
        granted = True
        return lease
    finally:
        if display is not None:
            display.close(f"{label}: granted after {duration_text(time.monotonic() - start)}" if granted else "")
        if not granted:
            release_quietly(client, lease.id, "cancelled")
            HOLDINGS.discard(lease.id)


def wait_resumed(client: BrokerClient, lease_id: str, max_wait: float | None, label: str) -> LeaseView:
    """Ask for a suspended lease's GPUs back and wait for the grant, showing the time waited and the broker's words
    for the suspension as a request's wait is shown. An interrupt or ``max_wait`` leaves the lease suspended (its
    next cell asks again); a lease that ended meanwhile raises ``LeaseUnavailable``."""
    start = time.monotonic()
    display: WaitDisplay | None = None

    def ask(wait: float) -> LeaseView:
        try:
            return client.resume(lease_id, wait_seconds=wait)
        except BrokerError as e:
            if e.status != 409:  # 409: no longer suspended (granted meanwhile, or ended): its view says which
                raise
            return client.lease(lease_id)

    try:
        lease = ask(FIRST_POLL)
        while lease.phase == "suspended":
            waited = time.monotonic() - start
            if max_wait is not None and waited >= max_wait:
                raise LeaseUnavailable(f"No GPU within --wait {duration_text(max_wait)} to resume lease {lease_id}; "
                                       "it stays suspended and its next cell asks again.")
            if display is None:
                display = WaitDisplay(label)
            text = (lease.suspended or {}).get("text") or "suspended"
            display.show(f"⏳ {label}: {text} · waiting {duration_text(waited)} for GPUs to resume it")
            lease = ask(1.0 if max_wait is None else max(0.05, min(1.0, max_wait - waited)))
    except KeyboardInterrupt:
        raise _interrupted()(f"{label.split()[0]}: interrupted after {duration_text(time.monotonic() - start)} "
                             f"waiting for GPUs to resume lease {lease_id}; it stays suspended") from None
    finally:
        if display is not None:
            display.close()
    if not lease.holding:
        raise LeaseUnavailable(f"lease {lease_id} ended while suspended: {ended_text(lease)}")
    return lease


def ended_text(lease: LeaseView) -> str:
    """Why a lease ended, in the broker's words (the view's ``reason_text``); from an older broker, its state and
    reason slug ("cancelled", "revoked (idle)")."""
    text = lease.get("reason_text")
    if text:
        return str(text)
    return lease.state if lease.reason in ("", lease.state) else f"{lease.state} ({lease.reason})"


def release_quietly(client: BrokerClient, lease_id: str, reason: str = "released") -> LeaseView | None:
    """Release a lease; its final view (None if the broker did not answer with one)."""
    try:
        return client.release(lease_id, reason)
    except BrokerError as e:
        if e.status not in (404, 409):  # already gone: fine
            print(f"gpulease: could not release lease {lease_id}: {e}", file=sys.stderr)
    except Exception as e:  # the broker is away: it revokes the lease when our heartbeats stop
        print(f"gpulease: could not release lease {lease_id}: {e}", file=sys.stderr)
    return None


class Heartbeater:
    """One thread that heartbeats every lease this process holds. Started with the first lease, it then waits while
    there is none: starting a thread waits until it runs, which would hold up the next cell (by milliseconds on a
    busy host)."""

    def __init__(self, client: BrokerClient, interval: float = 10.0) -> None:
        self.client, self.interval = client, interval
        self._leases: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._holding = threading.Event()  # set while there are leases to beat for
        self._thread: threading.Thread | None = None

    def add(self, lease_id: str, active: bool = True, on_reply: Any = None, on_gone: Any = None) -> None:
        """Beat for ``lease_id``: ``on_reply(view)`` after each beat; ``on_gone()`` once, when the broker answers
        that the lease has ended (then it is no longer beaten for)."""
        with self._lock:
            self._leases[lease_id] = {"active": active, "on_reply": on_reply, "on_gone": on_gone}
            self._holding.set()
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="gpulease-heartbeat", daemon=True)
                self._thread.start()

    def at_most(self, interval: float) -> None:
        """Beat at least this often from now on (a short idle timeout needs timely warnings)."""
        if interval < self.interval:
            self.interval = interval
            self._wake.set()

    def set_active(self, lease_id: str, active: bool) -> None:
        with self._lock:
            if lease_id in self._leases:
                self._leases[lease_id]["active"] = active

    def remove(self, lease_id: str) -> None:
        with self._lock:
            self._leases.pop(lease_id, None)

    def beat(self) -> None:
        with self._lock:
            items = list(self._leases.items())
        for lease_id, entry in items:
            try:
                view = self.client.heartbeat(lease_id, active=entry["active"])
            except BrokerError as e:
                if e.status in (404, 409):
                    self.remove(lease_id)
                    if entry["on_gone"] is not None:
                        try:
                            entry["on_gone"]()
                        except Exception:
                            pass
                continue
            except Exception:
                continue  # the broker may be restarting; try again next time
            if entry["on_reply"] is not None:
                try:
                    entry["on_reply"](view)
                except Exception:
                    pass

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._leases:
                    self._holding.clear()
            self._holding.wait()  # no lease: nothing to do until the next one (a full interval after it)
            self._wake.wait(self.interval)
            self._wake.clear()
            self.beat()
