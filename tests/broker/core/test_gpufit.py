"""GPU types, memory sizes and MIG devices: the fit rule (core.gpufit) table by table, and the scheduler placing
requests of a type or size on a mixed cluster (gangs, backfill reservations, shares, growth)."""

from __future__ import annotations

import pytest

from lease_broker.core.gpu import GPU
from lease_broker.core.gpufit import aliases_of, beyond_caps, device_kinds, matches_type, unplaceable
from lease_broker.core.lease import LeaseRequest
from lease_broker.core.scheduler import Growing, Pending, SchedulerPolicy, Slot, schedule

NOW = 1000.0
G = 1 << 30
H100, A100_40, A100_80 = "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB", "NVIDIA A100-SXM4-80GB"
MIG_1G = f"{A100_80} MIG 1g.10gb"
ALIASES = aliases_of({"A100-40GB": ["NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB"], "big": ["*80GB*"]})


@pytest.mark.parametrize("name, mig, wanted, want", [
    (H100, False, "H100", True), (H100, False, "h100", True), (H100, False, "H100 80GB HBM3", True),
    (H100, False, H100, True), (H100, False, "H10", False), (H100, False, "A100", False),
    (A100_40, False, "A100", True), (A100_40, False, "A100-40GB", True),  # configured alias
    (A100_80, False, "A100-40GB", False), (A100_80, False, "big", True), (H100, False, "big", True),
    (A100_40, False, "big", False), ("A100-40GB", False, "A100-40GB", True),  # a simulated GPU's own name
    (MIG_1G, True, "1g.10gb", True), (MIG_1G, True, "MIG", True), (MIG_1G, True, MIG_1G, True),
    (MIG_1G, True, "A100", False),  # a GPU's model asks for a whole GPU, not a slice of one
    (MIG_1G, True, "2g.20gb", False), (H100, False, "MIG", False),
])
def test_type_names(name: str, mig: bool, wanted: str, want: bool) -> None:
    assert matches_type(name, mig, wanted, ALIASES) is want


# ---------------------------------------------------------------------- refusing what can never be granted
MIXED = [GPU(f"h{i}", i, "n1", H100, 80 * G) for i in range(4)] + \
        [GPU(f"a{i}", i, "n2", A100_40, 40 * G) for i in range(2)] + \
        [GPU(f"m{i}", 2, "n2", MIG_1G, 10 * G, mig=True, parent="a2") for i in range(3)]


@pytest.mark.parametrize("request_, why", [
    (LeaseRequest(gpu_type="H100"), None),
    (LeaseRequest(min_gpus=4, max_gpus=4, gpu_type="H100"), None),
    (LeaseRequest(gpu_mem=40 * G), None),
    (LeaseRequest(min_gpus=2, max_gpus=2, gpu_type="A100"), None),
    (LeaseRequest(gpu_type="1g.10gb"), None),
    (LeaseRequest(fraction=0.5, gpu_type="MIG"), None),  # a share of one MIG device
    (LeaseRequest(gpu_type="V100"), "this broker has 4x NVIDIA H100 80GB HBM3 (80G), 2x NVIDIA A100-SXM4-40GB "
                                    "(40G), 3x NVIDIA A100-SXM4-80GB MIG 1g.10gb (10G, MIG)"),
    (LeaseRequest(gpu_mem=96 * G), "a GPU with at least 96G can never be granted: this broker has"),
    (LeaseRequest(min_gpus=5, max_gpus=5, gpu_type="H100"), "at most 4 match on one node"),
    (LeaseRequest(min_gpus=3, max_gpus=3, gpu_mem=40 * G, locality="any"), None),
    (LeaseRequest(min_gpus=2, max_gpus=2, gpu_type="1g.10gb"), "only MIG devices match, and CUDA shows a "
                                                              "process only one MIG device; ask for 1"),
    (LeaseRequest(min_gpus=1, max_gpus=3, gpu_type="MIG"), "only MIG devices match"),
])
def test_unplaceable_names_what_exists(request_: LeaseRequest, why: str | None) -> None:
    got = unplaceable(request_, device_kinds(MIXED), ALIASES)
    assert (got is None) if why is None else (got is not None and why in got), got


