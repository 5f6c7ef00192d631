"""A hypothesis state machine over the real LeaseManager on a virtual clock and an in-memory store: requests
(gangs on one node or spread, incremental ranges that grow, shared fractions, three priority classes of which
one preempts), of a GPU type or memory size on a mixed inventory, releases, activity, renewals, ticks,
reservations for users and groups and their cancelling, under user and group caps and a daily GPU-hour quota.
Every step checks the invariants a user relies on: no GPU in two exclusive leases; gangs all or nothing; every
device of the type and size its lease asked for; a shared GPU within its shares and memory; quotas and
reservations never violated; the head request's wait bounded. At least 10,000 steps (test_scheduler_machine)."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from store_helpers import held_stretches, iter_rows
from table_checks import table_diffs

from lease_broker.core.clock import VirtualClock
from lease_broker.core.errors import LeaseError
from lease_broker.core.gpufit import fits
from lease_broker.core.identity import Identity
from lease_broker.core.lease import HOLDING, LeaseState
from lease_broker.core.scheduler import schedule
from lease_broker.inventory.simulated import SimulatedInventory
from lease_broker.manager.manager import LeaseManager
from lease_broker.policy.lease_policy import LeasePolicy
from lease_broker.store.lease_store import Store

USERS = [Identity(f"u{i}", uid=2000 + i) for i in range(4)]
ADMIN = Identity("root", uid=0, admin=True)
MAX_DURATION = 3600.0
GRACE = 30.0
CAP = 4.0
GROUP_CAP = 4.0
DAY_QUOTA_U2 = 3.0  # GPU-hours
H100_CAP_U3 = 1  # H100s u3 may hold at once (a cap per GPU type)
MAX_WINDOW = 3600.0
SLACK = 1800.0 + 1
EPS = 1e-6


class SchedulerMachine(RuleBasedStateMachine):
    SUSPENDABLE = False  # whether its requests may be suspendable (SuspendMachine)

    @initialize(nodes=st.sampled_from([1, 2, "1x4:A100-40GB,1x2:H100"]))
    def start(self, nodes: int | str) -> None:
        self.clock = VirtualClock()
        self.policy = LeasePolicy(
            heartbeat_timeout=1e9, default_idle_timeout_seconds=0, unix_groups=False,
            max_duration_seconds=MAX_DURATION, default_duration_seconds=600, max_gpus_per_user=CAP,
            group_members={"ml": ["u0", "u1"]}, group_quotas={"ml": {"max_gpus": GROUP_CAP}},
            user_limits={"u2": {"gpu_hours_per_day": DAY_QUOTA_U2}, "u3": {"max_gpus": {"H100": H100_CAP_U3}}},
            preempt_grace_seconds={"high": GRACE},
            max_shares_per_gpu=1.0, max_leases_per_shared_gpu=3, fairshare_half_life_seconds=1800,
        )
        inventory = SimulatedInventory(cluster=nodes) if isinstance(nodes, str) else SimulatedInventory(gpus=6,
                                                                                                       nodes=nodes)
        self.m = LeaseManager(Store(":memory:"), inventory, self.policy, clock=self.clock)
        self.m.restore()
        self.head_since: dict[str, float] = {}

    # ------------------------------------------------------------------ rules
    @rule(user=st.sampled_from(USERS), gpus=st.sampled_from(["1", "2", "3", "4", "6", "1-3", "2-4", "0.25", "0.5"]),
          duration=st.sampled_from([60, 300, 900, 1800, 3600]), priority=st.sampled_from(["low", "normal", "high"]),
          spread=st.booleans(), gpu_type=st.sampled_from(["", "", "", "A100", "H100", "V100"]),
          gpu_mem=st.sampled_from([0, 0, 0, "40G", "64G"]), notebook=st.sampled_from(["", "a.ipynb", "b.ipynb"]),
          grow=st.booleans(), suspendable=st.booleans())
    def request(self, user: Identity, gpus: str, duration: int, priority: str, spread: bool, gpu_type: str,
                gpu_mem: int | str, notebook: str, grow: bool, suspendable: bool) -> None:
        body: dict[str, object] = {"gpus": gpus, "duration_seconds": duration, "priority": priority,
                                   "gpu_type": gpu_type, "gpu_mem": gpu_mem, "grow": grow,
                                   "suspendable": suspendable and self.SUSPENDABLE}
        if notebook:  # warm re-grants: its notebook's last GPUs again while they are free
            body["labels"] = {"notebook": notebook}
        if spread:
            body["locality"] = "any"
        try:
            lease, _ = self.m.request(user, body)
        except LeaseError as e:
            assert e.status_code in (400, 403), e.message
            return
        if lease.state == LeaseState.QUEUED:
            self._could_not_start(lease)

    def _could_not_start(self, lease) -> None:
        """A request that can start now without delaying what the plan reserves starts within its own event,
        however deep the queue: a pass over the whole queue, in the same order and on the same GPUs, would not
        grant it either."""
        m, now = self.m, self.clock.now()
        pending = list(m.holds.others(m.state.queue))  # (GPUs a suspended gang keeps are its own: holds.py)
        decision = schedule(pending, m.holds.hide(m.enforcer.slot_index(now)), m.state.table.held_by_user, now=now,
                            **m.planning.options(now, m.planning.growable(now)))
        assert lease.id not in {g.lease_id for g in decision.grants}, (lease.id, lease.request, len(pending))

    @precondition(lambda self: bool(self.m.leases))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        lease = data.draw(st.sampled_from(sorted(self.m.leases.values(), key=lambda x: x.seq)))
        owner = next(u for u in USERS if u.user == lease.user)
        self.m.release(lease.id, owner)

    @precondition(lambda self: any(x.state in HOLDING for x in self.m.leases.values()))
    @rule(data=st.data())
    def activity(self, data: st.DataObject) -> None:
        lease = data.draw(st.sampled_from(sorted((x for x in self.m.leases.values() if x.state in HOLDING),
                                                 key=lambda x: x.seq)))
        self.m.heartbeat(lease.id, next(u for u in USERS if u.user == lease.user), active=True)

    @precondition(lambda self: any(x.state in HOLDING for x in self.m.leases.values()))
    @rule(data=st.data(), seconds=st.sampled_from([60, 1800, 3600]))
    def renew(self, data: st.DataObject, seconds: int) -> None:
        lease = data.draw(st.sampled_from(sorted((x for x in self.m.leases.values() if x.state in HOLDING),
                                                 key=lambda x: x.seq)))
        try:
            self.m.renew(lease.id, next(u for u in USERS if u.user == lease.user), seconds)
        except LeaseError as e:
            assert e.reason in ("max_duration", "quota", "reserved"), e.message

    @rule(seconds=st.sampled_from([1, 10, 30, 60, 300, 900, 1800]))
    def advance(self, seconds: int) -> None:
        self.clock.advance(seconds)
        self.m.tick()

    @rule(gpus=st.integers(1, 3), who=st.sampled_from(["u0", "u3", "@ml"]),
          offset=st.sampled_from([MAX_DURATION, MAX_DURATION + 600, 2 * MAX_DURATION]),
          length=st.sampled_from([600, 1800, MAX_WINDOW]))
    def reserve(self, gpus: int, who: str, offset: float, length: float) -> None:
        now = self.clock.now()
        body = {"gpus": gpus, "start": now + offset, "end": now + offset + length,
                **({"group": who[1:]} if who.startswith("@") else {"user": who})}
        try:
            self.m.reservations.create(ADMIN, body, self.m.clock.now())
        except LeaseError as e:
            assert e.reason == "reserved", e.message
        self.m.schedule()

    @precondition(lambda self: bool(self.m.reservations.live))
    @rule(data=st.data())
    def cancel_reservation(self, data: st.DataObject) -> None:
        r = data.draw(st.sampled_from(self.m.reservations.live))
        self.m.reservations.cancel(ADMIN, r.id, self.m.clock.now())
        self.m.schedule()

    # ------------------------------------------------------------------ invariants
    def holding(self) -> list:
        return [x for x in self.m.leases.values() if x.state in HOLDING]

    @invariant()
    def no_gpu_in_two_exclusive_leases_and_shared_within_limits(self) -> None:
        if not hasattr(self, "m"):
            return
        exclusive: dict[str, str] = {}
        shares: dict[str, list] = {}
        for lease in self.holding():
            for d in lease.devices:
                if lease.request.shared:
                    shares.setdefault(d, []).append(lease)
                else:
                    assert d not in exclusive, f"GPU {d} in {exclusive[d]} and {lease.id}"
                    exclusive[d] = lease.id
        mem = {g.id: g.memory_total for g in self.m.gpus}
        for d, leases in shares.items():
            assert d not in exclusive, f"shared lease on exclusively leased GPU {d}"
            assert sum(x.request.fraction for x in leases) <= self.policy.max_shares_per_gpu + EPS
            assert len(leases) <= self.policy.max_leases_per_shared_gpu
            used = sum(x.request.mem_bytes or int(x.request.fraction * mem[d]) for x in leases)
            assert used <= mem[d]

    @invariant()
    def gangs_all_or_nothing(self) -> None:
        if not hasattr(self, "m"):
            return
        node_of = {g.id: g.node for g in self.m.gpus}
        for lease in self.holding():
            req = lease.request
            if req.shared:
                assert len(lease.devices) == 1
                continue
            assert req.min_gpus <= len(lease.devices) <= req.max_gpus, (lease.id, lease.devices, req)
            assert len(set(lease.devices)) == len(lease.devices)
            if req.locality != "any":
                assert len({node_of[d] for d in lease.devices}) == 1, (lease.id, lease.devices)
        for lease in self.m.leases.values():
            if lease.state == LeaseState.QUEUED:
                assert not lease.devices

    @invariant()
    def devices_of_the_type_and_size_asked(self) -> None:
        if not hasattr(self, "m"):
            return
        aliases = self.policy.gpu_type_aliases()
        for lease in self.holding():
            for d in lease.devices:
                assert fits(self.m.gpu_by_id[d], lease.request, aliases), (lease.id, d, lease.request)

    @invariant()
    def quotas_never_violated(self) -> None:
        if not hasattr(self, "m"):
            return
        held: dict[str, float] = {}
        for lease in self.holding():
            held[lease.user] = held.get(lease.user, 0.0) + lease.gpu_count
        for user, n in held.items():
            assert n <= CAP + EPS, (user, n)
        h100 = sum(x.gpu_count / len(x.devices) for x in self.holding() if x.user == "u3" for d in x.devices
                   if self.m.gpu_by_id[d].name == "H100")  # a share of a GPU counts as its fraction
        assert h100 <= H100_CAP_U3 + EPS, h100
        assert held.get("u0", 0.0) + held.get("u1", 0.0) <= GROUP_CAP + EPS
        now = self.clock.now()
        cutoff = now - 86400
        used = 0.0
        for lease in iter_rows(self.m.store):
            if lease.user != "u2" or lease.granted_at is None:
                continue
            # charged: what it held up to its time limit (an ended lease that the clock's jump stopped late is
            # not the user's use), and the whole time limit of a running one
            for start, ended in held_stretches(self.m.store, lease):  # (time held before a suspension counts)
                if ended is not None:
                    end = min(ended, lease.expires_at or ended) if lease.suspensions == 0 else ended
                else:
                    end = max(lease.expires_at or now, now)
                used += lease.gpu_count * max(0.0, end - max(start, cutoff))
        assert used <= DAY_QUOTA_U2 * 3600 + EPS, used / 3600

    @invariant()
    def gpu_table_agrees_with_a_rebuild(self) -> None:
        """Every change goes through the manager's commit, which keeps the GPU table in step with the leases."""
        if not hasattr(self, "m"):
            return
        diffs = table_diffs(self.m.state.table, self.m.leases.values(), self.m.gpus)
        assert not diffs, "GPU table out of step with the leases: " + "; ".join(diffs[:5])

    @invariant()
    def reservations_never_violated(self) -> None:
        if not hasattr(self, "m"):
            return
        now = self.clock.now()
        live = [r for r in self.m.reservations.live if r.start <= now < r.end]
        if not live:
            return
        members = {r.id: self.m.reservations.members(r, [u.user for u in USERS]) for r in live}
        everyone = frozenset().union(*members.values())
        others = set()
        for lease in self.holding():
            if lease.user not in everyone:
                others.update(lease.devices)
        # GPUs held by users of no open reservation leave enough for every open reservation
        assert len(self.m.gpus) - len(others) >= sum(r.gpus for r in live), (others, live)

    @invariant()
    def head_wait_bounded(self) -> None:
        """The request at the head of the queue starts within a bound that arriving requests cannot stretch:
        the leases running when it arrived end within the longest time limit, a preemption takes GRACE, and
        only reservations (booked by an admin) may hold GPUs longer: each blocks a request from the longest
        time limit before its start to its end. SLACK: the clock's largest jump between two ticks."""
        if not hasattr(self, "m"):
            return
        now = self.clock.now()
        m = self.m
        head = [q.lease_id for q in m.state.queue][0] if [q.lease_id for q in m.state.queue] else None
        lease = m.leases.get(head) if head else None
        if lease is None or self._blocked_by_own_limits(lease):
            self.head_since = {}
            return
        since = self.head_since.setdefault(head, now)
        self.head_since = {head: since}
        reserved = 0.0
        for r in m.admin_store.reservations(since=0.0, include_cancelled=True):
            end = min(r.end, r.cancelled_at or r.end)
            if end > since and r.start - MAX_DURATION < now:
                reserved += end - max(r.start - MAX_DURATION, since)
        bound = MAX_DURATION + GRACE + reserved + SLACK
        if self.policy.small_first_gpus:  # smaller requests may go first until it has waited small_first_timeout
            bound += self.policy.small_first_timeout
        assert now - since <= bound, (head, now - since, bound, lease.request)

    def _blocked_by_own_limits(self, lease) -> bool:
        held: dict[str, float] = {}
        for x in self.holding():
            held[x.user] = held.get(x.user, 0.0) + x.gpu_count
        need = lease.request.fraction if lease.request.shared else lease.request.min_gpus
        if held.get(lease.user, 0.0) + need > CAP + EPS:
            return True
        if lease.user in ("u0", "u1") and held.get("u0", 0.0) + held.get("u1", 0.0) + need > GROUP_CAP + EPS:
            return True
        if lease.user == "u3" and lease.request.gpu_type == "H100":  # its own per-type cap
            h100 = sum(x.gpu_count / len(x.devices) for x in self.holding() if x.user == "u3" for d in x.devices
                       if self.m.gpu_by_id[d].name == "H100")
            if h100 + need > H100_CAP_U3 + EPS:
                return True
        return lease.user == "u2"  # its daily quota may hold it for up to a day

    @invariant()
    def count_steps(self) -> None:
        SchedulerMachine.steps += 1


