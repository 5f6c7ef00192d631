"""Admin policy rules, one table each, on a virtual clock and an in-memory store: fair share with decay, daily
GPU-hour quotas and group caps, reservations, preemption, incremental and shared limits, hot reload, usage."""

from __future__ import annotations

import pytest
from table_checks import table_diffs

from lease_broker.core.clock import VirtualClock
from lease_broker.core.errors import BadRequest, Forbidden, InvalidTransition
from lease_broker.core.fairshare import RunningUsage, decayed
from lease_broker.core.identity import Identity
from lease_broker.core.lease import LeaseRequest, LeaseState
from lease_broker.core.reservation_windows import Window
from lease_broker.core.scheduler import Pending, SchedulerPolicy, Slot, schedule
from lease_broker.inventory.simulated import SimulatedInventory
from lease_broker.manager.manager import LeaseManager
from lease_broker.policy.lease_policy import LeasePolicy
from lease_broker.store.lease_store import Store

ALICE = Identity("alice", uid=1001)
BOB = Identity("bob", uid=1002)
CAROL = Identity("carol", uid=1003)
DAVE = Identity("dave", uid=1004)
ADMIN = Identity("root", uid=0, admin=True)
HOUR = 3600.0


def make(gpus=4, nodes=1, db=":memory:", **policy):
    clock = VirtualClock()
    base = {"heartbeat_timeout": 1e9, "default_idle_timeout_seconds": 0, "unix_groups": False}
    pol = LeasePolicy(**{**base, **policy})
    m = LeaseManager(Store(db), SimulatedInventory(gpus=gpus, nodes=nodes), pol, clock=clock)
    m.restore()
    return m, clock


def held(m, user):
    return sum(len(x.devices) for x in m.leases.values() if x.user == user and x.state.holding)


# ------------------------------------------------------------------ fair share
@pytest.mark.parametrize(
    "gpus, start, end, now, half_life, want",
    [
        (1, 0, 100, 100, 0, 100),  # no decay: plain GPU-seconds
        (2, 0, 100, 100, 0, 200),
        (1, 0, 100, 100 + 1e9, 0, 100),  # no decay ever
        (1, 0, 1e-3, 1000, 1000, 0.5e-3),  # one half-life ago counts half
        (1, 0, 1e-3, 2000, 1000, 0.25e-3),
        (1, 50, 40, 100, 10, 0),  # empty interval
    ],
)
def test_decayed_usage(gpus, start, end, now, half_life, want):
    assert decayed(gpus, start, end, now, half_life) == pytest.approx(want, rel=1e-3)


@pytest.mark.parametrize("half_life", [0.0, 600.0, 86400.0])
def test_running_usage_sums_match_the_per_lease_formula(half_life):
    """The O(1) running usage (two sums per user) agrees with decayed() summed lease by lease, through starts,
    ends and a rebase, at several times."""
    import random

    rng = random.Random(7)
    r = RunningUsage(half_life)
    live: list[tuple[str, float, float]] = []
    t = 1.7e9
    for step in range(400):
        t += rng.uniform(0, 300)
        if live and rng.random() < 0.4:
            user, gpus, start = live.pop(rng.randrange(len(live)))
            r.add(user, gpus, start, sign=-1)
        else:
            lease = (rng.choice("abc"), rng.choice([0.25, 1.0, 2.0, 8.0]), t - rng.uniform(0, 50))
            live.append(lease)
            r.add(*lease)
        if r.needs_rebase(t) or step == 200:
            r.rebuild(half_life, live, t)
        for user in "abc":
            want = sum(decayed(g, s, t, t, half_life) for u, g, s in live if u == user)
            assert r.usage(user, t) == pytest.approx(want, rel=1e-9, abs=1e-6)


