"""The broker's routes: each resource module's table, collected (no handler module imports another)."""

from __future__ import annotations

from . import cluster, events, leases, notify, policy, reservations, usage
from .base import Routes

PREFIX = "/api/v1"


def default_handlers(prefix: str = PREFIX) -> Routes:
    return [route for module in (cluster, leases, events, notify, policy, reservations, usage) for route in module.routes(prefix)]
