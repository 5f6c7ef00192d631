"""Who is calling: a user name, a uid where known, whether they are an admin, groups an identity provider named."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import os
import secrets


@dataclasses.dataclass(frozen=True)
class Identity:
    user: str
    uid: int = -1  # -1: not a local user (token over TCP)
    admin: bool = False
    pid: int = 0  # the calling process, when known (Unix socket)
    groups: tuple[str, ...] = ()  # groups the identity provider (JupyterHub) named; Unix groups are looked up by name


def new_token() -> str:
    return "gpl_" + secrets.token_urlsafe(32)


def new_lease_keys() -> tuple[str, str]:
    """A new lease's id ("l-" and 12 hex digits) and its holder's secret (32 URL-safe characters, 192 random
    bits), from one read of the system's randomness (a request makes both)."""
    raw = os.urandom(30)
    return "l-" + raw[24:].hex(), base64.urlsafe_b64encode(raw[:24]).decode()


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()
