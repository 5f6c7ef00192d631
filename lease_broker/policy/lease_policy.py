"""Admin policy: what a lease may ask for and how long it may hold GPUs."""

from __future__ import annotations

from typing import Any

from traitlets import Bool, Dict, Enum, List, TraitError, Unicode, validate
from traitlets.config import Configurable

from ..core.errors import BadRequest, Forbidden
from ..core.gpufit import Aliases, aliases_of
from ..core.lease import LeaseRequest
from ..core.scheduler import SchedulerPolicy
from .limits import LimitsPolicy
from .numbers import Float, Integer  # finite and >= 0, refused naming the option (numbers.py)


class LeasePolicy(LimitsPolicy, Configurable):
    """Limits every lease request; caps are applied, not negotiated."""

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
    def user_cap(self, user: str) -> float:
        return float(self.limit(user, "max_gpus"))

    def scheduler_policy(self) -> SchedulerPolicy:
        return SchedulerPolicy(
            priority_ranks=dict(self.priority_classes),
            user_cap=self.user_cap,
            max_shares_per_gpu=self.max_shares_per_gpu,
            max_leases_per_shared_gpu=self.max_leases_per_shared_gpu,
            backfill_depth=self.backfill_depth,
            groups_of=self.groups_of,
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
