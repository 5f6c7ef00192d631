"""Identify the caller: SO_PEERCRED on the Unix socket, bearer tokens over TCP."""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable

from ..core.errors import Unauthorized
from ..core.identity import Identity, hash_secret
from ..host.users import unix_groups, user_name
from ..store.lease_store import Store

_UCRED = struct.Struct("3i")


def peer_credentials(sock: socket.socket) -> tuple[int, int, int] | None:
    """(pid, uid, gid) of the process at the other end of a Unix socket."""
    if sock.family != socket.AF_UNIX:
        return None
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return pid, uid, gid


class Authenticator:
    """Turns a connection and its headers into an Identity."""

    def __init__(self, store: Store, is_admin: Callable[[str, int], bool]) -> None:
        self.store = store
        self.is_admin = is_admin
        self._names: dict[int, str] = {}

    def identify(self, sock: socket.socket | None, authorization: str | None) -> Identity:
        creds = peer_credentials(sock) if sock is not None else None
        if creds is not None:
            pid, uid, _ = creds
            name = self._names.get(uid)
            if name is None:
                name = self._names[uid] = user_name(uid)
            return Identity(user=name, uid=uid, admin=self.is_admin(name, uid), pid=pid)
        if not authorization or not authorization.lower().startswith("bearer "):
            raise Unauthorized(
                "Authentication required: send 'Authorization: Bearer <token>' (an admin issues tokens with "
                "'lease-broker token create USER'), or connect through the broker's Unix socket"
            )
        found = self.store.token_user(hash_secret(authorization[7:].strip()))
        if found is None:
            raise Unauthorized("Invalid or revoked token")
        user, admin = found
        return Identity(user=user, uid=-1, admin=admin or self.is_admin(user, -1))


def admin_check(users: set[str], groups: set[str], root_is_admin: bool) -> Callable[[str, int], bool]:
    cache: dict[str, bool] = {}

    def is_admin(name: str, uid: int) -> bool:
        if uid == 0 and root_is_admin:
            return True
        if name in users:
            return True
        if not groups:
            return False
        if name not in cache:
            cache[name] = bool(set(unix_groups(name)) & groups)
        return cache[name]

    return is_admin
