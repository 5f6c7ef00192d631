"""A second real Unix user for the tests that check what one user may do to another's leases (CI runs as root),
and running code as that user in a forked child."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

SECOND_USER = "gpulease-test"
THIRD_USER = "gpulease-test3"


def _user(name: str):
    """The real Unix user ``name``, created (no home, no shell) if missing."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create and switch to other Unix users (CI runs as root)")
    import pwd

    try:
        pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True)
    return pwd.getpwnam(name)


@pytest.fixture(scope="session")
def second_user():
    return _user(SECOND_USER)


@pytest.fixture(scope="session")
def third_user():
    """Another user again: the attacker when the second user is the victim."""
    return _user(THIRD_USER)



def switch_to(pw):
    """What a child runs to become ``pw`` (no supplementary groups)."""

    def switch() -> None:
        os.setgroups([])
        os.setgid(pw.pw_gid)
        os.setuid(pw.pw_uid)

    return switch


def as_user(pw, fn):
    """Run fn in a forked child that switched to another uid (a real second user); return its JSON result."""
    return in_child(fn, switch_to(pw))


def in_child(fn, prepare=lambda: None):
    """Run ``prepare()`` then fn in a forked child (changes to its privileges stay there); return fn's JSON result."""
    return join_child(*start_child(fn, prepare))


def start_child(fn, prepare=lambda: None, close=()):
    """Start ``prepare()`` then fn in a forked child, which first closes the descriptors ``close`` (those only the
    parent keeps): (pid, the pipe its JSON result comes on), for ``join_child``."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        code = 1
        try:
            for fd in (r, *close):
                os.close(fd)
            prepare()
            os.write(w, json.dumps(fn()).encode())
            code = 0
        except BaseException as e:  # report anything to the parent
            os.write(w, json.dumps({"error": repr(e)}).encode())
        finally:
            os._exit(code)
    os.close(w)
    return pid, r


def join_child(pid, r):
    """The JSON result of a child ``start_child`` started, once it exits (which must be with 0)."""
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    result = json.loads(data)
    assert os.waitstatus_to_exitcode(status) == 0, result
    return result


@contextmanager
def unix_group(prefix: str, member) -> Iterator[str]:
    """A new Unix group (``prefix`` and a random tail) with ``member`` (a passwd entry) in it, removed afterwards."""
    name = prefix + uuid.uuid4().hex[:8]
    subprocess.run(["groupadd", name], check=True)
    subprocess.run(["gpasswd", "-a", member.pw_name, name], check=True, capture_output=True)
    try:
        yield name
    finally:
        subprocess.run(["groupdel", name], check=False)