def test_fair_share_orders_light_user_first_and_survives_restart(tmp_path):
    db = str(tmp_path / "l.db")
    m, clock = make(gpus=1, db=db, fairshare_half_life_seconds=0)
    a, _ = m.request(ALICE, {"gpus": 1})
    clock.advance(HOUR)
    m.release(a.id, ALICE)
    # a restart: the usage comes back from the store's history
    m2 = LeaseManager(Store(db), SimulatedInventory(gpus=1), m.policy, clock=clock)
    m2.restore()
    assert m2.accounting.fairshare(clock.now())["alice"] == pytest.approx(HOUR)
    blocker, _ = m2.request(CAROL, {"gpus": 1})
    qa, _ = m2.request(ALICE, {"gpus": 1})  # alice arrives first but used an hour
    qb, _ = m2.request(BOB, {"gpus": 1})
    assert [q.lease_id for q in m2.state.queue] == [qb.id, qa.id]
    m2.release(blocker.id, CAROL)
    assert qb.state == LeaseState.GRANTED and qa.state == LeaseState.QUEUED


@pytest.mark.parametrize("weight_alice, first", [(1.0, "bob"), (10.0, "alice")])
def test_fair_share_weight(weight_alice, first):
    m, clock = make(gpus=1, fairshare_half_life_seconds=0, user_limits={"alice": {"fairshare_weight": weight_alice}})
    a, _ = m.request(ALICE, {"gpus": 1})
    clock.advance(100)
    m.release(a.id, ALICE)
    b, _ = m.request(BOB, {"gpus": 1})
    clock.advance(50)
    m.release(b.id, BOB)
    blocker, _ = m.request(CAROL, {"gpus": 1})
    qa, _ = m.request(ALICE, {"gpus": 1})
    qb, _ = m.request(BOB, {"gpus": 1})
    assert [q.lease_id for q in m.state.queue][0] == (qa.id if first == "alice" else qb.id)


def test_fair_share_decays():
    m, clock = make(gpus=1, fairshare_half_life_seconds=HOUR)
    a, _ = m.request(ALICE, {"gpus": 1})
    clock.advance(HOUR)
    m.release(a.id, ALICE)
    u0 = m.accounting.fairshare(clock.now())["alice"]
    clock.advance(HOUR)
    assert m.accounting.fairshare(clock.now())["alice"] == pytest.approx(u0 / 2, rel=1e-6)


def test_priority_beats_fair_share():
    m, clock = make(gpus=1, fairshare_half_life_seconds=0)
    a, _ = m.request(ALICE, {"gpus": 1})
    clock.advance(HOUR)
    m.release(a.id, ALICE)
    blocker, _ = m.request(CAROL, {"gpus": 1})
    qb, _ = m.request(BOB, {"gpus": 1, "priority": "low"})
    qa, _ = m.request(ALICE, {"gpus": 1, "priority": "high"})
    assert [q.lease_id for q in m.state.queue] == [qa.id, qb.id]


# ------------------------------------------------------------------ limits per user / group / default
@pytest.mark.parametrize(
    "policy, user, key, want",
    [
        ({}, "alice", "max_gpus", 0.0),
        ({"max_gpus_per_user": 2}, "alice", "max_gpus", 2),
        ({"max_gpus_per_user": 2, "user_max_gpus": {"alice": 3}}, "alice", "max_gpus", 3),
        ({"max_gpus_per_user": 2, "user_limits": {"alice": {"max_gpus": 5}}}, "alice", "max_gpus", 5),
        ({"max_gpus_per_user": 2, "group_limits": {"ml": {"max_gpus": 4}, "viz": {"max_gpus": 1}},
          "group_members": {"ml": ["alice"], "viz": ["alice"]}}, "alice", "max_gpus", 4),
        ({"group_limits": {"ml": {"max_duration_seconds": 60}}, "group_members": {"ml": ["alice"]}},
         "alice", "max_duration_seconds", 60),
        ({"group_limits": {"ml": {"max_duration_seconds": 60}}, "group_members": {"ml": ["alice"]}},
         "bob", "max_duration_seconds", 8 * HOUR),
        ({"allowed_priority_classes": ["low"]}, "bob", "priority_classes", ["low"]),
        ({}, "bob", "priority_classes", ["high", "low", "normal"]),
        ({"gpu_hours_per_day": 5, "user_limits": {"alice": {"gpu_hours_per_day": 0}}}, "alice", "gpu_hours_per_day", 0),
    ],
)
def test_limit_resolution(policy, user, key, want):
    pol = LeasePolicy(unix_groups=False, **policy)
    assert pol.limit(user, key) == want


