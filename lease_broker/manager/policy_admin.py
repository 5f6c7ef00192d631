"""Admin operations on the policy: a change through the API or a reload of the config file (SIGHUP), applied
without dropping leases, refused naming the bad field, and audited."""

from __future__ import annotations

import logging
import os
from typing import Any

from traitlets import TraitError

from ..core.clock import Clock
from ..core.errors import BadRequest, LeaseError
from ..policy.lease_policy import LeasePolicy
from ..store.admin_store import AdminStore
from .state import LeaseOps

log = logging.getLogger("lease_broker")


def policy_values(policy: Any) -> dict[str, Any]:
    return {name: getattr(policy, name) for name in sorted(policy.trait_names(config=True))}


def _named_field(message: str, changes: dict[str, Any]) -> str:
    """The changed field a refusal checked once all were set names (its message starts 'LeasePolicy.<field>')."""
    return next((k for k in changes if f".{k}=" in message or f".{k}[" in message), ", ".join(sorted(changes)))


class PolicyAdmin:
    def __init__(self, *, policy: LeasePolicy, store: AdminStore, ops: LeaseOps, clock: Clock) -> None:
        self.policy, self.store, self.ops, self.clock = policy, store, ops, clock

    def update(self, who: str, changes: dict[str, Any], source: str = "api") -> dict[str, Any]:
        """Apply policy changes without dropping leases; refuse an invalid one naming the field; audit it."""
        pol = self.policy
        current = policy_values(pol)
        for key in changes:
            if key not in current:
                raise BadRequest(f"Unknown policy field {key!r}", extra={"field": key})
        candidate = type(pol)(**{k: v for k, v in current.items()})
        key = ""
        try:  # each value is checked as it is set; what relates fields (default_priority among priority_classes)
            with candidate.hold_trait_notifications():  # once all are set, so they may change together
                for key, value in changes.items():
                    setattr(candidate, key, value)
                key = ""
        except (TraitError, ValueError, TypeError) as e:
            field = key or _named_field(str(e), changes)
            raise BadRequest(f"Invalid policy field {field}: {e}", extra={"field": field}) from None
        diff = {k: [current[k], getattr(candidate, k)] for k in changes if getattr(candidate, k) != current[k]}
        if not diff:
            return {}
        with pol.hold_trait_notifications():
            for key, (_, new) in diff.items():
                setattr(pol, key, new)
        self.store.audit(self.clock.now(), who, source, diff)
        log.info("Policy changed by %s via %s: %s", who, source, ", ".join(sorted(diff)))
        self.ops.publish("policy", change="updated", fields=sorted(diff), by=who if source != "api" else None)
        self.ops.replan()
        return diff

    def reload_file(self, config_file: str, cli_config: Any) -> dict[str, Any]:
        """SIGHUP: re-read the config file (command-line options still win) and apply its LeasePolicy, audited."""
        from traitlets.config import Config
        from traitlets.config.loader import PyFileConfigLoader

        cfg = Config()
        try:
            if config_file and os.path.exists(config_file):
                path = os.path.abspath(config_file)
                cfg.merge(PyFileConfigLoader(os.path.basename(path), path=os.path.dirname(path)).load_config())
            cfg.merge(cli_config)
            fresh = type(self.policy)(config=cfg)
        except Exception as e:  # a broken file must not take the broker down: keep the running policy
            log.error("Policy reload from %s refused, keeping the current policy: %s", config_file, e)
            return {}
        new, old = policy_values(fresh), policy_values(self.policy)
        changes = {k: v for k, v in new.items() if v != old[k]}
        try:
            diff = self.update("sighup", changes, source="sighup:" + config_file)
        except LeaseError as e:
            log.error("Policy reload from %s refused: %s", config_file, e.message)
            return {}
        log.info("Policy reloaded from %s: %d field(s) changed", config_file, len(diff))
        return diff
