"""Running the broker: listeners, the tick loop, inventory sampling. No policy here."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import stat
from typing import Any

from tornado import ioloop, netutil, web

from gpulease_protocol import address
from gpulease_protocol.private import UnsafePathError, private_dir, trusted_path

from .api.auth import Authenticator
from .api.base import NotFoundHandler
from .api.http_server import BrokerHTTPServer, ConnectionLimits, raise_descriptor_limit
from .api.metrics_http import MetricsHandler
from .api.routes import default_handlers
from .core.errors import LeaseError
from .manager.manager import LeaseManager
from .notify.notifier import Notifier

log = logging.getLogger("lease_broker")


class StartupError(LeaseError):
    status_code = 500
    reason = "startup"


def make_app(manager: LeaseManager, auth: Authenticator, info: dict[str, Any],
             notifier: Notifier | None = None) -> web.Application:
    ctx = {"manager": manager, "auth": auth, "info": info, "notifier": notifier}
    handlers: list[Any] = [(path, cls, ctx) for path, cls in default_handlers()]
    metrics: dict[str, Any] = {"manager": manager, "notifier": notifier, "cache": {}, "auth": auth}
    handlers.append((r"/metrics", MetricsHandler, metrics))
    handlers.append((r".*", NotFoundHandler, ctx))
    return web.Application(handlers, websocket_ping_interval=20, log_function=_log_request)


def _log_request(handler: web.RequestHandler) -> None:
    status = handler.get_status()
    level = logging.WARNING if status >= 500 else logging.DEBUG
    # never log headers: they may carry tokens
    log.log(level, "%d %s %s %.1fms", status, handler.request.method, handler.request.path,
            1000.0 * handler.request.request_time())


def trusted_place(path: str, what: str, option: str) -> None:
    """Refuse to make ``what`` (the socket, the store) at ``path`` unless ``path`` (if it exists) and every directory
    above it belong to the broker's user or root and no other user can change them (``private.trusted_path``):
    another user could delete or replace it, or answer in the broker's place. ``option``: what chooses another path."""
    try:
        trusted_path(path, frozenset({os.geteuid(), 0}), missing_ok=True)
    except UnsafePathError as e:
        raise StartupError(f"Refusing to create {what} {path}: {e}; or use {option} with a directory of yours") from None


def bind_unix(path: str) -> socket.socket:
    """Bind the broker's Unix socket: mode 0666 (identity comes from SO_PEERCRED), in a directory no other user can
    change. A missing directory is made 0755 by root (the system socket's ``/run/gpulease``, which every user must
    reach) and 0700 by anyone else (the per-user socket's, ``private_dir``), as is the per-user socket's directory
    when it exists; any other must already be the broker user's or root's and closed to writes by others."""
    path = os.path.abspath(path)
    directory = os.path.dirname(path)
    try:
        if os.geteuid() == 0:
            os.makedirs(directory, mode=0o755, exist_ok=True)
        elif not os.path.lexists(directory) or path == os.path.abspath(address.per_user_socket()):
            os.makedirs(os.path.dirname(directory), mode=0o700, exist_ok=True)
            private_dir(directory)
    except UnsafePathError as e:
        raise StartupError(f"Refusing to create the socket {path}: {e}; or use --socket with a directory of yours") from None
    except OSError as e:
        raise StartupError(f"Cannot make the socket's directory {directory} ({e.strerror}): use --socket with a path "
                           "you own") from None
    trusted_place(path, "the socket", "--socket")
    if os.path.lexists(path) and not stat.S_ISSOCK(os.lstat(path).st_mode):  # never removed: not a stale socket
        raise StartupError(f"Cannot create the socket {path}: something else is there (not a socket): move it away, "
                           "or choose another path with --socket")
    if os.path.exists(path):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # stale socket of a broker that is gone
        else:
            raise StartupError(f"Another broker is already serving on {path!r}: stop it or use --socket")
        finally:
            probe.close()
    try:
        return netutil.bind_unix_socket(path, mode=0o666, backlog=1024)
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EPERM):
            raise StartupError(f"Cannot create the socket {path!r} ({e.strerror}): use --socket with a path you own") from e
        raise


