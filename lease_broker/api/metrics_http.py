"""``GET /metrics``: the Prometheus exposition, with prometheus_client imported at the first scrape.

Importing prometheus_client costs ~15 ms of every broker start; a broker nobody scrapes never pays it.

Who may scrape: anyone who can connect to the Unix socket (as every other endpoint there, no token); over TCP only a
caller with a token (a broker token, e.g. ``lease-broker token create prometheus``, or a Hub token where the broker
takes them), since the series name users and leases.
"""

from __future__ import annotations

import socket
from collections.abc import Awaitable
from typing import Any

from tornado import web

from ..core.errors import LeaseError
from ..manager.manager import LeaseManager
from ..notify.notifier import Notifier
from .auth import Authenticator
from .base import json_text


class MetricsHandler(web.RequestHandler):
    def initialize(self, manager: LeaseManager, cache: dict[str, Any], auth: Authenticator | None = None,
                   notifier: Notifier | None = None) -> None:
        self.manager, self.notifier, self.auth = manager, notifier, auth
        self.cache = cache  # the application's: holds its registry once made

    async def prepare(self) -> None:
        sock = getattr(getattr(self.request.connection, "stream", None), "socket", None)
        if self.auth is None or (sock is not None and sock.family == socket.AF_UNIX):
            return
        try:
            who = self.auth.identify(sock, self.request.headers.get("Authorization"))
            if isinstance(who, Awaitable):
                await who
        except LeaseError as e:
            self.set_status(e.status_code)
            self.set_header("Content-Type", "application/json")
            self.finish(json_text(e.to_json()))

    def get(self) -> None:
        from prometheus_client import generate_latest

        from .metrics import registry_for

        registry = self.cache.get("registry")
        if registry is None:
            registry = self.cache["registry"] = registry_for(self.manager, self.notifier)
        self.set_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.finish(generate_latest(registry))
