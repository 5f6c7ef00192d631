"""Identify the caller: SO_PEERCRED on the Unix socket, the broker's own bearer tokens, or a JupyterHub token.

The identity mode (``LeaseBroker.identity``) says what names a caller:

- ``unix``: on the Unix socket, the peer's uid (a token sent there is ignored); over TCP, a broker token.
- ``hub``: a token only, never a uid: a JupyterHub token (asked of the Hub) or a broker token (``gpl_…``).
  For deployments where single-user servers share uids (containers all running as uid 1000). On the Unix
  socket the peer's uid and pid still bound which processes a caller may attach to a lease.
- ``unix+hub``: a token when one is sent, else the Unix socket peer's uid.

A Hub user and a Unix user are two principals even under one name (``core.identity.Namespaces``): under
``unix+hub`` a Hub user's owner name is ``hub:NAME``, and admin lists say which kind of name they hold
(``admin_users``/``admin_groups``: Unix; ``hub_admin_users``/``hub_admin_groups``: the Hub's), unless an admin maps
Hub names onto Unix users (``LeaseBroker.hub_users_are_unix_users``).
"""

from __future__ import annotations

import re
import socket
import struct
from collections.abc import Awaitable, Callable, Iterable

from ..core.errors import Unauthorized
from ..core.identity import Identity, Namespaces, hash_secret
from ..host.users import GroupCache, user_name
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


def peer_of(sock: socket.socket | None, creds: tuple[int, int, int] | None) -> str:
    """Who is at the other end, for limits per peer: the uid on a Unix socket, the address over TCP."""
    if creds is not None:
        return f"uid {creds[1]}"
    try:
        return str(sock.getpeername()[0]) if sock is not None else "unknown"
    except (OSError, IndexError, TypeError):
        return "unknown"


#: is_admin(owner, uid, hub_groups): ``owner`` is the caller's owner name (core.identity.Namespaces), ``uid`` the
#: Unix socket peer's uid where it names the caller (else -1), ``hub_groups`` the groups the Hub named (None: not
#: a Hub answer).
AdminCheck = Callable[[str, int, tuple[str, ...] | None], bool]


class Authenticator:
    """Turns a connection and its headers into an Identity (or an awaitable of one, when the Hub must be asked)."""

    def __init__(self, store: Store, is_admin: AdminCheck, mode: str = "unix", hub: HubIdentity | None = None,
                 learn_groups: Callable[[str, tuple[str, ...]], None] | None = None,
                 namespaces: Namespaces | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"identity mode {mode!r}: use one of {', '.join(MODES)}")
        if mode != "unix" and hub is None:
            raise ValueError(f"identity mode {mode!r} needs a HubIdentity")
        self.store = store
        self.is_admin = is_admin
        self.mode = mode
        self.hub = hub
        self.namespaces = namespaces or Namespaces.of(mode)
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
            return self._hub_identity(self.hub.resolve(token, peer_of(sock, creds)), uid, pid)
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
        ns = self.namespaces
        owner, groups = ns.hub_owner(who.name), tuple(ns.hub_owner(g) for g in who.groups)
        self.learn_groups(owner, groups)
        admin = who.admin or self.is_admin(owner, -1, who.groups)
        return Identity(user=owner, uid=uid, admin=admin, pid=pid, groups=groups)

    def _no_token(self, authorization: str | None) -> str:
        if authorization:
            return "Malformed Authorization header: send 'Authorization: Bearer <token>' or 'Authorization: token <token>'"
        if self.mode == "unix":
            return ("Authentication required: send 'Authorization: Bearer <token>' (an admin issues tokens with "
                    "'lease-broker token create USER'), or connect through the broker's Unix socket")
        return ("Authentication required: this broker knows users by their JupyterHub token, not by uid. From a "
                "Jupyter server or kernel under JupyterHub it is sent by itself ($JUPYTERHUB_API_TOKEN); elsewhere "
                "send 'Authorization: token <your JupyterHub token>' (the Hub's token page creates one)")


class Admins:
    """Who is an admin (an ``AdminCheck``). A Unix user: uid 0 on the Unix socket (if ``root_is_admin``), a name in
    ``users``, or a member of one of ``groups`` (Unix groups, read again once ``cache_seconds`` old and on
    ``forget()``, SIGHUP). A Hub user: a name in ``hub_users`` or a member of one of ``hub_groups`` (the groups the
    Hub named with this token). Which an owner name is says ``namespaces``: a Hub user mapped onto the Unix user
    of the same name is checked as both."""

    def __init__(self, namespaces: Namespaces, users: Iterable[str] = (), groups: Iterable[str] = (),
                 hub_users: Iterable[str] = (), hub_groups: Iterable[str] = (), root_is_admin: bool = True,
                 cache_seconds: float = 60.0) -> None:
        self.namespaces = namespaces
        self.users, self.groups = frozenset(users), frozenset(groups)
        self.hub_users, self.hub_groups = frozenset(hub_users), frozenset(hub_groups)
        self.root_is_admin = root_is_admin
        self.unix_groups = GroupCache(cache_seconds)

    def __call__(self, owner: str, uid: int, hub_groups: tuple[str, ...] | None = None) -> bool:
        unix = self.namespaces.unix_name(owner)
        if unix is not None:
            if (uid == 0 and self.root_is_admin) or unix in self.users:
                return True
            if self.groups and not self.groups.isdisjoint(self.unix_groups(unix)):
                return True
        hub = self.namespaces.hub_name(owner)
        if hub is not None:
            return hub in self.hub_users or not self.hub_groups.isdisjoint(hub_groups or ())
        return False

    def forget(self) -> None:
        """Read Unix group membership again at the next check (SIGHUP)."""
        self.unix_groups.forget()
