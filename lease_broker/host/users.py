"""This host's users and groups (the passwd and group databases): who a uid is, which groups a user is in."""

from __future__ import annotations

import functools
import grp
import os
import pwd
import time
from collections.abc import Callable


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid{uid}"


def read_groups(user: str) -> tuple[str, ...]:
    """The user's Unix groups (primary and supplementary) as the group database says now; () for a user the host
    does not know."""
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


@functools.lru_cache(maxsize=4096)
def unix_groups(user: str) -> tuple[str, ...]:
    """``read_groups``, kept until ``forget_groups()`` (SIGHUP): for policy groups (limits, quotas), which a
    reload re-reads."""
    return read_groups(user)


def forget_groups() -> None:
    """Read every user's groups again at their next use (SIGHUP)."""
    unix_groups.cache_clear()


class GroupCache:
    """Users' Unix groups, each read again once it is ``max_age`` seconds old (on the monotonic clock) and all
    after ``forget()``: membership that follows the group database within ``max_age``."""

    def __init__(self, max_age: float, read: Callable[[str], tuple[str, ...]] = read_groups,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_age, self.read, self.clock = max_age, read, clock
        self._known: dict[str, tuple[tuple[str, ...], float]] = {}

    def __call__(self, user: str) -> tuple[str, ...]:
        now = self.clock()
        found = self._known.get(user)
        if found is None or now - found[1] >= self.max_age:
            if len(self._known) >= 4096:  # a bound on memory: drop what is stale
                self._known = {u: v for u, v in self._known.items() if now - v[1] < self.max_age}
            found = self._known[user] = (self.read(user), now)
        return found[0]

    def forget(self) -> None:
        self._known.clear()
