"""The broker's HTTP server: tornado's, with the request-body deadline kept by one sweep instead of a timer per
request.

Tornado bounds the time a client may take to send a body with a timeout around every body read
(``body_timeout``): a task and a timer for each POST, even when the body came in the same packet as its headers,
as ours almost always do: about 6 % of the broker's CPU in a grant+release (a py-spy profile under 64 clients). Here tornado's
per-request timeout is off; a request with a body is noted when its headers arrive and forgotten when its body is
complete (or its connection closes), and a periodic sweep closes the connections whose body is overdue. The
bound is the same (a stalled body is cut off, as before, at most one sweep interval late) and the cost is a dict
entry per POST.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable
from typing import Any

from tornado import httpserver, httputil, ioloop

log = logging.getLogger("lease_broker")


class BrokerHTTPServer(httpserver.HTTPServer):
    """``HTTPServer`` whose requests must send their bodies within ``body_deadline`` seconds of their headers.
    :meth:`start_sweeping` starts the sweep (in the running loop); :meth:`stop` ends it."""

    def initialize(self, *args: Any, body_deadline: float = 30.0, **kwargs: Any) -> None:
        kwargs["body_timeout"] = None  # (tornado's timer per body read: the sweep below keeps the bound)
        super().initialize(*args, **kwargs)
        self.body_deadline = body_deadline
        self.reading: dict[httputil.HTTPConnection, float] = {}  # a connection whose body is awaited: since
        self._sweep: ioloop.PeriodicCallback | None = None

    def start_request(self, server_conn: object, request_conn: httputil.HTTPConnection) -> httputil.HTTPMessageDelegate:
        return _BodyWatch(super().start_request(server_conn, request_conn), request_conn, self.reading)

    def start_sweeping(self) -> None:
        """Check every quarter of the deadline (at most every 5 s) for bodies that are overdue."""
        self._sweep = ioloop.PeriodicCallback(self.sweep, min(self.body_deadline / 4, 5.0) * 1000)
        self._sweep.start()

    def sweep(self) -> None:
        """Close the connections whose request body has not come within the deadline."""
        late = time.monotonic() - self.body_deadline
        for conn, since in list(self.reading.items()):
            if since < late:
                self.reading.pop(conn, None)
                log.info("Closing a connection: its request body did not arrive within %g s", self.body_deadline)
                conn.close()  # type: ignore[attr-defined]  # (an HTTP1Connection: the read it waits on ends)

    def stop(self) -> None:
        if self._sweep is not None:
            self._sweep.stop()
        super().stop()


class _BodyWatch(httputil.HTTPMessageDelegate):
    """Passes a request through to tornado's delegate, noting it in ``reading`` from its headers until its body
    is complete."""

    def __init__(self, delegate: httputil.HTTPMessageDelegate, conn: httputil.HTTPConnection,
                 reading: dict[httputil.HTTPConnection, float]) -> None:
        self.delegate, self.conn, self.reading = delegate, conn, reading

    def headers_received(self, start_line: httputil.RequestStartLine | httputil.ResponseStartLine,
                         headers: httputil.HTTPHeaders) -> Awaitable[None] | None:
        if "Content-Length" in headers or "Transfer-Encoding" in headers:
            self.reading[self.conn] = time.monotonic()
        return self.delegate.headers_received(start_line, headers)

    def data_received(self, chunk: bytes) -> Awaitable[None] | None:
        return self.delegate.data_received(chunk)

    def finish(self) -> None:
        self.reading.pop(self.conn, None)
        self.delegate.finish()

    def on_connection_close(self) -> None:
        self.reading.pop(self.conn, None)
        self.delegate.on_connection_close()
