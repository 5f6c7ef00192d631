"""Private by construction: the one rule for the files a user keeps for itself and the paths it trusts.

Every writer and reader of per-user state (parked sessions, transfer buffers, the per-user socket directory,
artifacts) and every client that looks for a broker's socket goes through these functions:

- ``private_dir(path)`` makes a directory the effective user owns with mode 0700, or accepts an existing one only
  if it is a real directory (not a link), the user's own and closed to everyone else (as OpenSSH's StrictModes and
  systemd's per-user ``RuntimeDirectory``).
- ``create_private(path)`` creates a new file 0600 that did not exist (``O_EXCL``), without following a link.
- ``open_private(path)`` opens a file for reading without following a link, and only if ``fstat`` shows a regular
  file of the user's own that nobody else can write: what is read (above all what is unpickled) is what this user
  wrote.
- ``trusted_path(path)`` checks that ``path`` and every directory above it belong to the user or root and that no
  other user can replace them (not writable by group or others, unless sticky like ``/tmp``): a client checks a
  broker's socket so before it sends anything, and a broker its socket's and store's directories.

Each refusal is an ``UnsafePathError`` that names the path, what is wrong with it and what to do.
"""

from __future__ import annotations

import errno
import os
import stat

_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafePathError(OSError):
    """A path another user owns, can write or has replaced by a link: refused, with the fix in the message."""


def user_text(uid: int) -> str:
    """A uid as people read it: "alice (uid 1001)"."""
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (KeyError, ImportError):
        return f"uid {uid}"


def private_dir(path: str, mode: int = 0o700) -> str:
    """``path`` as a directory of the effective user's own, mode 0700: made if missing (its parent must exist),
    else accepted only if it is a directory (not a link) that the user owns and nobody else can use. Returns it.
    ``mode``: 0750 lets the directory's group read it (a lease's artifacts, when the admin says so); never
    writable by anyone but the user."""
    if mode & 0o022 or (mode & 0o700) != 0o700:
        raise ValueError(f"private_dir: mode {mode:o} would let others write or the user not use {path}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW)
    except OSError as e:
        raise UnsafePathError(e.errno, f"{path} is not a directory of yours ({e.strerror}): remove it, or choose "
                                       "another place") from e
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise UnsafePathError(f"{path} belongs to {user_text(st.st_uid)}, not to you: another user made it first. "
                                  "Remove it (as root or its owner) or choose another place")
        if stat.S_IMODE(st.st_mode) != mode:
            os.fchmod(fd, mode)  # ours: close it (an older version made it 0755, or the umask did)
    finally:
        os.close(fd)
    return path


def create_private(path: str, mode: int = 0o600) -> int:
    """A new file at ``path``, 0600, open for writing; never an existing file, never through a link. (``mode``:
    0640 for a group that may read it, as ``private_dir``'s.)"""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, mode & 0o640)


def open_private(path: str, flags: int = os.O_RDONLY) -> int:
    """``path`` opened without following a link, only if it is a regular file of the effective user's own that
    nobody else can write (else ``UnsafePathError``; a missing file is ``FileNotFoundError`` as usual)."""
    try:
        fd = os.open(path, flags | _NOFOLLOW)
    except OSError as e:
        if e.errno == errno.ELOOP:  # the last component is a link
            raise UnsafePathError(e.errno, f"{path} is a symbolic link, refused: remove it") from e
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(f"{path} is not a regular file, refused: remove it")
        if st.st_uid != os.geteuid():
            raise UnsafePathError(f"{path} belongs to {user_text(st.st_uid)}, not to you: refused (remove it)")
        if st.st_mode & 0o022:
            raise UnsafePathError(f"{path} can be written by other users (mode {stat.S_IMODE(st.st_mode):o}): "
                                  "refused (chmod go-w it or remove it)")
    except BaseException:
        os.close(fd)
        raise
    return fd


def trusted_path(path: str, owners: frozenset[int] | None = None, missing_ok: bool = False) -> None:
    """Refuse ``path`` unless it and every directory above it belong to one of ``owners`` (default: the effective
    user and root) and none can be changed by another user: not writable by group or others, except a sticky
    directory (``/tmp``, ``/dev/shm``), whose entries only their owners may rename or remove. ``path`` need not
    be a directory (a socket: its mode does not matter, only who owns it and the directories above it). The
    directory that holds ``path`` must not be writable by others even if sticky: nobody else may create the name
    before its owner does. ``missing_ok``: a ``path`` that does not exist yet (a file about to be made: a broker's
    socket or store) is checked through the directory that will hold it, which must exist."""
    allowed = owners if owners is not None else frozenset({os.geteuid(), 0})
    path = os.path.abspath(path)
    current = path
    if missing_ok and not os.path.lexists(path):
        current = os.path.dirname(path)
    while True:
        st = os.lstat(current)
        if stat.S_ISLNK(st.st_mode):
            target = os.path.realpath(current)
            trusted_path(target, allowed)  # a link in the path is as trusted as where it leads (and its directory)
            st = os.lstat(target)
        if st.st_uid not in allowed:
            raise UnsafePathError(f"{current} belongs to {user_text(st.st_uid)}, who could answer in your place "
                                  f"(needed for {path}): remove it or choose a path you or root own")
        if current != path or stat.S_ISDIR(st.st_mode):
            writable = st.st_mode & 0o022
            holder = current == os.path.dirname(path) or current == path
            if writable and (holder or not st.st_mode & stat.S_ISVTX):
                raise UnsafePathError(f"{current} can be written by other users (mode {stat.S_IMODE(st.st_mode):o}),"
                                      f" who could replace {path}: chmod go-w {current} or choose another path")
        parent = os.path.dirname(current)
        if parent == current:
            return
        current = parent
