"""The broker's HTTP server: tornado's, with connections admitted within limits per peer and in all.

A request's body must come within ``body_timeout`` (tornado's own bound, set to ``LeaseBroker.request_timeout``).
A sweep of our own once replaced tornado's timer per body read; measured against it (grant+release under 64
clients, 16 cores, alternating runs), the broker's CPU per grant+release was 1.28-1.68 ms with the sweep and
1.19-1.61 ms with tornado's timer: no difference a user could notice, so the library's bound is used.

Connections (:class:`ConnectionLimits`): every open connection holds a file descriptor, so one user who opens
thousands and leaves them idle would leave none for anyone else (the broker then fails every ``accept`` with
EMFILE). The server accepts connections itself: it learns the peer at once (the uid from ``SO_PEERCRED`` on the Unix
socket, the address over TCP) and admits the connection only while that peer holds fewer than its limit and all
peers together fewer than the total, which stays below the descriptor limit with room for the broker's own files.
A connection over a limit is answered at once (429 over the peer's limit, 503 over the total, with ``Retry-After``
and the usual JSON error) and closed; refusals and failed accepts are logged at most once every few seconds, with
a count. Open connections count until their socket closes (an event stream too); idle ones are closed by
tornado's ``idle_connection_timeout``.
"""

from __future__ import annotations

import json
import logging
import resource
import socket
from collections.abc import Callable, Iterable
from http import HTTPStatus
from typing import Any

from tornado import httpserver, ioloop, iostream

from ..core.errors import LeaseError
from .auth import peer_credentials

log = logging.getLogger("lease_broker")

#: descriptors kept for the broker's own files, never for connections: the store (the database, its -wal and -shm,
#: for the broker's connection and the checkpointer's), the log, the event loop, NVML's device files, the Hub's and
#: the notifier's HTTP clients, /proc reads
RESERVED_DESCRIPTORS = 64
REFUSING = 32  # connections being refused at once (each for at most REFUSE_LINGER s; further ones are cut short)
REFUSE_LINGER = 1.0  # seconds a refused connection is kept to read what its client sent, so that it gets the answer
RETRY_AFTER = 5  # seconds a refused client is told to wait (Retry-After)
LOG_EVERY = 5.0  # seconds: a refusal or a failed accept is logged at most this often (the others counted)
ACCEPT_PAUSE = 0.1  # seconds a listener waits after a failed accept (out of descriptors) before it tries again


