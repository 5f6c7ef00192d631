"""Private per-user state (issue 30, items 1 and 7), attacked by real other Unix users.

- A parked session lives in a 0700 directory of the victim's own (``/dev/shm/gpulease-<uid>``): a third user who
  watches with inotify and races to put a pickle of its own at the manifest's final name cannot even create a file
  there, and a directory the attacker made at that path first is refused, never used.
- Whatever is read back, above all what is unpickled (a manifest, a buffer file), is opened without following a
  link and only if ``fstat`` shows the reader's own regular file that nobody else can write.
- A lease's artifact directory is 0700 and its files 0600 (``GpuMagics.artifacts_group_readable``: 0750 and 0640),
  so another user cannot read a secret the cell printed; the sidebar's listing still works for the owner.
"""

from __future__ import annotations

import _pickle
import ctypes
import errno
import io
import os
import select
import shutil
import stat
import struct
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import cloudpickle  # noqa: F401  (loaded before the children fork: they run as users who may not read the venv's caches)
import numpy as np
import pytest
from kernels import Kernel
from users import as_user, join_child, second_user, start_child, switch_to, third_user  # noqa: F401  (fixtures)
from waiting import wait_for

from gpulease_protocol.private import UnsafePathError, private_dir
from jupyter_gpulease.kernel.sessions import park_dir, park_target
from jupyter_gpulease.serverext.artifacts import recent_artifacts
from jupyter_gpulease.wire import transfer
from jupyter_gpulease.worker import park

pytestmark = pytest.mark.attack

_IN_CREATE, _IN_MOVED_TO, _IN_ISDIR, _IN_CLOEXEC = 0x100, 0x80, 0x40000000, 0o2000000
_EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len (then the name)
_LOCAL = SimpleNamespace(local=True)  # a worker of this host, as park_dir sees one


