"""The policy keeps what it resolved for a user (their groups, their limits) until its one invalidation,
``LeasePolicy.reload()``, which SIGHUP calls: a real Unix user removed from a real group named in
``group_limits`` loses that group's limit at SIGHUP, though the config did not change. Needs root (CI runs as root)
to change groups."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from users import as_user, second_user, unix_group  # noqa: F401  (fixture)
from waiting import wait_for

from jupyter_gpulease.client import BrokerClient, BrokerError


@pytest.fixture
def limited_group(second_user: Any) -> Iterator[str]:  # noqa: F811
    """A new Unix group with the second user in it (removed again afterwards)."""
    with unix_group("gl-lim-", second_user) as name:
        yield name


def _ask_two(url: str) -> Callable[[], str]:
    def ask() -> str:
        try:
            return BrokerClient(url).request_lease(gpus=2).state
        except BrokerError as e:
            return e.reason
    return ask


def test_a_member_removed_from_a_limited_group_loses_its_limit_at_sighup(
        broker_factory: Any, second_user: Any, limited_group: str) -> None:  # noqa: F811
    directory = tempfile.mkdtemp(prefix="gl-lim")
    os.chmod(directory, 0o755)  # root's, entered by the second user
    broker = broker_factory(socket_path=os.path.join(directory, "b.sock"), args=[
        f"--LeasePolicy.group_limits={{'{limited_group}': {{'max_gpus': 1}}}}"])
    assert as_user(second_user, _ask_two(broker.url)) == "quota"
    subprocess.run(["gpasswd", "-d", second_user.pw_name, limited_group], check=True, capture_output=True)
    broker.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: as_user(second_user, _ask_two(broker.url)) == "granted", 5,
             "the removed member to lose the group's limit at SIGHUP")
