"""Admin membership follows the host's group database (issue 30, item 8): a real Unix user in a real group named
in ``LeaseBroker.admin_groups`` is an admin; once removed from the group (``gpasswd -d``) they stop being one at
SIGHUP at once, and without SIGHUP within ``admin_cache_seconds``. Needs root (CI runs as root) to change groups."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator

import pytest
from users import as_user, second_user, unix_group  # noqa: F401  (fixture)
from waiting import wait_for

from jupyter_gpulease.client import BrokerClient

pytestmark = pytest.mark.attack  # each test is an attack that must fail (BENCHMARKS.md: Reliability)


@pytest.fixture
def admin_group(second_user) -> Iterator[str]:  # noqa: F811
    """A new Unix group with the second user in it (removed again afterwards)."""
    with unix_group("gl-adm-", second_user) as name:
        yield name


def _socket() -> str:
    d = tempfile.mkdtemp(prefix="gl-adm")
    os.chmod(d, 0o755)  # root's, entered by the second user
    return os.path.join(d, "b.sock")


def _is_admin(pw, url: str) -> bool:  # type: ignore[no-untyped-def]
    return bool(as_user(pw, lambda: BrokerClient(url).info()["user"]["admin"]))


def _leave(user: str, group: str) -> None:
    subprocess.run(["gpasswd", "-d", user, group], check=True, capture_output=True)


def test_a_member_removed_from_an_admin_group_is_no_admin_after_sighup(broker_factory, second_user,  # noqa: F811
                                                                        admin_group: str) -> None:
    broker = broker_factory(socket_path=_socket(), args=[
        f"--LeaseBroker.admin_groups=['{admin_group}']", "--LeaseBroker.admin_cache_seconds=3600"])
    assert _is_admin(second_user, broker.url)
    _leave(second_user.pw_name, admin_group)
    assert _is_admin(second_user, broker.url)  # kept for admin_cache_seconds (an hour here) ...
    assert broker.proc is not None
    broker.proc.send_signal(signal.SIGHUP)  # ... unless the admin says the groups changed
    wait_for(lambda: not _is_admin(second_user, broker.url), 5, "the removed member to lose admin at SIGHUP")


def test_a_member_removed_from_an_admin_group_is_no_admin_within_admin_cache_seconds(
        broker_factory, second_user, admin_group: str) -> None:  # noqa: F811
    cache = 2.0
    broker = broker_factory(socket_path=_socket(), args=[
        f"--LeaseBroker.admin_groups=['{admin_group}']", f"--LeaseBroker.admin_cache_seconds={cache}"])
    assert _is_admin(second_user, broker.url)
    _leave(second_user.pw_name, admin_group)
    removed = time.monotonic()
    wait_for(lambda: not _is_admin(second_user, broker.url), cache + 3, "the removed member to lose admin")
    assert time.monotonic() - removed < cache + 3