class BrokerService:
    """Listeners and timers around a LeaseManager."""

    def __init__(self, manager: LeaseManager, auth: Authenticator, info: dict[str, Any],
                 tick_seconds: float = 1.0, sample_seconds: float = 2.0, request_timeout: float = 30.0,
                 notifier: Notifier | None = None, max_connections: int = 0, max_connections_per_peer: int = 0) -> None:
        self.manager = manager
        self.notifier = notifier
        self.app = make_app(manager, auth, info, notifier)
        # connections within limits below the descriptor limit, raised first to its hard limit (api/http_server.py)
        self.limits = ConnectionLimits(max_connections, max_connections_per_peer, raise_descriptor_limit())
        log.info("Connections: at most %d open (limit of open files %d), %s per peer", self.limits.total,
                 self.limits.descriptors, self.limits.per_peer or "no limit")
        self.server = BrokerHTTPServer(self.app, idle_connection_timeout=request_timeout * 10,
                                       body_timeout=request_timeout, max_body_size=1 << 20, xheaders=False,
                                       limits=self.limits)
        self.tick_seconds = tick_seconds
        self.sample_seconds = sample_seconds
        self._timers: list[ioloop.PeriodicCallback] = []
        self.sockets: list[socket.socket] = []
        self.unix_path: str | None = None
        self._sampling = False
        self._sampled_at = 0.0

    def listen_unix(self, path: str) -> None:
        sock = bind_unix(path)
        self.unix_path = path
        self.sockets.append(sock)
        self.server.add_socket(sock)

    def listen_tcp(self, port: int, address: str) -> int:
        socks = netutil.bind_sockets(port, address=address)
        self.sockets.extend(socks)
        self.server.add_sockets(socks)
        return int(socks[0].getsockname()[1])

    def start(self) -> None:
        # from here an event-loop iteration's writes share one transaction and its requests one pass
        self.manager.driver.attach(ioloop.IOLoop.current().asyncio_loop)  # type: ignore[attr-defined]
        tick = ioloop.PeriodicCallback(self._tick, self.tick_seconds * 1000)
        fast = ioloop.PeriodicCallback(self._fast, 50)
        self._timers = [tick, fast]
        if self.sample_seconds > 0:
            self._timers.append(ioloop.PeriodicCallback(self._sample, self.sample_seconds * 1000))
        for t in self._timers:
            t.start()
        ioloop.IOLoop.current().add_callback(self.manager.holders.tick)  # the restored holders, watched from the start
        if self.notifier is not None:
            ioloop.IOLoop.current().add_callback(self.notifier.start)  # its tasks run in the loop

    def _tick(self) -> None:
        try:
            self.manager.tick()
        except Exception:
            log.exception("Tick failed")

    def _fast(self) -> None:
        if self.manager.enforcer.busy:
            # draining waits for a sample taken after the processes went: sample faster meanwhile
            if self.sample_seconds > 0 and not self._sampling and ioloop.IOLoop.current().time() - self._sampled_at > 0.25:
                ioloop.IOLoop.current().spawn_callback(self._sample)
            self._tick()

    async def _sample(self) -> None:
        if self._sampling:
            return
        self._sampling = True
        try:
            samples = await asyncio.get_running_loop().run_in_executor(None, self.manager.inventory.sample)
        except Exception:
            log.exception("Inventory %s: sampling failed", self.manager.inventory.kind)
            return
        finally:
            self._sampling = False
            self._sampled_at = ioloop.IOLoop.current().time()
        self.manager.samples = samples

    def stop(self) -> None:
        for t in self._timers:
            t.stop()
        if self.notifier is not None:
            self.notifier.stop()
        self.server.stop()
        if self.unix_path and os.path.exists(self.unix_path):
            try:
                os.unlink(self.unix_path)
            except OSError:
                pass