@pytest.mark.parametrize(
    "policy, body, error, reason",
    [
        ({"allowed_priority_classes": ["low", "normal"]}, {"gpus": 1, "priority": "high"}, Forbidden,
         "priority_not_allowed"),
        ({"gpu_hours_per_day": 1}, {"gpus": 2, "duration_seconds": HOUR}, Forbidden, "quota"),
        ({"user_limits": {"alice": {"max_gpus": 1}}}, {"gpus": 2}, Forbidden, "quota"),
    ],
)
def test_request_refused_by_policy(policy, body, error, reason):
    m, _ = make(**policy)
    with pytest.raises(error) as e:
        m.request(ALICE, body)
    assert e.value.reason == reason


def test_user_default_and_max_duration_from_group():
    m, _ = make(group_members={"short": ["alice"]},
                group_limits={"short": {"default_duration_seconds": 60, "max_duration_seconds": 120}})
    a, _ = m.request(ALICE, {"gpus": 1})
    b, _ = m.request(ALICE, {"gpus": 1, "duration_seconds": 9999})
    c, _ = m.request(BOB, {"gpus": 1})
    assert (a.duration_seconds, b.duration_seconds, c.duration_seconds) == (60, 120, HOUR)


@pytest.mark.parametrize("bad", [
    {"user_limits": {"alice": {"max_gpu": 1}}},
    {"user_limits": {"alice": {"max_gpus": -1}}},
    {"group_quotas": {"ml": {"max_duration_seconds": 1}}},
    {"fairshare_weight": 0},
    {"preempt_grace_seconds": {"high": -5}},
])
def test_invalid_limits_are_refused_naming_the_field(bad):
    with pytest.raises(Exception) as e:
        LeasePolicy(**bad)
    assert list(bad)[0] in str(e.value)


# ------------------------------------------------------------------ quotas
def test_daily_gpu_hours_quota_waits_then_frees_after_24h():
    m, clock = make(gpu_hours_per_day=2)
    a, _ = m.request(ALICE, {"gpus": 2, "duration_seconds": HOUR})  # 2 GPU-hours committed
    assert a.state == LeaseState.GRANTED
    b, _ = m.request(ALICE, {"gpus": 1, "duration_seconds": 600})
    assert b.state == LeaseState.QUEUED  # would exceed the day's 2 GPU-hours
    c, _ = m.request(BOB, {"gpus": 1, "duration_seconds": HOUR})
    assert c.state == LeaseState.GRANTED  # others are not held up
    clock.advance(1800)
    m.release(a.id, ALICE)  # used 1 GPU-hour only: room again
    assert b.state == LeaseState.GRANTED


def test_daily_quota_window_rolls():
    m, clock = make(gpu_hours_per_day=1)
    a, _ = m.request(ALICE, {"gpus": 1, "duration_seconds": HOUR})
    clock.advance(HOUR)
    m.tick()
    assert a.state == LeaseState.EXPIRED
    b, _ = m.request(ALICE, {"gpus": 1, "duration_seconds": HOUR})
    assert b.state == LeaseState.QUEUED
    clock.advance(24 * HOUR - 60)
    m.tick()
    assert b.state == LeaseState.QUEUED  # part of a's hour is still in the last 24 h
    clock.advance(61)
    m.tick()
    assert b.state == LeaseState.GRANTED


def test_group_quota_concurrent_and_gpu_hours():
    m, clock = make(gpus=8, group_members={"ml": ["alice", "bob"]}, group_quotas={"ml": {"max_gpus": 3}})
    a, _ = m.request(ALICE, {"gpus": 2})
    b, _ = m.request(BOB, {"gpus": 2})
    c, _ = m.request(CAROL, {"gpus": 2})
    assert a.state == LeaseState.GRANTED and b.state == LeaseState.QUEUED and c.state == LeaseState.GRANTED
    m.release(a.id, ALICE)
    assert b.state == LeaseState.GRANTED


def test_group_gpu_hours_quota():
    m, clock = make(group_members={"ml": ["alice", "bob"]}, group_quotas={"ml": {"gpu_hours_per_day": 2}})
    a, _ = m.request(ALICE, {"gpus": 1, "duration_seconds": 2 * HOUR})
    b, _ = m.request(BOB, {"gpus": 1, "duration_seconds": HOUR})
    assert a.state == LeaseState.GRANTED and b.state == LeaseState.QUEUED


