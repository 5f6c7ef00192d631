"""Who is calling: a user name, a uid where known, whether they are an admin."""

from __future__ import annotations

import dataclasses
import grp
import hashlib
import pwd
import secrets


@dataclasses.dataclass(frozen=True)
class Identity:
    user: str
    uid: int = -1  # -1: not a local user (token over TCP)
    admin: bool = False
    pid: int = 0  # the calling process, when known (Unix socket)


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid{uid}"


def user_uid(name: str) -> int:
    try:
        return pwd.getpwnam(name).pw_uid
    except KeyError:
        return -1


def user_groups(name: str) -> set[str]:
    groups = {g.gr_name for g in grp.getgrall() if name in g.gr_mem}
    try:
        groups.add(grp.getgrgid(pwd.getpwnam(name).pw_gid).gr_name)
    except KeyError:
        pass
    return groups


def new_token() -> str:
    return "gpl_" + secrets.token_urlsafe(32)


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()