def raise_descriptor_limit() -> int:
    """Raise the soft limit of open files to the hard one, as jupyter_server and most servers do (the soft default,
    often 1,024, is for interactive programs); return the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft == resource.RLIM_INFINITY or soft >= want:
        return want
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError) as e:  # (a hard limit above the kernel's nr_open)
        log.warning("Cannot raise the limit of open files from %d to %d: %s", soft, want, e)
        return soft
    return want


class ConnectionLimits:
    """How many connections may be open: ``total`` in all and ``per_peer`` from one peer (0: no limit per peer);
    counts those open by peer."""

    def __init__(self, max_total: int = 0, max_per_peer: int = 0, descriptors: int | None = None) -> None:
        """``max_total`` 0: as many as the descriptor limit leaves (``descriptors``, default the process's soft limit,
        less ``RESERVED_DESCRIPTORS`` and ``REFUSING``), never more; ``max_per_peer`` is held to half the total, so
        that one peer always leaves room for others."""
        if descriptors is None:
            descriptors = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            if descriptors == resource.RLIM_INFINITY:
                descriptors = 1 << 20
        room = descriptors - RESERVED_DESCRIPTORS - REFUSING
        if room < 16:
            raise LeaseError(f"The limit of open files ({descriptors}) leaves no room for connections (the broker keeps "
                             f"{RESERVED_DESCRIPTORS + REFUSING} for itself): raise it (ulimit -n, LimitNOFILE= in a "
                             "systemd unit)", reason="startup")
        self.descriptors = descriptors
        self.total = room if max_total <= 0 else min(max_total, room)
        self.per_peer = min(max_per_peer, max(1, self.total // 2)) if max_per_peer > 0 else 0
        self.open: dict[str, int] = {}  # peer -> connections open
        self.count = 0

    def admit(self, peer: str) -> LeaseError | None:
        """Count one more connection of ``peer``, or say why it is refused (the error it is answered with)."""
        mine = self.open.get(peer, 0)
        if self.per_peer and mine >= self.per_peer:
            return LeaseError(f"Too many connections from {peer}: {mine} open, the limit per peer is {self.per_peer} "
                              "(LeaseBroker.max_connections_per_peer): close some, or retry later",
                              reason="too_many_connections", status_code=429)
        if self.count >= self.total:
            return LeaseError(f"The broker has {self.count} connections open, its limit (LeaseBroker.max_connections, "
                              f"under the limit of open files {self.descriptors}): retry later",
                              reason="too_many_connections", status_code=503)
        self.open[peer] = mine + 1
        self.count += 1
        return None

    def release(self, peer: str) -> None:
        left = self.open.get(peer, 0) - 1
        if left > 0:
            self.open[peer] = left
        else:
            self.open.pop(peer, None)
        self.count -= 1


def peer_of(sock: socket.socket, address: Any) -> str:
    """Who is at the other end of an accepted connection, as its limit counts it: the uid on a Unix socket, the
    address over TCP."""
    try:
        creds = peer_credentials(sock)
    except OSError:
        creds = None
    if creds is not None:
        return f"uid {creds[1]}"
    if sock.family == socket.AF_UNIX:
        return "uid unknown"
    return f"address {address[0] if isinstance(address, tuple) and address else address}"


def refusal(error: LeaseError) -> bytes:
    """The whole HTTP answer a refused connection gets."""
    body = json.dumps(error.to_json()).encode()
    head = (f"HTTP/1.1 {error.status_code} {HTTPStatus(error.status_code).phrase}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nRetry-After: {RETRY_AFTER}\r\n"
            "Cache-Control: no-store\r\nConnection: close\r\n\r\n")
    return head.encode("latin-1") + body


class Throttled:
    """Logs a kind of message at most once every ``every`` seconds: the first of a burst at once, then how many more
    came (once the burst is ``every`` seconds old)."""

    def __init__(self, every: float = LOG_EVERY) -> None:
        self.every = every
        self._since: dict[str, int] = {}  # kind -> how many came since it was last logged (while a flush is due)

    def note(self, kind: str, level: int, msg: str, *args: Any) -> None:
        if kind in self._since:
            self._since[kind] += 1
            return
        log.log(level, msg, *args)
        self._since[kind] = 0
        ioloop.IOLoop.current().call_later(self.every, self._flush, kind, level)

    def _flush(self, kind: str, level: int) -> None:
        more = self._since.pop(kind, 0)
        if more:
            log.log(level, "%d more: %s (in the last %g s)", more, kind, self.every)


class _CountedStream(iostream.IOStream):
    """A connection's stream that gives its place back (``released``) when its socket closes, whatever closes it
    (the end of keep-alive, the idle timeout, an event stream's end)."""

    def __init__(self, sock: socket.socket, released: Callable[[], None], **kwargs: Any) -> None:
        self._released: Callable[[], None] | None = released
        super().__init__(sock, **kwargs)

    def close_fd(self) -> None:
        try:
            super().close_fd()
        finally:
            released, self._released = self._released, None
            if released is not None:
                released()


class BrokerHTTPServer(httpserver.HTTPServer):
    """``HTTPServer`` whose connections are admitted within ``limits``."""

    def initialize(self, *args: Any, limits: ConnectionLimits | None = None, **kwargs: Any) -> None:
        super().initialize(*args, **kwargs)
        self.limits = limits or ConnectionLimits()
        self.refusing: set[socket.socket] = set()  # refused connections read until their client closes (bounded)
        self.throttled = Throttled()

    # ------------------------------------------------------------------ accepting within the limits
    def add_sockets(self, sockets: Iterable[socket.socket]) -> None:
        for sock in sockets:
            self._sockets[sock.fileno()] = sock
            self._handlers[sock.fileno()] = self._accept_on(sock)

    def _accept_on(self, sock: socket.socket) -> Callable[[], None]:
        """Accept connections on ``sock`` as they come (tornado's ``add_accept_handler``, with the limits, and with
        a failed accept logged at most every few seconds and retried after a pause instead of at once); returns
        what stops it."""
        loop = ioloop.IOLoop.current()
        listening = [True, True]  # [not removed, handler registered]

        def accept(fd: Any, events: int) -> None:
            for _ in range(128):  # (then other callbacks get their turn: tornado's rule)
                try:
                    conn, address = sock.accept()
                except BlockingIOError:
                    return
                except ConnectionAbortedError:
                    continue
                except OSError as e:  # EMFILE, ENFILE, ENOBUFS: out of something until connections close
                    self.throttled.note("failed accepts", logging.ERROR, "Cannot accept a connection on %s: %s "
                                        "(retrying every %g s)", sock.getsockname() or "the socket", e, ACCEPT_PAUSE)
                    loop.remove_handler(sock)
                    listening[1] = False
                    loop.call_later(ACCEPT_PAUSE, resume)
                    return
                self._accepted(conn, address)

        def resume() -> None:
            if listening[0] and not listening[1]:
                loop.add_handler(sock, accept, ioloop.IOLoop.READ)
                listening[1] = True

        def remove() -> None:
            if listening[1]:
                loop.remove_handler(sock)
            listening[:] = [False, False]

        loop.add_handler(sock, accept, ioloop.IOLoop.READ)
        return remove

    def _accepted(self, conn: socket.socket, address: Any) -> None:
        peer = peer_of(conn, address)
        refused = self.limits.admit(peer)
        if refused is not None:
            self.throttled.note(f"connections refused ({refused.reason}, {refused.status_code})", logging.WARNING,
                                "Refused a connection: %s", refused.message)
            self._refuse(conn, refused)
            return
        try:
            stream = _CountedStream(conn, lambda: self.limits.release(peer), max_buffer_size=self.max_buffer_size,
                                    read_chunk_size=self.read_chunk_size)
        except BaseException:
            self.limits.release(peer)
            conn.close()
            raise
        try:
            self.handle_stream(stream, address)
        except Exception:
            log.exception("Cannot serve a connection from %s", peer)
            stream.close()

    def _refuse(self, conn: socket.socket, refused: LeaseError) -> None:
        """Answer ``conn`` with ``refused`` and close it; keep it (at most REFUSE_LINGER s, at most REFUSING at once)
        to read what its client sends meanwhile: a TCP socket closed with unread data resets the connection, and
        the client might lose the answer."""
        try:
            conn.setblocking(False)
            conn.send(refusal(refused))  # (a few hundred bytes: the socket's buffer takes them)
            conn.shutdown(socket.SHUT_WR)
        except OSError:
            conn.close()
            return
        if len(self.refusing) >= REFUSING:
            conn.close()
            return
        loop = ioloop.IOLoop.current()
        self.refusing.add(conn)

        def done() -> None:
            if conn in self.refusing:
                self.refusing.discard(conn)
                loop.remove_handler(conn)
                loop.remove_timeout(timer)
                conn.close()

        def readable(fd: Any, events: int) -> None:
            try:
                if conn.recv(65536):
                    return
            except BlockingIOError:
                return
            except OSError:
                pass
            done()  # the client closed (or the connection broke)

        timer = loop.call_later(REFUSE_LINGER, done)
        loop.add_handler(conn, readable, ioloop.IOLoop.READ)

    def stop(self) -> None:
        super().stop()
        for conn in list(self.refusing):
            ioloop.IOLoop.current().remove_handler(conn)
            conn.close()
        self.refusing.clear()