# ------------------------------------------------------------------ backfill and starvation
def test_small_requests_backfill_only_if_they_end_before_the_gang():
    m, clock = make(gpus=4)
    x, _ = m.request(ALICE, {"gpus": 3, "duration_seconds": HOUR})
    gang, _ = m.request(BOB, {"gpus": 4, "duration_seconds": HOUR})
    short, _ = m.request(CAROL, {"gpus": 1, "duration_seconds": 600})
    long_, _ = m.request(CAROL, {"gpus": 1, "duration_seconds": 2 * HOUR})
    assert short.state == LeaseState.GRANTED and long_.state == LeaseState.QUEUED
    assert m.state.planned[gang.id] == pytest.approx(clock.now() + HOUR)


def test_head_gang_not_starved_by_a_stream_of_small_requests():
    m, clock = make(gpus=4)
    first = [m.request(ALICE, {"gpus": 1, "duration_seconds": 600})[0] for _ in range(4)]
    gang, _ = m.request(BOB, {"gpus": 4, "duration_seconds": 600})
    for step in range(50):  # noqa: B007 (read after the loop) a small request arrives every minute, each longer than what is left
        clock.advance(60)
        m.request(CAROL, {"gpus": 1, "duration_seconds": 1200})
        m.tick()
        if gang.state == LeaseState.GRANTED:
            break
    assert gang.state == LeaseState.GRANTED and step <= 10
    assert all(f.state == LeaseState.EXPIRED for f in first)


# ------------------------------------------------------------------ reservations
def test_reservation_blocks_others_and_serves_members():
    m, clock = make(gpus=4)
    now = clock.now()
    r = m_reserve(m, gpus=3, user="alice", start=now + HOUR, end=now + 3 * HOUR)
    long_, _ = m.request(BOB, {"gpus": 2, "duration_seconds": 2 * HOUR})
    assert long_.state == LeaseState.QUEUED  # would overlap the window on the reserved GPUs
    short, _ = m.request(BOB, {"gpus": 2, "duration_seconds": 1800})
    assert short.state == LeaseState.GRANTED
    one, _ = m.request(CAROL, {"gpus": 1, "duration_seconds": 5 * HOUR})
    assert one.state == LeaseState.QUEUED  # the unreserved GPU is planned for bob's gang at the window's end
    m.release(one.id, CAROL)
    one, _ = m.request(CAROL, {"gpus": 1, "duration_seconds": 2.5 * HOUR})
    assert one.state == LeaseState.GRANTED  # ends before bob's gang can start
    clock.advance(HOUR)
    m.tick()
    assert short.state == LeaseState.EXPIRED
    views = m.gpu_views(ADMIN)
    assert sorted(v["state"] for v in views) == ["leased", "reserved", "reserved", "reserved"]
    assert m.summary()["states"]["reserved"] == 3
    assert long_.state == LeaseState.QUEUED
    a, _ = m.request(ALICE, {"gpus": 3, "duration_seconds": HOUR})
    assert a.state == LeaseState.GRANTED
    assert r.id


def m_reserve(m, who=ADMIN, **body):

    return m.reservations.create(who, body, m.clock.now())


def test_reservation_validation():
    m, clock = make(gpus=4, user_reservation_max_gpus=1)
    now = clock.now()
    with pytest.raises(BadRequest):
        m_reserve(m, gpus=5, user="alice", start=now, end=now + 10)
    with pytest.raises(BadRequest):
        m_reserve(m, gpus=1, user="alice", group="ml", start=now, end=now + 10)
    with pytest.raises(BadRequest):
        m_reserve(m, gpus=1, user="alice", start=now + 10, end=now + 5)
    m_reserve(m, gpus=3, user="alice", start=now, end=now + 100)
    with pytest.raises(InvalidTransition):
        m_reserve(m, gpus=2, user="bob", start=now + 50, end=now + 150)
    with pytest.raises(Forbidden):
        m_reserve(m, BOB, gpus=1, user="alice", start=now + 200, end=now + 300)
    with pytest.raises(Forbidden):
        m_reserve(m, BOB, gpus=2, user="bob", start=now + 200, end=now + 300)
    assert m_reserve(m, BOB, gpus=1, user="bob", start=now + 200, end=now + 300).created_by == "bob"