class _Plant:
    """What the attacker puts where the victim's kernel looks for its manifest: unpickling it runs code (here:
    creates ``marker``)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return open, (self.marker, "w")


@pytest.fixture
def marker() -> Iterator[str]:
    """A path the attacker's pickle would create if any victim unpickled it (in a directory every user can write)."""
    d = tempfile.mkdtemp(prefix="gpulease-marker-", dir="/tmp")
    os.chmod(d, 0o1777)
    yield os.path.join(d, "attacker-code-ran")
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def victim_shm(second_user) -> Iterator[str]:  # noqa: F811
    """The victim's (the second user's) parking directory under /dev/shm, absent at the start and removed after."""
    path = os.path.join("/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir(),
                        f"gpulease-{second_user.pw_uid}")
    shutil.rmtree(path, ignore_errors=True)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _watch_and_plant(watched: str, victim_uid: int, payload: bytes, ready: int, stop: int) -> Callable[[], Any]:
    """The attacker: watch ``watched`` with inotify; when the victim starts writing a parked manifest under its
    temporary name, create the final name first with ``payload``; when a directory of the victim's appears, try to
    watch it and to create a file in it. Until ``stop`` is closed; returns what it managed and what it was refused."""

    def attack() -> dict[str, list[str]]:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.inotify_init1(_IN_CLOEXEC)
        assert fd >= 0, os.strerror(ctypes.get_errno())
        wds = {libc.inotify_add_watch(fd, watched.encode(), _IN_CREATE | _IN_MOVED_TO): watched}
        seen: dict[str, list[str]] = {"planted": [], "plant_refused": [], "watch_refused": [], "made_inside": [],
                                      "make_refused": []}
        os.write(ready, b"r")
        while True:
            readable, _, _ = select.select([fd, stop], [], [], 60)
            if fd not in readable:  # stopped (events read first, also when both are ready), or nothing for 60 s
                return seen
            data = os.read(fd, 65536)
            at = 0
            while at < len(data):
                wd, mask, _, n = _EVENT.unpack_from(data, at)
                name = data[at + _EVENT.size : at + _EVENT.size + n].rstrip(b"\0").decode()
                at += _EVENT.size + n
                path = os.path.join(wds.get(wd, watched), name)
                if mask & _IN_ISDIR and name == f"gpulease-{victim_uid}":  # the victim's own directory
                    inner = libc.inotify_add_watch(fd, path.encode(), _IN_CREATE | _IN_MOVED_TO)
                    if inner < 0:
                        seen["watch_refused"].append(errno.errorcode[ctypes.get_errno()])
                    else:
                        wds[inner] = path
                    try:
                        os.close(os.open(os.path.join(path, "gpulease-park-1-probe"), os.O_CREAT | os.O_WRONLY, 0o644))
                        seen["made_inside"].append(path)
                    except OSError as e:
                        seen["make_refused"].append(errno.errorcode[e.errno])
                elif name.startswith("gpulease-park-") and name.endswith(".tmp"):  # the victim writes its manifest
                    try:
                        if os.stat(path).st_uid != victim_uid:
                            continue  # someone else's (another test's): not this attack's
                    except OSError:
                        continue
                    final = path.rsplit(".", 2)[0]
                    try:
                        out = os.open(final, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                        os.write(out, payload)
                        os.close(out)
                        seen["planted"].append(final)
                    except OSError as e:
                        seen["plant_refused"].append(errno.errorcode[e.errno])

    return attack


def _park_and_restore() -> dict[str, Any]:
    """The victim: park a session's namespace where a worker of this host parks, then load it back, as the next
    cell's worker does (through the real ``worker.park`` functions and the kernel's choice of place)."""
    out: dict[str, Any] = {}
    try:
        target = park_target(park_dir(_LOCAL, None))  # type: ignore[arg-type]
    except OSError as e:
        return {"dir_error": str(e)}
    out["to"] = target["to"]
    # 32 MiB in band: the manifest takes a while to write, the window the race needs on the old layout
    ns = {"w": np.ones(1 << 18), "blob": b"x" * (32 << 20), "n": 5}
    try:
        park.park(ns, target["dir"], target["to"])
        out["parked"] = True
    except Exception as e:
        out["park_error"] = repr(e)
    try:
        back = park.restore(target["to"])
        out["restored"] = sorted(back)
    except Exception as e:
        out["restore_error"] = repr(e)
    try:
        park.discard(target["to"])
    except OSError as e:  # (the old layout: the attacker's file in /dev/shm is not the victim's to remove)
        out["discard_error"] = repr(e)
    return out


def _try_create(directory: str) -> Callable[[], str]:
    def create() -> str:
        try:
            os.close(os.open(os.path.join(directory, "gpulease-park-1-mine"), os.O_CREAT | os.O_WRONLY, 0o644))
            return "created"
        except OSError as e:
            return errno.errorcode[e.errno]

    return create


def test_an_inotify_race_for_the_parked_manifest_finds_nothing_it_can_write(second_user, third_user,  # noqa: F811
                                                                            marker, victim_shm) -> None:
    payload = _pickle.dumps(_Plant(marker), protocol=2)
    ready_r, ready_w = os.pipe()
    stop_r, stop_w = os.pipe()
    attacker = start_child(_watch_and_plant(os.path.dirname(victim_shm), second_user.pw_uid, payload, ready_w, stop_r),
                           switch_to(third_user), close=(ready_r, stop_w))
    os.close(ready_w)
    os.close(stop_r)
    try:
        assert select.select([ready_r], [], [], 30)[0] and os.read(ready_r, 1) == b"r", "the attacker's watch is up"
        victim = as_user(second_user, _park_and_restore)
    finally:
        os.close(stop_w)  # the attacker stops watching
        os.close(ready_r)
        seen = join_child(*attacker)
        for planted in seen.get("planted", []):  # (what the old layout let the attacker put there)
            os.unlink(planted)
    assert not os.path.exists(marker), f"the attacker's pickle ran as the victim: {victim} {seen}"
    assert victim.get("parked") and victim.get("restored") == ["blob", "n", "w"], victim
    assert seen["planted"] == [] and seen["made_inside"] == [], seen
    assert os.path.dirname(victim["to"]) == victim_shm
    assert stat.S_IMODE(os.stat(victim_shm).st_mode) == 0o700 and os.stat(victim_shm).st_uid == second_user.pw_uid
    assert seen["watch_refused"] == ["EACCES"] and seen["make_refused"] == ["EACCES"], seen
    assert as_user(third_user, _try_create(victim_shm)) == "EACCES"  # not even a file of its own there


def test_a_directory_the_attacker_made_at_the_victims_path_is_refused_not_used(second_user, third_user,  # noqa: F811
                                                                                marker, victim_shm) -> None:
    def squat() -> str:
        os.mkdir(victim_shm, 0o777)
        os.chmod(victim_shm, 0o777)
        return victim_shm

    as_user(third_user, squat)

    def victim() -> dict[str, Any]:
        out = _park_and_restore()
        try:  # a worker told to park there anyway (a kernel of an older version, say)
            park.park({"n": 5}, victim_shm, os.path.join(victim_shm, "gpulease-park-1-aa"))
            out["forced"] = "parked"
        except OSError as e:
            out["forced"] = str(e)
        return out

    out = as_user(second_user, victim)
    assert victim_shm in out["dir_error"] and third_user.pw_name in out["dir_error"], out
    assert victim_shm in out["forced"] and third_user.pw_name in out["forced"], out
    assert os.listdir(victim_shm) == [], "nothing of the victim's was written into the attacker's directory"


def _plant(path: Path, payload: bytes, owner: Any = None, mode: int = 0o600) -> None:
    path.write_bytes(payload)
    os.chmod(path, mode)
    if owner is not None:
        os.chown(path, owner.pw_uid, owner.pw_gid)


def test_a_manifest_or_buffer_file_that_is_not_the_readers_own_is_refused_before_unpickling(
        tmp_path: Path, third_user, marker) -> None:  # noqa: F811
    payload = _pickle.dumps(_Plant(marker), protocol=2)
    d = Path(private_dir(str(tmp_path / "park")))
    real = str(d / "gpulease-park-1-real")
    park.park({"w": np.ones(1 << 18), "n": 5}, str(d), real)  # a real parked state of this user's, with buffers

    theirs = d / "gpulease-park-1-theirs"
    _plant(theirs, payload, owner=third_user, mode=0o644)
    with pytest.raises(UnsafePathError, match=third_user.pw_name):
        park.read(str(theirs))
    with pytest.raises(park.RestoreError, match="belongs to"):
        park.restore(str(theirs))

    link = d / "gpulease-park-1-link"
    link.symlink_to(real)  # to a manifest that is fine in itself: the link is what is refused
    with pytest.raises(UnsafePathError, match="symbolic link"):
        park.read(str(link))

    loose = d / "gpulease-park-1-loose"
    _plant(loose, payload, mode=0o664)  # this user's own, but the group can write it
    with pytest.raises(UnsafePathError, match="written by other users"):
        park.read(str(loose))
    assert not os.path.exists(marker), "nothing was unpickled"

    packed = park.read(real)["packed"]  # type: ignore[index]
    os.chown(packed["file"], third_user.pw_uid, third_user.pw_gid)  # its buffers, now another user's file
    with pytest.raises(UnsafePathError, match=third_user.pw_name):
        transfer.loads(packed, keep_file=True)
    os.chown(packed["file"], os.geteuid(), os.getegid())
    assert park.restore(real)["n"] == 5  # the same files, this user's own again: loaded


@pytest.fixture
def shared_root() -> Iterator[Path]:
    """An artifact root other users can reach (0755, like a home directory or a shared disk)."""
    root = Path(tempfile.mkdtemp(prefix="gpulease-artifacts-", dir="/tmp"))
    os.chmod(root, 0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


CELL = ("%%gpu\nimport os\nd = os.environ['GPULEASE_ARTIFACTS']\nprint('API_KEY=s3cr3t')\n"
        "open(os.path.join(d, 'model.txt'), 'w').write('weights')\nos.makedirs(os.path.join(d, 'ckpt'))\n"
        "open(os.path.join(d, 'ckpt', 'step1.pt'), 'w').write('w')")


def _modes(d: Path) -> dict[str, int]:
    """The permission bits of the lease directory ('.') and of everything in it."""
    out = {".": stat.S_IMODE(os.lstat(d).st_mode)}
    for p in sorted(d.rglob("*")):
        out[str(p.relative_to(d))] = stat.S_IMODE(os.lstat(p).st_mode)
    return out


def _read_as(pw: Any, path: Path) -> Callable[[], str]:
    def read() -> str:
        try:
            return path.read_text()
        except OSError as e:
            return errno.errorcode[e.errno]

    return read


def test_a_cells_artifacts_are_the_users_own_and_group_readable_only_when_asked(
        broker, shared_root: Path, third_user) -> None:  # noqa: F811
    k = Kernel(broker.url, str(shared_root))
    try:
        leases = []
        for group_readable in (False, True):
            if group_readable:
                assert k.run("%config GpuMagics.artifacts_group_readable = True").status == "ok"
            r = k.run(CELL)
            assert r.status == "ok", r.outputs
            lease_id = r.stdout.split("gpulease: lease ")[1].split()[0]
            leases.append(lease_id)
            d = shared_root / lease_id
            wait_for(lambda d=d: (d / "meta.json").exists(), 10, "meta.json")  # written last, when the lease ended
            want_dir, want_file = (0o750, 0o640) if group_readable else (0o700, 0o600)
            assert _modes(d) == {".": want_dir, "ckpt": want_dir, "ckpt/step1.pt": want_file,
                                 "meta.json": want_file, "model.txt": want_file, "output.log": want_file}
            assert all(p.stat().st_uid == os.geteuid() for p in [d, *d.rglob("*")])
            assert "API_KEY=s3cr3t" in (d / "output.log").read_text()
            assert as_user(third_user, _read_as(third_user, d / "output.log")) == "EACCES"
        listed = recent_artifacts(str(shared_root), str(shared_root))["artifacts"]  # the sidebar, for the owner
        assert {a["lease_id"] for a in listed} == set(leases)
        assert all(a["meta"]["lease_id"] == a["lease_id"] and "model.txt" in a["files"] for a in listed)
    finally:
        k.stop()


def test_a_lease_directory_another_user_made_first_is_not_given_to_the_cell(shared_root: Path, third_user) -> None:  # noqa: F811
    """In a shared (sticky) artifact root another user makes the next lease's directory first: the worker refuses
    it, and the cell runs without ``$GPULEASE_ARTIFACTS`` rather than write its files there."""
    from users import in_child

    from jupyter_gpulease.worker import process

    os.chmod(shared_root, 0o1777)
    squatted = shared_root / "l-squatted"

    def squat() -> None:
        os.mkdir(squatted, 0o777)
        os.chmod(squatted, 0o777)

    as_user(third_user, squat)

    def prepare() -> dict[str, Any]:
        sys.stderr = io.StringIO()  # the cell's stderr, in a worker
        process._prepare({"env": {"GPULEASE_ARTIFACTS": str(squatted)}, "artifacts_mode": 0o700})
        return {"env": os.environ.get("GPULEASE_ARTIFACTS"), "said": sys.stderr.getvalue()}

    out = in_child(prepare)
    assert out["env"] is None and str(squatted) in out["said"] and third_user.pw_name in out["said"], out
    assert os.listdir(squatted) == []
