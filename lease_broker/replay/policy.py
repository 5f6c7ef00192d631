"""The replayed broker's policy: read from a config file as the broker reads its own, or copied with overrides."""

from __future__ import annotations

from typing import Any

from traitlets.config import Config

from ..policy.lease_policy import LeasePolicy
from .trace import TraceError


def load_policy(path: str | None) -> LeasePolicy:
    """The broker's policy from a traitlets python config file (``c.LeasePolicy.x = ...``)."""
    if not path:
        return LeasePolicy()
    from pathlib import Path

    from traitlets.config.loader import ConfigFileNotFound, PyFileConfigLoader

    p = Path(path)
    try:
        cfg = PyFileConfigLoader(p.name, path=str(p.parent.resolve())).load_config()
    except ConfigFileNotFound:
        raise TraceError(f"{path}: no such config file") from None
    except Exception as e:  # a config file is python: any error in it is the user's to fix
        raise TraceError(f"{path}: cannot load the config file: {type(e).__name__}: {e}") from None
    try:
        return LeasePolicy(config=cfg)
    except Exception as e:
        raise TraceError(f"{path}: invalid policy: {e}") from None


def policy_copy(policy: LeasePolicy, **overrides: Any) -> LeasePolicy:
    cfg = Config()
    cfg.LeasePolicy = Config(policy.trait_values(config=True))
    for k, v in overrides.items():
        cfg.LeasePolicy[k] = v
    return LeasePolicy(config=cfg)
