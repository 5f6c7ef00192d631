"""Identify the caller: SO_PEERCRED on the Unix socket, the broker's own bearer tokens, or a JupyterHub token.

The identity mode (``LeaseBroker.identity``) says what names a caller:

- ``unix``: on the Unix socket, the peer's uid (a token sent there is ignored); over TCP, a broker token.
- ``hub``: a token only, never a uid: a JupyterHub token (asked of the Hub) or a broker token (``gpl_…``).
  For deployments where single-user servers share uids (containers all running as uid 1000). On the Unix
  socket the peer's uid and pid still bound which processes a caller may attach to a lease.
- ``unix+hub``: a token when one is sent, else the Unix socket peer's uid.
"""

from __future__ import annotations

import re
import socket
import struct
from collections.abc import Awaitable, Callable

from ..core.errors import Unauthorized
from ..core.identity import Identity, hash_secret
from ..host.users import unix_groups, user_name
from ..store.lease_store import Store
from .hub import HubIdentity, HubUser

_UCRED = struct.Struct("3i")
_TOKEN = re.compile(r"\s*(?:bearer|token)\s+(\S+)\s*$", re.IGNORECASE)
MODES = ("unix", "hub", "unix+hub")
BROKER_TOKEN_PREFIX = "gpl_"  # what `lease-broker token create` issues (core.identity.new_token)


def peer_credentials(sock: socket.socket) -> tuple[int, int, int] | None:
    """(pid, uid, gid) of the process at the other end of a Unix socket."""
    if sock.family != socket.AF_UNIX:
        return None
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return pid, uid, gid


#: is_admin(name, uid, groups): ``groups`` are the groups an identity provider named (the Hub's), or None: look up
#: the name's Unix groups.
AdminCheck = Callable[[str, int, tuple[str, ...] | None], bool]


class Authenticator:
    """Turns a connection and its headers into an Identity (or an awaitable of one, when the Hub must be asked)."""

    def __init__(self, store: Store, is_admin: AdminCheck, mode: str = "unix", hub: HubIdentity | None = None,
                 learn_groups: Callable[[str, tuple[str, ...]], None] | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"identity mode {mode!r}: use one of {', '.join(MODES)}")
        if mode != "unix" and hub is None:
            raise ValueError(f"identity mode {mode!r} needs a HubIdentity")
        self.store = store
        self.is_admin = is_admin
        self.mode = mode
        self.hub = hub
        self.learn_groups = learn_groups or (lambda user, groups: None)
        self._names: dict[int, str] = {}

    def identify(self, sock: socket.socket | None, authorization: str | None) -> Identity | Awaitable[Identity]:
        creds = peer_credentials(sock) if sock is not None else None
        m = _TOKEN.match(authorization or "")
        token = m.group(1) if m else None
        if creds is not None and (self.mode == "unix" or (self.mode == "unix+hub" and token is None)):
            pid, uid, _ = creds
            name = self._names.get(uid)
            if name is None:
                name = self._names[uid] = user_name(uid)
            return Identity(user=name, uid=uid, admin=self.is_admin(name, uid, None), pid=pid)
        if token is None:
            raise Unauthorized(self._no_token(authorization))
        uid, pid = (creds[1], creds[0]) if creds is not None else (-1, 0)
        if self.hub is None or token.startswith(BROKER_TOKEN_PREFIX):
            return self._broker_token(token, uid, pid)
        cached = self.hub.cached(token)
        if cached is None:
            raise self.hub.refused()
        if cached is False:
            return self._hub_identity(self.hub.resolve(token), uid, pid)
        assert isinstance(cached, HubUser)
        return self._from_hub(cached, uid, pid)

    def _broker_token(self, token: str, uid: int, pid: int) -> Identity:
        found = self.store.token_user(hash_secret(token))
        if found is None:
            hint = "" if self.hub is not None or token.startswith(BROKER_TOKEN_PREFIX) else (
                " (this broker does not take JupyterHub tokens: its admin sets LeaseBroker.identity = 'hub' or "
                "'unix+hub' for that)")
            raise Unauthorized(
                f"Invalid or revoked broker token{hint}: ask an admin for a new one ('lease-broker token create USER')",
                reason="invalid_token",
            )
        user, admin = found
        return Identity(user=user, uid=uid, admin=admin or self.is_admin(user, -1, None), pid=pid)

    async def _hub_identity(self, asking: Awaitable[HubUser], uid: int, pid: int) -> Identity:
        return self._from_hub(await asking, uid, pid)

    def _from_hub(self, who: HubUser, uid: int, pid: int) -> Identity:
        self.learn_groups(who.name, who.groups)
        admin = who.admin or self.is_admin(who.name, -1, who.groups)
        return Identity(user=who.name, uid=uid, admin=admin, pid=pid, groups=who.groups)

    def _no_token(self, authorization: str | None) -> str:
        if authorization:
            return "Malformed Authorization header: send 'Authorization: Bearer <token>' or 'Authorization: token <token>'"
        if self.mode == "unix":
            return ("Authentication required: send 'Authorization: Bearer <token>' (an admin issues tokens with "
                    "'lease-broker token create USER'), or connect through the broker's Unix socket")
        return ("Authentication required: this broker knows users by their JupyterHub token, not by uid. From a "
                "Jupyter server or kernel under JupyterHub it is sent by itself ($JUPYTERHUB_API_TOKEN); elsewhere "
                "send 'Authorization: token <your JupyterHub token>' (the Hub's token page creates one)")


def admin_check(users: set[str], groups: set[str], root_is_admin: bool) -> AdminCheck:
    """Whether a user is an admin: root (uid 0, if allowed), a named admin, or a member of an admin group (their
    Unix groups; for Hub users, the groups the Hub named)."""
    cache: dict[str, bool] = {}

    def is_admin(name: str, uid: int, named_groups: tuple[str, ...] | None) -> bool:
        if uid == 0 and root_is_admin:
            return True
        if name in users:
            return True
        if not groups:
            return False
        if named_groups is not None:
            return bool(groups.intersection(named_groups))
        if name not in cache:
            cache[name] = bool(set(unix_groups(name)) & groups)
        return cache[name]

    return is_admin
