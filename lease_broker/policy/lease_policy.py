"""Admin policy: what a lease may ask for and how long it may hold GPUs, per user and per group (quotas, fair
share, preemption, reservations)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from traitlets import All, Bool, Dict, Enum, List, TraitError, Unicode, observe, validate
from traitlets.config import Configurable

from ..core.errors import BadRequest, Forbidden, TooManyRequests
from ..core.gpufit import Aliases, aliases_of
from ..core.lease import LeaseRequest
from ..core.scheduler import SchedulerPolicy
from ..host.users import forget_groups
from .limits import DAY, LIMIT_KEYS, QUOTA_KEYS, Limits, check_limits
from .numbers import Float, Integer  # finite and >= 0, refused naming the option (numbers.py)


class LeasePolicy(Configurable):
    """Limits every lease request; caps are applied, not negotiated.

    The options are this class's (``LeasePolicy.<name>``); ``limits`` resolves the per-user and per-group ones and
    keeps their answers until ``reload()``, the one invalidation: on every change of an option and on SIGHUP.
    """

    default_duration_seconds = Float(
        3600.0,
        positive=True,
        config=True,
        help="Lease time limit in seconds when a request names none. Example: 3600 (1 h).",
    )
    max_duration_seconds = Float(
        8 * 3600.0,
        positive=True,
        config=True,
        help="Longest lease time limit in seconds, also after renewals (a longer request is capped). Example: 28800.",
    )
    default_idle_timeout_seconds = Float(
        600.0,
        config=True,
        help="Seconds without activity after which a lease is revoked, when a request names none. "
        "0 = never revoke for idleness. Example: 600.",
    )
    max_idle_timeout_seconds = Float(
        3600.0, config=True, help="Largest idle timeout in seconds a request may ask for (capped). Example: 3600."
    )
    max_gpus_per_user = Float(
        0.0,
        config=True,
        help="GPUs one user may hold at once (fractions count as their share); 0 = unlimited. Example: 4.",
    )
    user_max_gpus = Dict(
        value_trait=Float(),
        config=True,
        help="Per-user override of max_gpus_per_user, e.g. {'alice': 8}. 0 = unlimited.",
    )
    heartbeat_timeout = Float(
        60.0,
        config=True,
        help="Seconds without a heartbeat from a lease's holder after which the lease is revoked "
        "with reason 'holder_gone'. A lease whose holder process the broker watches (a kernel on this host, which "
        "asks with ends_with_caller) ends when that process exits instead (reason 'holder_exited'). 0 = never. "
        "Example: 60.",
    )
    warn_before_seconds = Float(
        60.0,
        config=True,
        help="Seconds before an idle revocation or an expiry at which the holder is warned. Example: 60.",
    )
    pressure_idle_timeout_seconds = Float(
        60.0,
        config=True,
        help="Idle timeout in seconds while the request at the head of the queue (with small_first_gpus, a small "
        "request that goes before it) would fit on an idle lease's GPUs (with the free GPUs of its node): the "
        "lease is warned and revoked after this long without activity instead of its own idle timeout (never "
        "later than that; with no one waiting the lease's own timeout holds): the floor below which waiting "
        "requests never push an idle lease. A revoked %%gpu --session is parked in host memory, not lost. "
        "0 = off. Example: 120.",
    )
    pressure_learns_pauses = Bool(
        False,
        config=True,
        help="With pressure_idle_timeout_seconds: a lease whose holder has come back after idle pauses before "
        "(a notebook between its cells) is given the median of its last pauses instead of the pressure timeout "
        "(never less, never more than its own idle timeout), so a notebook that thinks 5 minutes between cells "
        "is not revoked after 2 while someone waits; a lease with no pause yet gets the pressure timeout. "
        "Example: True.",
    )
    warm_regrant_seconds = Float(
        60.0,
        config=True,
        help="Seconds after a lease ends (released, idle, expired) during which a new request from the same "
        "notebook (same user and 'notebook' label, which %%gpu sets) is granted the same GPUs again if they are "
        "still free and no earlier request in the queue needs them: a notebook's next cell finds its GPU. "
        "0 = off (a request gets whichever GPUs fit best). Example: 60.",
    )
    idle_mark_seconds = Float(
        30.0,
        config=True,
        help="Seconds without activity after which a granted lease is shown as 'idle' (it is not revoked "
        "before its idle timeout). Example: 30.",
    )
    term_timeout = Float(
        5.0,
        positive=True,
        config=True,
        help="Seconds between SIGTERM and SIGKILL when a lease's processes are stopped. Example: 5.",
    )
    priority_classes = Dict(
        value_trait=Integer(),
        default_value={"low": 0, "normal": 10, "high": 20},
        config=True,
        help="Priority classes and their ranks (higher is served first), e.g. {'low': 0, 'normal': 10}.",
    )
    backfill_depth = Integer(
        8,
        config=True,
        help="How many blocked requests at the head of the queue reserve GPUs as they free up; "
        "later requests may use those GPUs only if they end first. 0 = no reservations (plain priority).",
    )
    small_first_gpus = Integer(
        0,
        config=True,
        help="Requests of at most this many GPUs go before bigger ones of their priority class (a notebook's "
        "one-GPU cell before an 8-GPU gang that waits for a whole node anyway), until the bigger one has waited "
        "small_first_timeout: from then on it keeps its place (fair share, then arrival). 0 = off (queue order "
        "only). Example: 1.",
    )
    small_first_timeout = Float(
        3600.0,
        positive=True,
        config=True,
        help="Seconds a request bigger than small_first_gpus may be passed over by smaller ones; after that it "
        "keeps its place in the queue and its reservation, so it is never starved. Must be above 0. "
        "Example: 3600 (1 h).",
    )
    queue_depth = Integer(
        100,
        min=1,
        config=True,
        help="How many requests at the head of the queue a request, release or tick looks at (with the first "
        "request of each shape further back, and the request that just arrived), like Slurm's "
        "default_queue_depth: the cost of an event does not grow with the queue. Example: 100.",
    )
    full_pass_seconds = Float(
        10.0,
        config=True,
        help="Seconds between full scheduling passes over the whole queue: fresh fair-share order, start "
        "estimates for every request, and grants for requests deeper than queue_depth (like Slurm's "
        "bf_interval). A policy change, a reservation or a change of the GPUs brings the next one forward. "
        "0 = a full pass on every event (costs O(queue) each). Example: 10.",
    )
    full_pass_depth = Integer(
        2000,
        config=True,
        help="How many requests beyond queue_depth one full pass checks for a start, going on where the last "
        "full pass stopped (like Slurm's bf_max_job_test with bf_continue): a full pass costs at most this much "
        "however deep the queue, and every request is checked within queue length / full_pass_depth full "
        "passes. 0 = the whole queue in every full pass. Example: 2000.",
    )
    max_shares_per_gpu = Float(
        1.0, config=True, help="Sum of the fractions of shared leases one GPU may hold. Example: 1.0."
    )
    max_leases_per_shared_gpu = Integer(
        4, config=True, help="How many shared (fractional) leases one GPU may hold at once. Example: 4."
    )
    default_priority = Unicode("normal", config=True, help="Priority class of a request that names none.")
    gpu_types = Dict(
        value_trait=List(Unicode()),
        config=True,
        help="GPU type names users may ask for (--gpu-type) beyond the devices' own names, each with the NVML "
        "device names (or shell patterns) it covers, matched case-insensitively, e.g. {'A100-40GB': "
        "['NVIDIA A100-SXM4-40GB', 'NVIDIA A100-PCIE-40GB'], 'big': ['*H100*', '*A100*80GB*']}. A device also "
        "answers to its own name, to that name without 'NVIDIA ', and to its first word ('H100'); a MIG device to "
        "its profile ('1g.10gb') and to 'MIG'. {} = only those.",
    )
    drain_timeout = Float(
        60.0,
        positive=True,
        config=True,
        help="Seconds a GPU may stay draining after a lease ends (its processes and memory not yet gone) before "
        "it is marked unhealthy, never granted again until the broker restarts, and admins get an event. "
        "Never less than twice term_timeout. Example: 60.",
    )
    unleased_process_action = Enum(
        ["warn", "kill"],
        default_value="warn",
        config=True,
        help="What to do with a process that uses a GPU without a lease (not attached to a lease holding that "
        "GPU, nor a descendant of one): 'warn' reports it (event, metric, GPU view); 'kill' also stops it "
        "(SIGTERM, then SIGKILL after term_timeout) where the broker may (same uid, or the broker is root). "
        "Example: 'kill'.",
    )

    # --- limits per user and per group (resolved by ``limits``), quotas, fair share, preemption, reservations ---
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
    suspend_idle = Bool(
        True,
        config=True,
        help="Whether an idle, pressure or time-limit revocation of a suspendable lease (a kernel that can suspend "
        "its worker: CUDA checkpoint, or SIGSTOP where no GPU state exists) asks it to suspend instead: its GPU state "
        "goes to host memory, its GPUs go to others, and it resumes (on GPUs of its model) when its holder asks, "
        "with every variable intact. A holder that cannot, or does not report within suspend_report_seconds, is "
        "revoked as before. Example: False (revoke, as before suspension existed).",
    )
    suspend_report_seconds = Float(
        60.0,
        config=True,
        help="How long a holder asked to suspend has to report its processes suspended; then the broker does what "
        "it would have done without suspension (revokes the lease, or preempts it). A lease's time limit is kept: "
        "it is asked this long before its limit runs out. Example: 120.",
    )
    suspend_max_seconds = Float(
        86400.0,
        config=True,
        help="A lease suspended longer than this ends (revoked, reason 'suspended_too_long'), so that its "
        "processes do not hold host memory forever. 0 = no limit. Example: 3 * 86400.",
    )
    preempt_mode = Enum(
        ["revoke", "suspend"],
        "revoke",
        config=True,
        help="How a blocked request takes GPUs from running leases. 'revoke': only the classes in "
        "preempt_grace_seconds preempt, and their victims are revoked after the grace. 'suspend': a request that "
        "may suspend others (suspend_classes, suspend_max_gpus, suspend_max_duration_seconds) asks suspendable "
        "leases of no higher class to suspend (their GPU state goes to host memory, their processes stop); they "
        "resume on GPUs of their model, before new requests of their class, and lose nothing. Leases that cannot "
        "be suspended are still preempted only as 'revoke' says. Example: 'suspend'.",
    )
    suspend_classes = List(
        Unicode(),
        config=True,
        help="With preempt_mode 'suspend': the priority classes whose requests may suspend others; [] = every "
        "class. Example: ['normal', 'high'].",
    )
    suspend_max_gpus = Integer(
        0,
        config=True,
        help="With preempt_mode 'suspend': only requests of at most this many GPUs may suspend others (a big "
        "request waits as usual). 0 = any size. Example: 1.",
    )
    suspend_max_duration_seconds = Float(
        0.0,
        config=True,
        help="With preempt_mode 'suspend': only requests whose time limit is at most this many seconds may suspend "
        "others (short interactive cells, not long jobs). 0 = any time limit. Example: 3600.",
    )
    suspend_min_runtime_seconds = Float(
        300.0,
        config=True,
        help="With preempt_mode 'suspend': a lease holds its GPUs at least this many seconds since its grant or "
        "its last resume before a preemption may suspend it (each suspension costs a copy of its GPU memory both "
        "ways). Example: 600.",
    )
    suspend_max_share = Float(
        0.5,
        config=True,
        help="With preempt_mode 'suspend': a lease is not suspended by preemption again once the time it spent "
        "suspended exceeds this share of its age (since its request): the starvation bound, it holds GPUs the "
        "rest of the time. Example: 0.5.",
    )
    suspend_spare_gangs = Bool(
        False,
        config=True,
        help="With preempt_mode 'suspend': a waiting request of more GPUs than the one that would suspend others "
        "(a gang) that has waited suspend_yield_after_seconds is not overtaken through suspension: no lease holding "
        "a GPU of its planned reservation is suspended (the freed GPU would go to the small request, and the "
        "victim's resume would push the gang's start back). Example: True.",
    )
    suspend_resume_behind_gangs = Bool(
        False,
        config=True,
        help="With preempt_mode 'suspend': a lease suspended by preemption resumes behind (not before) a waiting "
        "request of more GPUs that asked before it was suspended and holds a planned reservation when it wants its GPUs "
        "back: it is then queued as a request of its user by its original arrival, not ahead of every new request of "
        "its class. Example: True.",
    )
    suspend_grant_asker = Bool(
        False,
        config=True,
        help="With preempt_mode 'suspend': the GPUs a suspension freed go to the request it was made for, ahead of "
        "the queue (else whoever is first in queue order takes them, often a gang whose reservation they complete, "
        "and the request asks again). Example: True.",
    )
    suspend_keep_gpus = Enum(
        ["off", "asker", "small"],
        default_value="off",
        config=True,
        help="With preempt_mode 'suspend': a gang (suspend_keep_min_gpus) suspended by preemption for a request keeps "
        "its GPUs: they are lent only to that request ('asker'), or also to other requests that may suspend others "
        "('small'), and it resumes on them, before anyone else, as soon as they are free again (or at "
        "suspend_keep_max_seconds); nobody else is granted or planned on them meanwhile. 'off': its GPUs go to the "
        "queue and it resumes when GPUs of its model are free. Example: 'small'.",
    )
    suspend_keep_min_gpus = Integer(
        2,
        config=True,
        help="With suspend_keep_gpus: only a lease of at least this many GPUs (and more than suspend_max_gpus) keeps "
        "them when it is suspended; smaller victims give theirs to the queue. Example: 8.",
    )
    suspend_keep_max_seconds = Float(
        0.0,
        config=True,
        help="With suspend_keep_gpus: a gang keeping its GPUs takes them back this many seconds after its "
        "suspension: the leases it lent them to are asked to suspend (they resume when GPUs of their model are free; "
        "one that cannot suspend borrows only if its time limit ends by then). 0: it resumes when they end, and "
        "only requests whose time limit ends before it could resume borrow. Example: 60.",
    )
    suspend_yield_after_seconds = Float(
        0.0,
        config=True,
        help="With suspend_spare_gangs: how long a gang waits before its reserved GPUs are spared (0: from its "
        "request on). Example: 3600.",
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
        return check_limits(proposal["trait"].name, proposal["value"])

    @validate("group_quotas")
    def _valid_quotas(self, proposal: dict[str, Any]) -> dict[str, Any]:
        return check_limits("group_quotas", proposal["value"], QUOTA_KEYS)

    @validate("priority_classes")
    def _valid_classes(self, proposal: dict[str, Any]) -> dict[str, int]:
        classes = dict(proposal["value"])
        if not classes:
            raise TraitError("LeasePolicy.priority_classes={}: give at least one class, e.g. {'normal': 10}")
        if self.default_priority not in classes:
            raise TraitError(f"LeasePolicy.priority_classes={classes!r}: default_priority {self.default_priority!r} "
                             "is not one of them: add it, or set LeasePolicy.default_priority to one of them too")
        return classes

    @validate("default_priority")
    def _valid_default_priority(self, proposal: dict[str, Any]) -> str:
        if proposal["value"] not in self.priority_classes:
            raise TraitError(f"LeasePolicy.default_priority={proposal['value']!r}: not a class of priority_classes "
                             f"(use one of {', '.join(sorted(self.priority_classes))})")
        return str(proposal["value"])

    # ------------------------------------------------------------------------------------------
    def __init__(self, unix_user_of: Callable[[str], str | None] | None = None, **kwargs: Any) -> None:
        self.limits = Limits(self)
        self._scheduler_policy: SchedulerPolicy | None = None  # built by ``scheduler_policy``, until ``reload``
        #: Counts ``reload()``s: a part that keeps option values read on a hot path reads them again when it moved.
        self.generation = 0
        #: The Unix user an owner name stands for, or None (``core.identity.Namespaces.unix_name``: a Hub user is
        #: not the Unix user of the same name unless an admin mapped them); given by the wiring from the identity mode.
        self.unix_user_of: Callable[[str], str | None] = unix_user_of or (lambda owner: owner)
        super().__init__(**kwargs)

    @observe(All)
    def _changed(self, change: Any) -> None:
        self.reload()

    def reload(self) -> None:
        """Forget every answer kept from the options and the host: Unix groups are read again, limits resolved
        again. Called when an option changes and on SIGHUP."""
        forget_groups()
        self.limits.forget()
        self._scheduler_policy = None
        self.generation += 1

    def limit(self, user: str, key: str) -> Any:
        """The effective limit ``key`` (one of LIMIT_KEYS) for ``user``."""
        return self.limits.limit(user, key)

    def groups_of(self, user: str) -> tuple[str, ...]:
        return self.limits.groups_of(user)

    def type_caps(self, user: str) -> dict[str, float]:
        return self.limits.type_caps(user)

    def learn_groups(self, user: str, groups: tuple[str, ...]) -> bool:
        """The groups an identity provider (JupyterHub) reports for ``user`` now: they count beside Unix groups and
        ``group_members`` from the user's next request on. Returns whether they changed (the caller stores them,
        so a restarted broker knows them before the user calls again)."""
        return self.limits.learn(user, groups)

    def user_cap(self, user: str) -> float:
        return float(self.limit(user, "max_gpus"))

    def scheduler_policy(self) -> SchedulerPolicy:
        """The options as the scheduler takes them, built once until ``reload()`` (every option change, SIGHUP)
        rather than for every pass: on the 3,000-job version of the overloaded month replay (benchmarks/replay_month.py)
        ``Planning.options`` went from 19.6 us to 8.9 us a pass (the month makes 82,697 passes: about 0.9 s)."""
        if self._scheduler_policy is None:
            self._scheduler_policy = self._build_scheduler_policy()
        return self._scheduler_policy

    def _build_scheduler_policy(self) -> SchedulerPolicy:
        return SchedulerPolicy(
            priority_ranks=dict(self.priority_classes),
            user_cap=self.user_cap,
            capped=bool(self.max_gpus_per_user or self.user_max_gpus
                        or any("max_gpus" in v for v in (*self.user_limits.values(), *self.group_limits.values()))
                        or any(v.get("max_gpus") for v in self.group_quotas.values())),
            max_shares_per_gpu=self.max_shares_per_gpu,
            max_leases_per_shared_gpu=self.max_leases_per_shared_gpu,
            backfill_depth=self.backfill_depth,
            groups_of=self.limits.policy_groups,  # the scheduler's groups serve group_quotas only
            group_cap=self.group_cap,
            gpu_types=self.gpu_type_aliases(),
            type_caps=self.type_caps,
            small_first_gpus=self.small_first_gpus,
            small_first_timeout=self.small_first_timeout,
        )

    def gpu_type_aliases(self) -> Aliases:
        return aliases_of(self.gpu_types)

    def apply(self, user: str, req: LeaseRequest, total_gpus: int) -> tuple[LeaseRequest, float, float]:
        """Check a request against policy; returns (request, duration, idle timeout) with caps applied."""
        priority = req.priority or self.default_priority
        if priority == "normal" and "normal" not in self.priority_classes:
            priority = self.default_priority
        if priority not in self.priority_classes:
            known = ", ".join(sorted(self.priority_classes))
            raise BadRequest(f"Unknown priority class {priority!r}: use one of {known}")
        self.check_allowed(user, priority)
        if req.min_gpus > total_gpus:
            raise BadRequest(
                f"Request for {req.min_gpus} GPUs can never be granted: the inventory has {total_gpus}",
                reason="too_large",
            )
        cap = self.user_cap(user)
        need = req.fraction if req.shared else req.min_gpus
        if cap > 0 and need > cap:
            raise Forbidden(
                f"Request for {need:g} GPUs exceeds your limit of {cap:g} GPUs at once (max_gpus_per_user)",
                reason="quota",
            )
        for t, n in self.type_caps(user).items():
            if req.gpu_type.lower() == t.lower() and need > n:
                raise Forbidden(f"Request for {need:g} {t} GPUs exceeds your limit of {n:g} {t} GPUs at once "
                                "(max_gpus)", reason="quota")
        duration = req.duration_seconds or self.limit(user, "default_duration_seconds")
        duration = min(duration, self.limit(user, "max_duration_seconds"))
        idle = req.idle_timeout_seconds or self.limit(user, "default_idle_timeout_seconds")
        if self.limit(user, "max_idle_timeout_seconds"):
            idle = min(idle, self.limit(user, "max_idle_timeout_seconds"))
        self.check_day_quota(user, need, duration)
        if req.max_gpus > total_gpus:
            req = LeaseRequest(**{**req.to_json(), "max_gpus": total_gpus})
        if priority != req.priority:
            req = LeaseRequest(**{**req.to_json(), "priority": priority})
        return req, duration, idle

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
        for g in self.limits.policy_groups(user):
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
