"""What the policy's per-user and per-group limits come to for one user: ``LeasePolicy.limits``.

Every limit has a default option of :class:`~lease_broker.policy.lease_policy.LeasePolicy` (``LIMIT_KEYS``);
``user_limits`` and ``group_limits`` override it per user and per group (a user in several groups gets the most
generous of them; a user's own entry wins over any group's). ``group_quotas`` caps what all members of a group
hold together. The options are the policy's (configured as ``LeasePolicy.<name>``); this module only resolves them.
"""

from __future__ import annotations

import math
from typing import Any

from ..host.users import unix_groups
from .numbers import LARGEST_INT

#: Limits that ``user_limits`` / ``group_limits`` may set, with the trait that gives their default.
LIMIT_KEYS: dict[str, str] = {
    "max_gpus": "max_gpus_per_user",
    "gpu_hours_per_day": "gpu_hours_per_day",
    "max_duration_seconds": "max_duration_seconds",
    "default_duration_seconds": "default_duration_seconds",
    "default_idle_timeout_seconds": "default_idle_timeout_seconds",
    "max_idle_timeout_seconds": "max_idle_timeout_seconds",
    "priority_classes": "allowed_priority_classes",
    "fairshare_weight": "fairshare_weight",
    "max_queued": "max_queued_per_user",
}
QUOTA_KEYS = ("max_gpus", "gpu_hours_per_day")
DAY = 86400.0


def _number(value: Any) -> bool:
    """Whether a limit given in a dict is a number ``LeasePolicy``'s own options would take: finite, >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if isinstance(value, int):
        return 0 <= value <= LARGEST_INT
    return math.isfinite(value) and value >= 0


def check_limits(owner: str, value: dict[str, Any], keys: tuple[str, ...] | None = None) -> dict[str, Any]:
    allowed = keys or tuple(LIMIT_KEYS)
    for who, limits in value.items():
        if not isinstance(limits, dict):
            raise ValueError(f"LeasePolicy.{owner}[{who!r}]={limits!r}: must be a dict like {{'max_gpus': 4}}")
        for key, v in limits.items():
            if key not in allowed:
                raise ValueError(f"LeasePolicy.{owner}[{who!r}]: unknown limit {key!r}; use one of {', '.join(allowed)}")
            if key == "priority_classes":
                if not isinstance(v, (list, tuple)) or not all(isinstance(c, str) for c in v):
                    raise ValueError(f"LeasePolicy.{owner}[{who!r}]['priority_classes']={v!r}: must be a list of names")
            elif key == "max_gpus" and isinstance(v, dict) and owner != "group_quotas":
                for t, n in v.items():
                    if not isinstance(t, str) or not t or not _number(n):
                        raise ValueError(f"LeasePolicy.{owner}[{who!r}]['max_gpus'][{t!r}]={n!r}: give GPU types "
                                         "and numbers >= 0, e.g. {'H100': 1, '*': 4} ('*': all GPUs together)")
            elif not _number(v):
                raise ValueError(f"LeasePolicy.{owner}[{who!r}][{key!r}]={v!r}: must be a finite number >= 0")
    return value


class Limits:
    """The policy's limits resolved for one user (or group), with the answers kept in ``answers``.

    ``limit()``, ``groups_of()`` and ``type_caps()`` run several times per request: their answers are kept until
    ``forget()``, which the policy calls when an option changes and on SIGHUP (``LeasePolicy.reload``).
    ``learned`` holds the groups an identity provider (JupyterHub) reported, which no reload forgets.
    """

    def __init__(self, policy: Any) -> None:
        self.policy = policy  # the LeasePolicy whose options these are (it imports this module)
        self.answers: dict[tuple[str, str], Any] = {}
        self.learned: dict[str, tuple[str, ...]] = {}

    def forget(self) -> None:
        self.answers.clear()

    def learn(self, user: str, groups: tuple[str, ...]) -> bool:
        """The groups an identity provider reports for ``user`` now; returns whether they changed."""
        if self.learned.get(user) == groups:
            return False
        self.learned[user] = groups
        self.forget()
        return True

    def groups_of(self, user: str) -> tuple[str, ...]:
        found: tuple[str, ...] | None = self.answers.get(("", user))
        if found is None:
            pol = self.policy
            configured = [g for g, members in pol.group_members.items() if user in members]
            configured.extend(self.learned.get(user, ()))
            unix_user = pol.unix_user_of(user)  # a Hub user has no Unix groups unless mapped onto a Unix user
            if pol.unix_groups and unix_user:
                configured.extend(unix_groups(unix_user))
            found = self.answers[("", user)] = tuple(sorted(set(configured)))
        return found

    def policy_groups(self, user: str) -> tuple[str, ...]:
        """``groups_of`` as the options that limit by group (``group_limits``, ``group_quotas``) see it: () when
        neither names a group, since then no answer can depend on it, and the host's group database is not read
        (``pwd.getpwnam``, ~90 us for each user new to the broker). On the overloaded month replay, every burst its
        own user (benchmarks/replay_month.py), ``LeasePolicy.apply`` went from 100 us to 28 us a request on
        its 3,000-job version (about 2.2 s of the month's 31,000 requests)."""
        pol = self.policy
        return self.groups_of(user) if pol.group_limits or pol.group_quotas else ()

    def limit(self, user: str, key: str) -> Any:
        """The effective limit ``key`` (one of LIMIT_KEYS) for ``user``."""
        if (user, key) not in self.answers:
            self.answers[(user, key)] = self._limit(user, key)
        value = self.answers[(user, key)]
        return list(value) if isinstance(value, list) else value

    def _limit(self, user: str, key: str) -> Any:
        pol = self.policy
        own = pol.user_limits.get(user, {})
        if _overall(own.get(key)) is not None:
            return _overall(own[key])
        if key == "max_gpus" and user in pol.user_max_gpus:  # the older per-user cap
            return float(pol.user_max_gpus[user])
        found = [_overall(pol.group_limits[g][key]) for g in self.policy_groups(user) if key in pol.group_limits.get(g, {})]
        found = [v for v in found if v is not None]
        if found:
            if key == "priority_classes":
                return sorted({c for classes in found for c in classes})
            if any(v == 0 for v in found) and key in ("max_gpus", "gpu_hours_per_day", "max_queued"):
                return 0.0  # 0 = unlimited: the most generous
            return max(found)
        default = getattr(pol, LIMIT_KEYS[key])
        if key == "priority_classes":
            return list(default) or sorted(pol.priority_classes)
        return default

    def type_caps(self, user: str) -> dict[str, float]:
        """GPUs of each type ``user`` may hold at once (``max_gpus`` given per type): the user's own entry, else
        the most generous of their groups' for each type; types without a cap are absent."""
        if ("#types", user) not in self.answers:
            pol = self.policy
            own = pol.user_limits.get(user, {}).get("max_gpus")
            found = [own] if own is not None else [pol.group_limits[g]["max_gpus"] for g in self.policy_groups(user)
                                                   if "max_gpus" in pol.group_limits.get(g, {})]
            caps: dict[str, float] = {}
            for d in found:
                for t, n in (d.items() if isinstance(d, dict) else ()):
                    if t != "*":
                        caps[t] = 0.0 if n == 0 or caps.get(t) == 0 else max(caps.get(t, 0.0), float(n))
            self.answers[("#types", user)] = {t: n for t, n in caps.items() if n > 0}
        return dict(self.answers[("#types", user)])


def _overall(value: Any) -> Any:
    """A limit's value; of ``max_gpus`` given per type, the cap of all GPUs together ('*'; None: not given)."""
    return value.get("*") if isinstance(value, dict) else value