SchedulerMachine.steps = 0
# 10,000 random steps at least (checked below): 120 runs of up to 150 steps; about a minute on a laptop.
def run_machine(machine: type[SchedulerMachine], examples: int, steps: int, at_least: int) -> None:
    """Run ``machine`` for ``examples`` runs of up to ``steps`` steps; at least ``at_least`` steps must run."""
    SchedulerMachine.steps = 0
    run_state_machine_as_test(machine, settings=settings(
        max_examples=examples, stateful_step_count=steps, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
    assert SchedulerMachine.steps >= at_least, f"only {SchedulerMachine.steps} steps ran"


def test_scheduler_machine() -> None:
    run_machine(SchedulerMachine, examples=120, steps=150, at_least=10_000)


DEEP = 2000  # requests queued before the machine starts: the event path must not depend on them


class DeepQueueMachine(SchedulerMachine):
    """The same machine with thousands of requests queued behind the others (low priority, a shape that waits
    for its user's cap): every invariant holds, and a request that can start still starts in its own event."""

    @initialize(nodes=st.sampled_from([1, 2, "1x4:A100-40GB,1x2:H100"]))
    def start(self, nodes: int | str) -> None:
        super().start(nodes)
        self.policy.max_queued_per_user = 0  # (its default cap, 1000, is below DEEP)
        for _ in range(DEEP):
            self.m.request(USERS[3], {"gpus": "3", "locality": "any", "priority": "low", "duration_seconds": 3600})
        assert len(self.m.state.queue) >= DEEP - 2


def test_scheduler_machine_with_a_deep_queue() -> None:
    run_machine(DeepQueueMachine, examples=8, steps=60, at_least=200)


SMALL_FIRST_TIMEOUT = 1800.0


class SmallFirstMachine(SchedulerMachine):
    """The same machine with small requests first (``small_first_gpus``): every invariant holds, and the head's
    wait stays bounded, by ``small_first_timeout`` more: a gang passed over by one-GPU requests is never starved."""

    @initialize(nodes=st.sampled_from([1, 2, "1x4:A100-40GB,1x2:H100"]))
    def start(self, nodes: int | str) -> None:
        super().start(nodes)
        self.policy.small_first_gpus = 2
        self.policy.small_first_timeout = SMALL_FIRST_TIMEOUT


def test_scheduler_machine_with_small_requests_first() -> None:
    run_machine(SmallFirstMachine, examples=40, steps=150, at_least=3000)


SUSPEND_MAX = 4 * MAX_DURATION  # suspend_max_seconds: a suspended lease ends at the latest then
MIN_RUNTIME = 60.0
MAX_SHARE = 0.5


class SuspendMachine(SchedulerMachine):
    """The same machine with preemption by suspension (``preempt_mode = "suspend"``) and suspendable requests: the
    broker asks leases to suspend (preemption, or by hand), their holders report (suspended, or could not), they
    resume (by hand, or when a preemption suspended them) and end. Every invariant of the machine holds, and: a
    suspended lease holds no GPU and no GPU is in two exclusive leases that are not suspended (the machine's own
    check counts the holding ones only); a resumed lease is on GPUs of the model it left; every suspended lease
    that wants its GPUs back resumes or ends; no lease is asked by a preemption before its minimum runtime, by a
    request of a lower class, or once its suspended share of its age passed ``suspend_max_share``."""

    SUSPENDABLE = True

    @initialize(nodes=st.sampled_from([1, 2, "1x4:A100-40GB,1x2:H100"]), asker=st.booleans(),
                keep=st.sampled_from(["off", "asker", "small"]), keep_max=st.sampled_from([0.0, 120.0]))
    def start(self, nodes: int | str, asker: bool = False, keep: str = "off", keep_max: float = 0.0) -> None:
        super().start(nodes)
        self.policy.suspend_keep_gpus = keep  # (a gang suspended for a request keeps its GPUs: holds.py)
        self.policy.suspend_keep_max_seconds = keep_max
        self.policy.preempt_mode = "suspend"
        self.policy.suspend_grant_asker = asker  # (the freed GPUs go to the request suspended for, first)
        self.policy.suspend_max_gpus = 2 if keep == "off" else 1  # (keeping: victims of 2 GPUs or more are gangs)
        self.policy.suspend_min_runtime_seconds = MIN_RUNTIME
        self.policy.suspend_max_share = MAX_SHARE
        self.policy.suspend_max_seconds = SUSPEND_MAX
        self.policy.suspend_report_seconds = 60.0
        self.model_of: dict[str, str] = {}  # suspended lease -> the model it left
        self.resume_since: dict[str, float] = {}  # suspended lease that wants its GPUs back -> since when

    def owner(self, lease) -> Identity:
        return next(u for u in USERS if u.user == lease.user)

    @precondition(lambda self: any(x.state in HOLDING and x.request.suspendable and x.suspension is None
                                   for x in self.m.leases.values()))
    @rule(data=st.data(), why=st.sampled_from(["user", "admin"]), resume=st.booleans())
    def ask(self, data: st.DataObject, why: str, resume: bool) -> None:
        lease = data.draw(st.sampled_from(sorted((x for x in self.m.leases.values() if x.state in HOLDING and
                                                  x.request.suspendable and x.suspension is None),
                                                 key=lambda x: x.seq)))
        assert self.m.ask_suspend(lease, why, resume=resume)
        self.m.schedule()

    @precondition(lambda self: any(x.suspension is not None and not x.suspension.suspended
                                   for x in self.m.leases.values()))
    @rule(data=st.data(), ok=st.sampled_from([True, True, True, False]))
    def report(self, data: st.DataObject, ok: bool) -> None:
        lease = data.draw(st.sampled_from(sorted((x for x in self.m.leases.values() if x.suspension is not None
                                                  and not x.suspension.suspended), key=lambda x: x.seq)))
        self._report(lease, ok)

    @rule(seconds=st.sampled_from([1, 10, 60, 300, 900]), ok=st.sampled_from([True, True, False]))
    def holders_report_then_time_passes(self, seconds: int, ok: bool) -> None:
        """Every asked holder reports (as a kernel does within a second of the ask), then time passes."""
        for lease in sorted(self.m.leases.values(), key=lambda x: x.seq):
            if lease.suspension is not None and not lease.suspension.suspended and lease.state in HOLDING:
                self._report(lease, ok)
        self.advance(seconds)

    def _report(self, lease, ok: bool) -> None:
        model = self.m.gpu_by_id[lease.devices[0]].name if lease.devices else ""
        self.m.suspended(lease.id, self.owner(lease), {"ok": True, "how": "stop"} if ok else
                         {"ok": False, "why": "a process could not be checkpointed"})
        if lease.state == LeaseState.SUSPENDED:
            self.model_of[lease.id] = model
        self.m.schedule()

    @precondition(lambda self: self.policy.suspend_keep_gpus != "off")
    @rule(gang=st.sampled_from(USERS), cell=st.sampled_from(USERS), gpus=st.sampled_from(["2", "3", "4"]))
    def a_gang_then_a_cell(self, gang: Identity, cell: Identity, gpus: str) -> None:
        """A suspendable gang, then (past the minimum runtime) a short 1-GPU cell that may suspend it: what makes a
        gang keep its GPUs (``suspend_keep_gpus``), which the machine's random requests seldom line up."""
        for who, body in ((gang, {"gpus": gpus, "duration_seconds": 3600}), (cell, {"gpus": "1", "duration_seconds": 300})):
            try:
                lease, _ = self.m.request(who, {**body, "suspendable": True, "priority": "normal"})
            except LeaseError as e:
                assert e.status_code in (400, 403), e.message
                return
            if lease.state == LeaseState.QUEUED:
                self._could_not_start(lease)
            self.advance(MIN_RUNTIME)

    @precondition(lambda self: any(x.state == LeaseState.SUSPENDED and not x.suspension.resume
                                   for x in self.m.leases.values()))
    @rule(data=st.data())
    def resume(self, data: st.DataObject) -> None:
        lease = data.draw(st.sampled_from(sorted((x for x in self.m.leases.values() if x.state == LeaseState.SUSPENDED
                                                  and not x.suspension.resume), key=lambda x: x.seq)))
        self.m.resume(lease.id, self.owner(lease))

    @invariant()
    def a_suspended_lease_holds_no_gpu(self) -> None:
        if not hasattr(self, "m"):
            return
        for lease in self.m.leases.values():
            if lease.state == LeaseState.SUSPENDED:
                assert not lease.devices and lease.suspension is not None and lease.suspension.suspended, lease.id
                assert lease.id not in self.m.state.table.holding_by_user.get(lease.user, {}), lease.id
            elif lease.state in HOLDING and lease.id in self.model_of:  # resumed: on GPUs of the model it left
                assert {self.m.gpu_by_id[d].name for d in lease.devices} == {self.model_of[lease.id]}, lease.id
                del self.model_of[lease.id]

    @invariant()
    def every_suspended_lease_that_wants_its_gpus_resumes_or_ends(self) -> None:
        if not hasattr(self, "m"):
            return
        now = self.clock.now()
        wanting = {x.id for x in self.m.leases.values()
                   if x.state == LeaseState.SUSPENDED and x.suspension is not None and x.suspension.resume}
        self.resume_since = {lid: self.resume_since.get(lid, now) for lid in wanting}
        for lid, since in self.resume_since.items():
            assert now - since <= SUSPEND_MAX + SLACK, (lid, now - since)

    @invariant()
    def kept_gpus_are_lent_only_to_small_requests(self) -> None:
        """A GPU a suspended gang keeps (``suspend_keep_gpus``) is held by nobody, or by a request that may suspend
        others (the asker itself in 'asker' mode)."""
        if not hasattr(self, "m"):
            return
        kept = self.m.holds.kept()
        for lease in self.m.state.holding():
            keepers = {kept[d] for d in lease.devices if d in kept}
            for kid in keepers:
                assert self.m.preemption.may_suspend(lease), (lease.id, kid)
                s = self.m.leases[kid].suspension
                if self.policy.suspend_keep_gpus == "asker":
                    assert s is not None and s.by_lease == lease.id, (lease.id, kid)

    @invariant()
    def preemption_asks_only_whom_it_may(self) -> None:
        """The starvation bound and the victim rules, checked on every pending ask of a preemption."""
        if not hasattr(self, "m"):
            return
        ranks = self.policy.priority_classes
        for lease in self.m.leases.values():
            s = lease.suspension
            if s is None or s.why != "preempted" or s.suspended:
                continue
            assert lease.request.suspendable
            if not s.by_lease:  # a gang that kept its GPUs takes them back from a borrower: no victim rule applies
                assert self.policy.suspend_keep_max_seconds and self.policy.suspend_keep_gpus != "off", lease.id
                continue
            assert s.asked_at - (lease.granted_at or 0.0) >= MIN_RUNTIME - EPS, (lease.id, s)
            assert lease.suspended_seconds <= MAX_SHARE * (s.asked_at - lease.created_at) + EPS, (lease.id, s)
            by = self.m.leases.get(s.by_lease)
            if by is not None:
                assert ranks.get(lease.request.priority, 0) <= ranks.get(by.request.priority, 0), (lease.id, by.id)


def test_scheduler_machine_with_suspension() -> None:
    run_machine(SuspendMachine, examples=60, steps=150, at_least=5000)