@pytest.mark.parametrize("request_, caps, refused", [
    # 64G each on one node: only H100s match, and the user may hold 1: never (found by the stateful test)
    (LeaseRequest(min_gpus=2, max_gpus=2, gpu_mem=64 * G), {"H100": 1}, True),
    (LeaseRequest(min_gpus=2, max_gpus=2, gpu_mem=64 * G), {"H100": 2}, False),
    (LeaseRequest(min_gpus=2, max_gpus=2, gpu_mem=32 * G), {"H100": 1}, False),  # 2 A100s on n2
    (LeaseRequest(min_gpus=3, max_gpus=3, gpu_mem=32 * G, locality="any"), {"H100": 1}, False),  # 1 H100 + 2 A100
    (LeaseRequest(min_gpus=4, max_gpus=4, gpu_mem=32 * G, locality="any"), {"H100": 1}, True),
    (LeaseRequest(min_gpus=2, max_gpus=2), {}, False),
])
def test_a_request_only_capped_types_could_serve_is_refused(request_: LeaseRequest, caps: dict[str, float],
                                                           refused: bool) -> None:
    got = beyond_caps(request_, device_kinds(MIXED), ALIASES, caps)
    assert (got is not None) is refused, got
    if refused:
        assert got is not None and "max_gpus" in got and "1 H100" in got


# ---------------------------------------------------------------------- the scheduler on a mixed cluster
def mixed() -> list[Slot]:
    return [Slot(id=g.id, node=g.node, index=g.index, memory_total=g.memory_total, name=g.name, mig=g.mig,
                 link_group=f"{g.node}/{'mig' if g.mig else 'g'}") for g in MIXED]


def req(lid: str, n: int | str = 1, seq: int = 0, duration: float = 600, user: str = "u", **kw) -> Pending:
    lo, hi = (int(x) for x in n.split("-")) if isinstance(n, str) else (n, n)
    return Pending(lid, user, LeaseRequest(min_gpus=lo, max_gpus=hi, **kw), seq, duration)


def run(pending: list[Pending], s: list[Slot] | None = None, **kw) -> dict[str, tuple[str, ...]]:
    d = schedule(pending, s if s is not None else mixed(), {}, SchedulerPolicy(gpu_types=ALIASES), NOW, **kw)
    return {g.lease_id: g.gpu_ids for g in d.grants} | {g.lease_id: g.gpu_ids for g in d.grown}


@pytest.mark.parametrize("pending, want", [
    ([req("t", gpu_type="H100")], {"t": "h"}),
    ([req("t", gpu_type="A100-40GB")], {"t": "a"}),
    ([req("t", gpu_type="A100")], {"t": "a"}),  # the whole A100s, not the slices
    ([req("t", gpu_type="1g.10gb")], {"t": "m"}),
    ([req("t", gpu_mem=50 * G)], {"t": "h"}),
    ([req("t", 2, gpu_mem=20 * G)], {"t": "a"}),  # best fit: the node with the fewest left
    ([req("t", 3, gpu_mem=20 * G)], {"t": "h"}),  # n2 has 2 whole GPUs of 40G and slices: never slices
    ([req("t", 4, locality="any", gpu_type="A100")], {}),  # only 2 A100s anywhere
    ([req("t", "1-8", gpu_type="H100")], {"t": "h"}),
    ([req("t", fraction=0.5, gpu_type="MIG")], {"t": "m"}),
])
def test_placements_follow_type_and_memory(pending: list[Pending], want: dict[str, str]) -> None:
    got = run(pending)
    assert {k: {d[0] for d in v} for k, v in got.items()} == {k: {v} for k, v in want.items()}
    if "t" in got and pending[0].request.min_gpus == pending[0].request.max_gpus:
        assert len(got["t"]) == pending[0].request.min_gpus


def test_gangs_never_get_mig_devices_even_without_a_type() -> None:
    s = [x for x in mixed() if x.node == "n2"]  # 2 whole A100s and 3 slices
    assert run([req("gang", 3)], s) == {}
    got = run([req("two", 2), req("one", 1, seq=1)], s)
    assert set(got["two"]) == {"a0", "a1"} and got["one"][0].startswith("m")


