"""Whose a name is (core.identity.Namespaces): the one table every identity mode follows, and the admin check
that reads it (api.auth.Admins)."""

from __future__ import annotations

import pytest

from lease_broker.api.auth import Admins
from lease_broker.core.identity import Namespaces


@pytest.mark.parametrize(("mode", "mapped", "owner_of_hub_alice", "hub_of", "unix_of"), [
    # mode, hub_users_are_unix_users, Hub alice's owner name, {owner: Hub name}, {owner: Unix name}
    ("unix", False, "alice", {"alice": None}, {"alice": "alice"}),
    ("hub", False, "alice", {"alice": "alice"}, {"alice": None}),
    ("hub", True, "alice", {"alice": "alice"}, {"alice": "alice"}),
    ("unix+hub", False, "hub:alice", {"alice": None, "hub:alice": "alice"}, {"alice": "alice", "hub:alice": None}),
    ("unix+hub", True, "alice", {"alice": "alice"}, {"alice": "alice"}),
])
def test_each_mode_says_whose_a_name_is(mode: str, mapped: bool, owner_of_hub_alice: str,
                                        hub_of: dict[str, str | None], unix_of: dict[str, str | None]) -> None:
    ns = Namespaces.of(mode, mapped)
    assert ns.hub_owner("alice") == owner_of_hub_alice
    assert {owner: ns.hub_name(owner) for owner in hub_of} == hub_of
    assert {owner: ns.unix_name(owner) for owner in unix_of} == unix_of


def test_admin_lists_hold_one_kind_of_name() -> None:
    ns = Namespaces.of("unix+hub")
    admins = Admins(ns, users=["root", "ann"], groups=[], hub_users=["carol"], hub_groups=["gpu-admins"])
    assert admins("ann", -1) and admins("root", 0)
    assert not admins("hub:ann", -1, ()) and not admins("hub:root", -1, ())  # a Hub user named like a Unix admin
    assert admins("hub:carol", -1, ()) and not admins("carol", -1)  # and the other way round
    assert admins("hub:dave", -1, ("gpu-admins",)) and not admins("hub:dave", -1, ("ml-team",))
    mapped = Admins(Namespaces.of("unix+hub", True), users=["ann"])
    assert mapped("ann", -1, ())  # one person when an admin says so


@pytest.mark.attack
def test_a_hub_user_gets_no_unix_groups_of_the_unix_user_of_the_same_name() -> None:
    """Group limits, quotas and reservations by Unix group: a Hub user named 'root' is not in root's Unix groups
    (unless an admin mapped Hub users onto Unix users)."""
    from lease_broker.policy.lease_policy import LeasePolicy

    for mode, mapped, owner, has_root_group in (("unix", False, "root", True), ("hub", False, "root", False),
                                                ("unix+hub", False, "hub:root", False),
                                                ("unix+hub", True, "root", True)):
        policy = LeasePolicy()
        policy.unix_user_of = Namespaces.of(mode, mapped).unix_name
        assert ("root" in policy.groups_of(owner)) is has_root_group, (mode, mapped, owner)