def test_group_reservation_and_cancel():

    m, clock = make(gpus=2, group_members={"ml": ["alice", "bob"]})
    now = clock.now()
    r = m_reserve(m, gpus=2, group="ml", start=now, end=now + HOUR)
    c, _ = m.request(CAROL, {"gpus": 1, "duration_seconds": 600})
    b, _ = m.request(BOB, {"gpus": 1, "duration_seconds": 600})
    assert c.state == LeaseState.QUEUED and b.state == LeaseState.GRANTED
    m.reservations.cancel(ADMIN, r.id, m.clock.now())
    m.schedule()
    assert c.state == LeaseState.GRANTED


# ------------------------------------------------------------------ preemption
def test_preemption_warns_then_revokes_with_reason_and_class():
    m, clock = make(gpus=2, preempt_grace_seconds={"high": 60})
    low, _ = m.request(ALICE, {"gpus": 2, "priority": "low"})
    hi, _ = m.request(BOB, {"gpus": 1, "priority": "high"})
    assert hi.state == LeaseState.QUEUED and low.state == LeaseState.GRANTED
    warned = [e for e in m.events.backlog if e["type"] == "lease.preempting"]
    assert warned and warned[0]["lease_id"] == low.id and warned[0]["grace_seconds"] == 60
    assert warned[0]["by_class"] == "high" and "by_user" not in warned[0]
    assert m.view(low)["preempting"]["by_class"] == "high"
    clock.advance(30)
    m.tick()
    assert low.state.holding
    clock.advance(31)
    m.tick()
    assert low.state == LeaseState.REVOKED and low.reason == "preempted"
    assert m.view(low)["preempted_by"] == {"priority": "high"}
    assert hi.state == LeaseState.GRANTED


@pytest.mark.parametrize("grace, preemptor, victim_class, preempted", [
    ({"high": 0}, "high", "low", True),
    ({"high": 0}, "high", "normal", True),
    ({"high": 0}, "high", "high", False),  # never the same class
    ({"high": 0}, "normal", "low", False),  # normal may not preempt
    ({}, "high", "low", False),
])
def test_preemption_rules(grace, preemptor, victim_class, preempted):
    m, clock = make(gpus=1, preempt_grace_seconds=grace)
    v, _ = m.request(ALICE, {"gpus": 1, "priority": victim_class})
    p, _ = m.request(BOB, {"gpus": 1, "priority": preemptor})
    assert (v.state == LeaseState.REVOKED) == preempted
    assert (p.state == LeaseState.GRANTED) == preempted


def test_preemption_cancelled_when_preemptor_leaves():
    m, clock = make(gpus=1, preempt_grace_seconds={"high": 60})
    v, _ = m.request(ALICE, {"gpus": 1, "priority": "low"})
    p, _ = m.request(BOB, {"gpus": 1, "priority": "high"})
    assert "preempting" in m.view(v)
    m.release(p.id, BOB)
    m.tick()
    assert "preempting" not in m.view(v)  # spared at the next pass
    assert [e["lease_id"] for e in m.events.backlog if e["type"] == "lease.preemption_cancelled"] == [v.id]
    clock.advance(120)
    m.tick()
    assert v.state.holding


# ------------------------------------------------------------------ shared and incremental
def test_shared_never_on_exclusive_and_within_limits():
    m, clock = make(gpus=2, max_shares_per_gpu=1.0, max_leases_per_shared_gpu=3)
    ex, _ = m.request(ALICE, {"gpus": 1})
    shared = [m.request(BOB, {"gpus": 0.3})[0] for _ in range(7)]
    granted = [s for s in shared if s.state == LeaseState.GRANTED]
    assert len(granted) == 3  # 3 x 0.3 on the one non-exclusive GPU
    assert all(s.devices[0] != ex.devices[0] for s in granted)


def test_incremental_gets_min_now():
    m, clock = make(gpus=4)
    a, _ = m.request(ALICE, {"gpus": 2})
    b, _ = m.request(BOB, {"gpus": "1-4"})
    assert b.state == LeaseState.GRANTED and len(b.devices) == 2


