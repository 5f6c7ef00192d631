"""This host's users and groups (the passwd and group databases): who a uid is, which groups a user is in."""

from __future__ import annotations

import functools
import grp
import os
import pwd


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid{uid}"


@functools.lru_cache(maxsize=4096)
def unix_groups(user: str) -> tuple[str, ...]:
    """The user's Unix groups (primary and supplementary); () for a user the host does not know."""
    try:
        pw = pwd.getpwnam(user)
        gids = os.getgrouplist(user, pw.pw_gid)
    except (KeyError, OSError):
        return ()
    names = []
    for gid in gids:
        try:
            names.append(grp.getgrgid(gid).gr_name)
        except KeyError:
            continue
    return tuple(sorted(set(names)))
