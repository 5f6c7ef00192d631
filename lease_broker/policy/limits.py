"""Per-user and per-group limits, quotas, fair-share weights, preemption and reservations policy.

The base class of :class:`~lease_broker.policy.lease_policy.LeasePolicy` (configured as ``LeasePolicy.<name>``). Every limit has
a default trait; ``user_limits`` and ``group_limits`` override it per user and per group (a user in several
groups gets the most generous of them; a user's own entry wins over any group's). ``group_quotas`` caps what
all members of a group hold together.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from traitlets import All, Bool, Dict, List, Unicode, observe, validate
from traitlets.config import Configurable

from ..core.errors import Forbidden, TooManyRequests
from ..host.users import unix_groups
from .numbers import LARGEST_INT, Float, Integer  # finite and >= 0, refused naming the option (numbers.py)

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


def _check_limits(owner: str, value: dict[str, Any], keys: tuple[str, ...] | None = None) -> dict[str, Any]:
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


class LimitsPolicy(Configurable):
    """Quotas, per-user/group limits, fair share, preemption and reservation rules (mixed into LeasePolicy)."""

    gpu_hours_per_day = Float(
        0.0,
        config=True,
        help="GPU-hours one user may use in any 24 hours (ended leases' held time plus running leases' full "
        "time limit); a request that would exceed it waits. 0 = unlimited. Example: 24.",
    )
    allowed_priority_classes = List(
        Unicode(),
        config=True,
        help="Priority classes users may ask for by default; [] = every class in priority_classes. "
        "Example: ['low', 'normal'].",
    )
    fairshare_weight = Float(
        1.0,
        positive=True,
        config=True,
        help="Default fair-share weight of a user (> 0): within a priority class, users are served by decayed "
        "past GPU-seconds divided by their weight, least first. Example: 1.0 (2.0 = twice the share).",
    )
    fairshare_half_life_seconds = Float(
        7 * DAY,
        config=True,
        help="Half-life in seconds of past GPU usage in fair share (usage this old counts half). "
        "0 = no decay (all history counts fully). Example: 604800 (7 days).",
    )
    user_limits = Dict(
        config=True,
        help="Per-user limits overriding the defaults, e.g. {'alice': {'max_gpus': 8, 'gpu_hours_per_day': 48, "
        "'priority_classes': ['low', 'normal', 'high'], 'fairshare_weight': 2}}. Keys: " + ", ".join(LIMIT_KEYS)
        + " (durations in seconds; 0 = unlimited where the default allows it). max_gpus may also be per GPU type "
        "(as --gpu-type names them): {'bob': {'max_gpus': {'H100': 1, '*': 4}}} = at most 1 H100 and 4 GPUs "
        "in all ('*'; absent: the default).",
    )
    group_limits = Dict(
        config=True,
        help="Per-group limits for each member (same keys as user_limits; a user in several groups gets the most "
        "generous), e.g. {'ml-team': {'max_gpus': 4}}. A user's own user_limits entry wins.",
    )
    group_quotas = Dict(
        config=True,
        help="Limits on what all members of a group hold together: {'ml-team': {'max_gpus': 6, "
        "'gpu_hours_per_day': 100}}. 0 or absent = unlimited.",
    )
    group_members = Dict(
        value_trait=List(Unicode()),
        config=True,
        help="Configured group membership, in addition to Unix groups and JupyterHub groups (identity 'hub'), "
        "e.g. {'ml-team': ['alice', 'bob']}.",
    )
    unix_groups = Bool(
        True,
        config=True,
        help="Whether a Unix user's groups (the host's group database) count as their groups for group_limits, "
        "group_quotas and reservations. A JupyterHub user has no Unix groups (a Hub name is not this host's user) "
        "unless LeaseBroker.hub_users_are_unix_users maps them. Example: False (only group_members and JupyterHub "
        "groups).",
    )
    preempt_grace_seconds = Dict(
        value_trait=Float(),
        config=True,
        help="Priority classes that may preempt leases of lower classes, with the grace in seconds the victim gets "
        "(a 'lease.preempting' event and SIGUSR1 to its processes) before it is revoked with reason 'preempted'. "
        "Absent = the class never preempts; 0 = no grace. Example: {'high': 300}.",
    )
    user_reservation_max_gpus = Integer(
        0,
        config=True,
        help="How many GPUs a non-admin user may reserve for themselves in advance (admins reserve any number "
        "for any user or group). 0 = only admins reserve. Example: 2.",
    )
    max_reservation_seconds = Float(
        86400.0,
        config=True,
        help="Longest window in seconds a non-admin user may reserve. 0 = unlimited. Example: 14400 (4 h).",
    )

    max_queued_per_user = Integer(
        1000,
        config=True,
        help="Requests one user may have waiting in the queue at once, admins too (like Slurm's MaxSubmitJobs); one "
        "more is refused with 429 naming the cap, and the user may ask again once some were granted or cancelled. "
        "It keeps one user from filling the broker's memory and store. user_limits and group_limits may set "
        "'max_queued' per user or group. 0 = unlimited. Example: 1000.",
    )

    shared_mps = Unicode(
        "auto",
        config=True,
        help="Whether shared (fractional) leases get CUDA MPS limits in their environment "
        "(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE from the fraction, CUDA_MPS_PINNED_DEVICE_MEM_LIMIT from the memory "
        "cap): 'auto' when the MPS control daemon runs (its pipe in $CUDA_MPS_PIPE_DIRECTORY, default "
        "/tmp/nvidia-mps), 'on', or 'off'. GPULEASE_MEMORY_LIMIT and GPULEASE_MEMORY_FRACTION are always set.",
    )
    enforce_memory_caps = Bool(
        True,
        config=True,
        help="Whether a shared lease whose processes use more GPU memory than its cap (--mem, else its fraction of "
        "the GPU; NVML's per-process memory, CUDA context included) is revoked with reason 'over_memory_cap' "
        "and its processes stopped. Needs an inventory with per-process memory (NVML). Example: False.",
    )

    @validate("shared_mps")
    def _valid_mps(self, proposal: dict[str, Any]) -> str:
        if proposal["value"] not in ("auto", "on", "off"):
            raise ValueError(f"LeasePolicy.shared_mps={proposal['value']!r}: use 'auto', 'on' or 'off'")
        return str(proposal["value"])

    @validate("user_limits", "group_limits")
    def _valid_limits(self, proposal: dict[str, Any]) -> dict[str, Any]:
        return _check_limits(proposal["trait"].name, proposal["value"])

    @validate("group_quotas")
    def _valid_quotas(self, proposal: dict[str, Any]) -> dict[str, Any]:
        return _check_limits("group_quotas", proposal["value"], QUOTA_KEYS)

    # ------------------------------------------------------------------------------------------
    # groups_of() and limit() run several times per request: their answers are kept until a trait changes
    # (a reload assigns new values; the policy's dicts are never changed in place).
    @observe(All)
    def _forget_answers(self, change: Any) -> None:
        self.__dict__.pop("_answer_memo", None)

    def _answers(self) -> dict[tuple[str, str], Any]:
        answers: dict[tuple[str, str], Any] | None = self.__dict__.get("_answer_memo")
        if answers is None:
            answers = self.__dict__["_answer_memo"] = {}
        return answers

    #: The Unix user an owner name stands for, or None (``core.identity.Namespaces.unix_name``: a Hub user is not the
    #: Unix user of the same name unless an admin mapped them); set by the wiring from the identity mode.
    unix_user_of: Callable[[str], str | None] = staticmethod(lambda owner: owner)

    def learn_groups(self, user: str, groups: tuple[str, ...]) -> bool:
        """The groups an identity provider (JupyterHub) reports for ``user`` now: they count beside Unix groups and
        ``group_members`` from the user's next request on. Returns whether they changed (the caller stores them,
        so a restarted broker knows them before the user calls again)."""
        learned: dict[str, tuple[str, ...]] = self.__dict__.setdefault("_learned_groups", {})
        if learned.get(user) == groups:
            return False
        learned[user] = groups
        self.__dict__.pop("_answer_memo", None)
        return True

    def groups_of(self, user: str) -> tuple[str, ...]:
        answers = self._answers()
        found: tuple[str, ...] | None = answers.get(("", user))
        if found is None:
            configured = [g for g, members in self.group_members.items() if user in members]
            configured.extend(self.__dict__.get("_learned_groups", {}).get(user, ()))
            unix_user = self.unix_user_of(user)  # a Hub user has no Unix groups unless mapped onto a Unix user
            if self.unix_groups and unix_user:
                configured.extend(unix_groups(unix_user))
            found = answers[("", user)] = tuple(sorted(set(configured)))
        return found

    def limit(self, user: str, key: str) -> Any:
        """The effective limit ``key`` (one of LIMIT_KEYS) for ``user``."""
        answers = self._answers()
        if (user, key) not in answers:
            answers[(user, key)] = self._limit(user, key)
        value = answers[(user, key)]
        return list(value) if isinstance(value, list) else value

    def _limit(self, user: str, key: str) -> Any:
        own = self.user_limits.get(user, {})
        if _overall(own.get(key)) is not None:
            return _overall(own[key])
        legacy: dict[str, float] = getattr(self, "user_max_gpus", {})  # LeasePolicy's older per-user cap
        if key == "max_gpus" and user in legacy:
            return float(legacy[user])
        found = [_overall(self.group_limits[g][key]) for g in self.groups_of(user) if key in self.group_limits.get(g, {})]
        found = [v for v in found if v is not None]
        if found:
            if key == "priority_classes":
                return sorted({c for classes in found for c in classes})
            if any(v == 0 for v in found) and key in ("max_gpus", "gpu_hours_per_day", "max_queued"):
                return 0.0  # 0 = unlimited: the most generous
            return max(found)
        default = getattr(self, LIMIT_KEYS[key])
        if key == "priority_classes":
            return list(default) or sorted(getattr(self, "priority_classes", {}))
        return default

    def type_caps(self, user: str) -> dict[str, float]:
        """GPUs of each type ``user`` may hold at once (``max_gpus`` given per type): the user's own entry, else
        the most generous of their groups' for each type; types without a cap are absent."""
        answers = self._answers()
        if ("#types", user) not in answers:
            own = self.user_limits.get(user, {}).get("max_gpus")
            found = [own] if own is not None else [self.group_limits[g]["max_gpus"] for g in self.groups_of(user)
                                                   if "max_gpus" in self.group_limits.get(g, {})]
            caps: dict[str, float] = {}
            for d in found:
                for t, n in (d.items() if isinstance(d, dict) else ()):
                    if t != "*":
                        caps[t] = 0.0 if n == 0 or caps.get(t) == 0 else max(caps.get(t, 0.0), float(n))
            answers[("#types", user)] = {t: n for t, n in caps.items() if n > 0}
        return dict(answers[("#types", user)])

    def group_cap(self, group: str) -> float:
        return float(self.group_quotas.get(group, {}).get("max_gpus", 0.0))

    def quotas_configured(self) -> bool:
        return bool(
            self.gpu_hours_per_day
            or any("gpu_hours_per_day" in v for v in self.user_limits.values())
            or any("gpu_hours_per_day" in v for v in self.group_limits.values())
            or any(v.get("gpu_hours_per_day") for v in self.group_quotas.values())
        )

    def weight(self, user: str) -> float:
        w = float(self.limit(user, "fairshare_weight"))
        return w if w > 0 else 1.0

    def check_allowed(self, user: str, priority: str) -> None:
        allowed = self.limit(user, "priority_classes")
        if priority not in allowed:
            raise Forbidden(
                f"Priority class {priority!r} is not allowed for {user}: use one of {', '.join(allowed)}",
                reason="priority_not_allowed",
            )

    def check_queued(self, user: str, queued: int) -> None:
        """Refuse one more request of ``user``, who has ``queued`` waiting, at their ``max_queued_per_user``."""
        cap = int(self.limit(user, "max_queued"))
        if cap and queued >= cap:
            raise TooManyRequests(
                f"{user} has {queued} requests waiting, the most one user may queue (max_queued_per_user={cap}): "
                "cancel some, or ask again once some were granted", reason="queue_full", extra={"limit": cap})

    def day_quotas(self, user: str) -> dict[str, float]:
        """GPU-seconds per 24 h that bound ``user``: by the user, and by each of their groups ("@group")."""
        out: dict[str, float] = {}
        hours = float(self.limit(user, "gpu_hours_per_day"))
        if hours > 0:
            out[user] = hours * 3600.0
        for g in self.groups_of(user):
            gh = float(self.group_quotas.get(g, {}).get("gpu_hours_per_day", 0.0))
            if gh > 0:
                out["@" + g] = gh * 3600.0
        return out

    def check_day_quota(self, user: str, gpus: float, duration: float) -> None:
        """Refuse a request that no day could ever fit (it would wait forever)."""
        if not self.quotas_configured():
            return
        for who, seconds in self.day_quotas(user).items():
            if gpus * duration > seconds + 1e-6:
                raise Forbidden(
                    f"Request for {gpus:g} GPUs for {duration:g} s ({gpus * duration / 3600:g} GPU-hours) exceeds the "
                    f"daily quota of {seconds / 3600:g} GPU-hours of {who} (gpu_hours_per_day): ask for less time",
                    reason="quota",
                )


def _overall(value: Any) -> Any:
    """A limit's value; of ``max_gpus`` given per type, the cap of all GPUs together ('*'; None: not given)."""
    return value.get("*") if isinstance(value, dict) else value
