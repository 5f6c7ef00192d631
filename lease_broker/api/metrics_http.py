"""``GET /metrics``: the Prometheus exposition, with prometheus_client imported at the first scrape.

Importing prometheus_client costs ~15 ms of every broker start; a broker nobody scrapes never pays it.
"""

from __future__ import annotations

from typing import Any

from tornado import web

from ..manager.manager import LeaseManager
from ..notify.notifier import Notifier


class MetricsHandler(web.RequestHandler):
    def initialize(self, manager: LeaseManager, cache: dict[str, Any], notifier: Notifier | None = None) -> None:
        self.manager, self.notifier = manager, notifier
        self.cache = cache  # the application's: holds its registry once made

    def get(self) -> None:
        from prometheus_client import generate_latest

        from .metrics import registry_for

        registry = self.cache.get("registry")
        if registry is None:
            registry = self.cache["registry"] = registry_for(self.manager, self.notifier)
        self.set_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.finish(generate_latest(registry))