def test_incremental_grows_as_gpus_free_and_is_notified():
    m, clock = make(gpus=4)
    a, _ = m.request(ALICE, {"gpus": 3, "duration_seconds": 600})
    b, _ = m.request(BOB, {"gpus": "1-4", "duration_seconds": 900, "grow": True})
    assert len(b.devices) == 1
    first = list(b.devices)
    m.release(a.id, ALICE)
    assert len(b.devices) == 4 and b.devices[:1] == first  # what it had stays, in the same order
    assert m.view(b)["env"]["CUDA_VISIBLE_DEVICES"].count(",") == 3
    grown = [e for e in m.events.backlog if e["type"] == "lease" and e["change"] == "grown"]
    assert grown and grown[-1]["user"] == "bob" and len(grown[-1]["lease"]["devices"]) == 4
    assert m.store.get(b.id).devices == b.devices  # persisted


def test_a_range_without_grow_gets_what_is_free_at_its_grant_and_keeps_it():
    """A plain cell can use only the GPUs its process saw when it started: on an idle cluster a 1-4 gets all 4 at
    its grant; granted 2 (2 busy), it stays at 2 when the others free up. With grow it takes them."""
    m, clock = make(gpus=4)
    idle, _ = m.request(BOB, {"gpus": "1-4"})
    assert len(idle.devices) == 4
    m.release(idle.id, BOB)
    busy, _ = m.request(ALICE, {"gpus": 2, "duration_seconds": 600})
    plain, _ = m.request(BOB, {"gpus": "1-4", "duration_seconds": 900})
    assert len(plain.devices) == 2 and m.planning.growable(clock.now()) == []
    m.release(busy.id, ALICE)
    assert len(plain.devices) == 2
    assert not [e for e in m.events.backlog if e["type"] == "lease" and e["change"] == "grown"]
    assert sorted(g["state"] for g in m.gpu_views(ADMIN)).count("free") == 2
    m.release(plain.id, BOB)
    busy, _ = m.request(ALICE, {"gpus": 2, "duration_seconds": 600})
    growing, _ = m.request(BOB, {"gpus": "1-4", "duration_seconds": 900, "grow": True})
    assert len(growing.devices) == 2
    m.release(busy.id, ALICE)
    assert len(growing.devices) == 4
    assert table_diffs(m.state.table, m.leases.values(), m.gpus) == []


@pytest.mark.parametrize("case, want", [
    ("queued gang first", 2),  # a waiting request gets the freed GPUs before a lease grows
    ("user cap", 2),
    ("reservation", 2),
    ("free", 4),
])
def test_incremental_growth_rules(case, want):
    policy = {"max_gpus_per_user": 2} if case == "user cap" else {}
    m, clock = make(gpus=4, **policy)
    a, _ = m.request(ALICE, {"gpus": 2, "duration_seconds": 600})
    b, _ = m.request(BOB, {"gpus": "2-4", "duration_seconds": 3600, "grow": True})
    assert len(b.devices) == 2
    if case == "queued gang first":
        c, _ = m.request(CAROL, {"gpus": 2})
    if case == "reservation":
        m.reservations.create(ADMIN, {"gpus": 2, "user": "carol", "start": "+30m", "duration_seconds": 600}, m.clock.now())
    m.release(a.id, ALICE)
    assert len(b.devices) == want
    if case == "queued gang first":
        assert c.state == LeaseState.GRANTED


def test_incremental_growth_stays_on_its_node_unless_any():
    m, clock = make(gpus=4, nodes=2)  # 2 GPUs per node
    hold, _ = m.request(ALICE, {"gpus": 1})
    b, _ = m.request(BOB, {"gpus": "1-4", "grow": True})
    other = [g.node for g in m.gpus if g.id == b.devices[0]][0]
    assert len(b.devices) == 1 or all(m.gpu_by_id[d].node == other for d in b.devices)
    m.release(hold.id, ALICE)
    assert len(b.devices) == 2 and len({m.gpu_by_id[d].node for d in b.devices}) == 1
    c, _ = m.request(CAROL, {"gpus": "1-4", "locality": "any", "grow": True})
    assert c.state == LeaseState.GRANTED and len(c.devices) == 2
    m.release(b.id, BOB)
    assert len(c.devices) == 4 and len({m.gpu_by_id[d].node for d in c.devices}) == 2