def test_a_typed_request_waits_for_its_type_and_reserves_only_it() -> None:
    s = mixed()
    for x in s:
        if x.name == H100:
            x.exclusive, x.free_at = True, NOW + 100 + x.index  # all H100s busy, the first free at +100
    d = schedule([req("h", gpu_type="H100", seq=1), req("any", 1, seq=2, duration=50)], s, {},
                 SchedulerPolicy(gpu_types=ALIASES), NOW)
    assert [g.lease_id for g in d.grants] == ["any"]  # an untyped request takes what the H100 request cannot
    assert d.planned_start["h"] == NOW + 100  # planned on the H100 that frees first, not on an idle A100


def test_same_shape_different_type_is_still_tried() -> None:
    # the pass skips requests of a shape that found nothing: a different type is a different shape
    got = run([req("v", 2, seq=1, gpu_type="A100"), req("x", 2, seq=2, gpu_type="A100"),
               req("h", 2, seq=3, gpu_type="H100")])
    assert set(got) == {"v", "h"}


def test_an_incremental_lease_grows_only_into_its_type() -> None:
    s = mixed()
    for x in s:
        if x.id == "h0":
            x.exclusive, x.free_at = True, NOW + 600
    g = Growing(req("grow", "1-8", locality="any", gpu_type="H100"), ("h0",), NOW + 600)
    got = run([], s, growing=[g])
    assert set(got["grow"]) == {"h1", "h2", "h3"}


# ---------------------------------------------------------------------- caps per GPU type
def test_a_per_type_cap_bounds_what_a_user_holds_of_that_type() -> None:
    pol = SchedulerPolicy(gpu_types=ALIASES, type_caps=lambda user: {"H100": 1} if user == "student" else {})
    s = mixed()
    s[0].exclusive, s[0].held_by = True, (("student", 1.0),)  # the student holds h0 already
    d = schedule([req("h", 1, seq=1, user="student", gpu_type="H100"), req("any", 1, seq=2, user="student"),
                  req("other", 2, seq=3, user="staff", gpu_type="H100")], s, {}, pol, NOW)
    got = {g.lease_id: g.gpu_ids for g in d.grants}
    assert "h" not in got  # a second H100 would pass the cap: it waits
    assert not got["any"][0].startswith("h")  # an untyped request of the student gets no H100 either
    assert len(got["other"]) == 2 and all(x.startswith("h") for x in got["other"])  # others are not capped
    s[0].exclusive, s[0].held_by = False, ()
    d = schedule([req("h", 1, seq=1, user="student", gpu_type="H100"), req("h2", 1, seq=2, user="student",
                                                                           gpu_type="H100")], s, {}, pol, NOW)
    assert [g.lease_id for g in d.grants] == ["h"]  # one in a pass: what the pass gave counts too


def test_per_type_caps_in_the_policy() -> None:
    from lease_broker.core.errors import Forbidden
    from lease_broker.policy.lease_policy import LeasePolicy

    pol = LeasePolicy(unix_groups=False, max_gpus_per_user=6, group_members={"students": ["ann"], "tas": ["ann"]},
                      group_limits={"students": {"max_gpus": {"H100": 1}}, "tas": {"max_gpus": {"H100": 2, "*": 3}}},
                      user_limits={"bob": {"max_gpus": {"A100": 2}}})
    assert pol.type_caps("ann") == {"H100": 2.0} and pol.user_cap("ann") == 3.0  # the most generous group
    assert pol.type_caps("bob") == {"A100": 2.0} and pol.user_cap("bob") == 6.0  # no '*': the default
    assert pol.type_caps("eve") == {} and pol.user_cap("eve") == 6.0
    with pytest.raises(Forbidden, match=r"Request for 3 H100 GPUs exceeds your limit of 2 H100 GPUs"):
        pol.apply("ann", LeaseRequest(min_gpus=3, max_gpus=3, gpu_type="h100"), 8)
    with pytest.raises(Exception, match=r"\['max_gpus'\]\['H100'\]=-1"):
        LeasePolicy(user_limits={"x": {"max_gpus": {"H100": -1}}})
