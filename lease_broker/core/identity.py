"""Who is calling: a user name, a uid where known, whether they are an admin, groups an identity provider named;
and whose a name is (:class:`Namespaces`: a Hub user and a Unix user of the same name are two people)."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import os
import secrets

#: How a Hub user's name is written where Unix users are principals too (identity 'unix+hub'): ``hub:alice``.
#: A Unix name never holds ':' (the passwd file's separator), so no Unix user can be written like a Hub one.
HUB_PREFIX = "hub:"


@dataclasses.dataclass(frozen=True)
class Namespaces:
    """Whose a name is. Leases, quotas, fair share, usage, reservations and per-user policy key by one name, the
    *owner*: a Unix user's is their Unix name; a Hub user's is their Hub name, written ``hub:NAME`` where Unix users
    are principals too (identity 'unix+hub'), unless an admin mapped Hub names onto the Unix users of the same name
    (``LeaseBroker.hub_users_are_unix_users``). Groups follow the same rule (``hub:ml-team``)."""

    unix: bool = True  # Unix users are principals (identity 'unix' or 'unix+hub')
    hub: bool = False  # Hub users are principals (identity 'hub' or 'unix+hub')
    hub_is_unix: bool = False  # each Hub name is the Unix user of that name (an admin said so)

    @classmethod
    def of(cls, mode: str, hub_users_are_unix_users: bool = False) -> Namespaces:
        """The namespaces of an identity mode ('unix', 'hub' or 'unix+hub')."""
        return cls(unix=mode != "hub", hub=mode != "unix", hub_is_unix=hub_users_are_unix_users and mode != "unix")

    @property
    def prefix(self) -> str:
        """What is written before a Hub name (and a Hub group's) to make its owner name."""
        return HUB_PREFIX if self.unix and self.hub and not self.hub_is_unix else ""

    def hub_owner(self, name: str) -> str:
        """The owner name of the Hub user (or Hub group) ``name``."""
        return self.prefix + name

    def hub_name(self, owner: str) -> str | None:
        """The Hub user ``owner`` stands for, or None: no Hub user."""
        if not self.hub:
            return None
        if self.prefix:
            return owner[len(self.prefix):] if owner.startswith(self.prefix) else None
        return owner

    def unix_name(self, owner: str) -> str | None:
        """The Unix user ``owner`` stands for, or None: no Unix user (a Hub user who was not mapped onto one)."""
        if self.hub_is_unix:
            return owner
        if not self.unix or (self.prefix and owner.startswith(self.prefix)):
            return None
        return owner


@dataclasses.dataclass(frozen=True)
class Identity:
    user: str  # the owner name (Namespaces): 'alice' (Unix), 'hub:alice' (a Hub user beside Unix users)
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