# ------------------------------------------------------------------ hot reload, audit, usage
def test_update_policy_keeps_leases_audits_and_refuses_bad_values():
    m, clock = make(gpus=2, max_gpus_per_user=1)
    a, _ = m.request(ALICE, {"gpus": 1})
    b, _ = m.request(ALICE, {"gpus": 1})
    assert b.state == LeaseState.QUEUED
    diff = m.policy_admin.update("root", {"max_gpus_per_user": 2})
    assert diff == {"max_gpus_per_user": [1.0, 2.0]}
    assert a.state == LeaseState.GRANTED and b.state == LeaseState.GRANTED
    with pytest.raises(BadRequest) as e:
        m.policy_admin.update("root", {"term_timeout": -1})
    assert "term_timeout" in e.value.message and "-1" in e.value.message
    with pytest.raises(BadRequest) as e:
        m.policy_admin.update("root", {"no_such": 1})
    assert "no_such" in e.value.message
    audit = m.admin_store.audit_log()
    assert len(audit) == 1 and audit[0]["who"] == "root" and audit[0]["diff"] == {"max_gpus_per_user": [1.0, 2.0]}


def test_usage_report():
    m, clock = make(gpus=2)
    a, _ = m.request(ALICE, {"gpus": 2})
    m.heartbeat(a.id, ALICE, active=True)
    clock.advance(HOUR)
    m.release(a.id, ALICE)
    b, _ = m.request(BOB, {"gpus": 1})
    clock.advance(HOUR / 2)
    m.revoke(b.id, ADMIN, "maintenance")
    rows = {r["user"]: r for r in m.accounting.report(ADMIN, clock.now() - 7 * 86400, clock.now())}
    assert rows["alice"]["gpu_hours_held"] == pytest.approx(2.0)
    assert rows["alice"]["gpu_hours_busy"] == pytest.approx(2.0)
    assert rows["bob"]["gpu_hours_held"] == pytest.approx(0.5) and rows["bob"]["revocations"] == 1
    assert [r["user"] for r in m.accounting.report(BOB, 0, clock.now())] == ["bob"]


# ------------------------------------------------------------------ the pure scheduler's new inputs
def test_schedule_windows_and_budget_pure():
    slots = [Slot(id=f"g{i}", node="n", index=i) for i in range(2)]
    req = LeaseRequest(min_gpus=1, max_gpus=1)
    pend = [Pending("a", "alice", req, 1, 100.0), Pending("b", "bob", req, 2, 100.0)]
    w = Window("r", 1, 1000.0 + 50, 1000.0 + 500, frozenset({"carol"}))
    d = schedule(pend, slots, {}, SchedulerPolicy(), 1000.0, reservations=[w])
    assert [g.lease_id for g in d.grants] == ["a"]  # one GPU is reserved from t+50: a 100 s lease can't use it
    d = schedule(pend, slots, {}, SchedulerPolicy(), 1000.0, budget={"alice": 50.0})
    assert [g.lease_id for g in d.grants] == ["b"]


# ------------------------------------------------------------------ requests that could never start, renewals
@pytest.mark.parametrize("body, ok", [
    ({"gpus": 2}, True),
    ({"gpus": 3}, False),  # no node holds 3: it would wait forever
    ({"gpus": 3, "locality": "any"}, True),
    ({"gpus": "2-4"}, True),
])
def test_gangs_no_node_can_hold_are_refused(body, ok):
    m, clock = make(gpus=4, nodes=2)
    if ok:
        m.request(ALICE, body)
    else:
        with pytest.raises(BadRequest) as e:
            m.request(ALICE, body)
        assert e.value.reason == "too_large" and "largest node has 2" in e.value.message


