"""The broker's routes: each resource module's table, collected (no handler module imports another)."""

from __future__ import annotations

from . import cluster, events, leases, notify, policy, quota, reservations, usage
from .base import Routes

PREFIX = "/api/v1"


def default_handlers(prefix: str = PREFIX) -> Routes:
    modules = (cluster, leases, events, notify, policy, quota, reservations, usage)
    return [route for module in modules for route in module.routes(prefix)]