@pytest.mark.parametrize("who, seconds, refused", [
    (ALICE, 1800, None),
    (ALICE, 3 * HOUR, "quota"),  # 1 GPU for 3 h more than her 2 GPU-h a day
    (BOB, 5 * HOUR, "reserved"),  # into carol's reservation of every GPU
    (CAROL, 5 * HOUR, None),  # a member of the reservation
])
def test_renewal_rules(who, seconds, refused):
    m, clock = make(gpus=2, user_limits={"alice": {"gpu_hours_per_day": 2}})
    lease, _ = m.request(who, {"gpus": 1, "duration_seconds": 600})
    other, _ = m.request(DAVE, {"gpus": 1, "duration_seconds": 600})
    m.reservations.create(ADMIN, {"gpus": 2, "user": "carol", "start": "+4h", "duration_seconds": 3600}, m.clock.now())
    if refused is None:
        m.renew(lease.id, who, seconds)
        assert lease.expires_at == pytest.approx(clock.now() + seconds)
    else:
        with pytest.raises(Forbidden) as e:
            m.renew(lease.id, who, seconds)
        assert e.value.reason == refused
    assert other.state.holding


def test_shared_leases_do_not_starve_the_head_on_a_shared_gpu():
    m, clock = make(gpus=1, max_shares_per_gpu=1.0)
    m.request(ALICE, {"gpus": 0.5, "duration_seconds": 600})
    head, _ = m.request(BOB, {"gpus": 1, "duration_seconds": 600})
    assert [q.lease_id for q in m.state.queue][0] == head.id and m.state.planned[head.id] == pytest.approx(clock.now() + 600)
    for _ in range(9):  # shares that would end after the head's planned start keep off its GPU
        s, _ = m.request(CAROL, {"gpus": 0.25, "duration_seconds": 1200})
        assert s.state == LeaseState.QUEUED
        clock.advance(60)
        m.tick()
    short, _ = m.request(DAVE, {"gpus": 0.25, "duration_seconds": 30})  # one that ends first may backfill
    assert short.state == LeaseState.GRANTED
    clock.advance(60)
    m.tick()
    assert head.state == LeaseState.GRANTED


def test_incremental_growth_within_the_daily_quota():
    m, clock = make(gpus=4, user_limits={"bob": {"gpu_hours_per_day": 2}})
    a, _ = m.request(ALICE, {"gpus": 3, "duration_seconds": 600})
    b, _ = m.request(BOB, {"gpus": "1-4", "duration_seconds": HOUR, "grow": True})
    m.release(a.id, ALICE)
    assert len(b.devices) == 2  # 1 h x 2 GPUs is all of bob's 2 GPU-hours


def test_no_preemption_for_a_request_that_a_reservation_blocks():
    m, clock = make(gpus=2, preempt_grace_seconds={"high": 0})
    low, _ = m.request(ALICE, {"gpus": 1, "priority": "low"})
    m.reservations.create(ADMIN, {"gpus": 1, "user": "carol", "start": "now", "duration_seconds": HOUR}, m.clock.now())
    hi, _ = m.request(BOB, {"gpus": 2, "priority": "high"})  # would need carol's reserved GPU too
    assert hi.state == LeaseState.QUEUED and low.state.holding


def test_a_full_pass_checks_the_queue_beyond_its_head_a_window_at_a_time():
    """A request deep in the queue that could start (behind requests of its shape held back by their user's cap)
    is found by the full passes' window (full_pass_depth), which goes on where the last one stopped."""
    m, clock = make(gpus=2, queue_depth=1, full_pass_depth=2, full_pass_seconds=10, backfill_depth=0,
                    user_limits={"capped": {"max_gpus": 1}})
    capped, other, free = Identity("capped", uid=3001), Identity("other", uid=3002), Identity("free", uid=3003)
    m.request(capped, {"gpus": 1})
    blocker, _ = m.request(other, {"gpus": 1})
    for _ in range(5):  # capped's, all of one shape: the first is the event pass's head, the next its shape head
        m.request(capped, {"gpus": 1, "priority": "high"})  # (ahead of deep whatever fair share says)
    deep, _ = m.request(free, {"gpus": 1})
    assert deep.state == LeaseState.QUEUED and m.state.queue.position(deep.id) == 6
    m.release(blocker.id, other)  # a GPU frees: the event pass sees capped's head and shape head only
    assert deep.state == LeaseState.QUEUED
    passes = 0
    while deep.state == LeaseState.QUEUED:
        clock.advance(10)
        m.tick()
        passes += 1
        assert passes <= 3, "the window should reach position 6 within (6 - 1) / 2 full passes"
    assert deep.state.holding and passes >= 2  # not the first window (places 2 and 3): it went on from there
