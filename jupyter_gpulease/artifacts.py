"""Every lease gets an artifact directory: ``output.log`` (what streamed), ``meta.json``
(lease, devices, times, exit status, code hash) and whatever the cell wrote to
``$GPULEASE_ARTIFACTS``.

The root is a local (or shared, e.g. NFS) path by default, or any fsspec URL. For a
remote root the worker writes to a local staging directory that is uploaded when the
cell ends.

A lease's directory is its user's only: 0700, and everything in it 0600 once the lease ends (the cell's own files
too), so that another user cannot read what a cell printed (an ``API_KEY=...``) or saved. With
``GpuMagics.artifacts_group_readable`` the directory's group may read them (0750 and 0640); nobody else ever writes
them. The directory is made with ``private_dir``: one that another user made first is refused, never used.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
import stat
import sys
import tempfile
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec

from .worker.env import lease_dir


def default_root() -> str:
    """The artifact root when none is configured: ``$GPULEASE_ARTIFACT_ROOT``, else ``~/gpulease-artifacts``."""
    return os.environ.get("GPULEASE_ARTIFACT_ROOT") or os.path.join(os.path.expanduser("~"), "gpulease-artifacts")


def local_root(root: str) -> str | None:
    """The local directory of an artifact root (a path or file:// URL); None for remote fsspec URLs."""
    parsed = urllib.parse.urlparse(root)
    if parsed.scheme == "file":
        return os.path.expanduser(parsed.path)
    if parsed.scheme and len(parsed.scheme) > 1:  # s3://, gs://, ... (a one-letter scheme is a Windows drive)
        return None
    return os.path.abspath(os.path.expanduser(root))


class ArtifactDir:
    """The artifact directory of one lease, written while the cell runs.

    Nothing is created on the cell's way to its worker: the worker makes the directory before the cell's code runs
    (``$GPULEASE_ARTIFACTS``), ``output.log`` is opened at the first output, and :meth:`finish` (after the cell
    has answered) makes whatever is still missing.
    """

    def __init__(self, root: str, lease_id: str, group_readable: bool = False) -> None:
        self.root, self.lease_id = root, lease_id
        #: the directory's mode (the worker makes it so too: the job's ``artifacts_mode``), and its files'
        self.mode = 0o750 if group_readable else 0o700
        self.file_mode = self.mode & 0o640
        self.url = root.rstrip("/") + "/" + lease_id
        local = local_root(root)
        if local is not None:
            self.local = os.path.join(local, lease_id)
            self._staged = False
        else:
            # private as it is: mkdtemp makes a new directory of a random name, 0700, and never uses an existing one
            self.local = tempfile.mkdtemp(prefix=f"gpulease-{lease_id}-")
            self._staged = True
        self._log: Any = None  # output.log, once there is output (or at finish)
        self._closed = False

    def _make(self) -> None:
        if not self._staged:
            lease_dir(self.local, self.mode)

    def _open_log(self) -> Any:
        if self._log is None:
            self._make()
            fd = os.open(os.path.join(self.local, "output.log"),
                         os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, self.file_mode)
            self._log = open(fd, "a", encoding="utf-8")
        return self._log

    def log(self, text: str) -> None:
        if self._closed:
            return
        try:
            self._open_log().write(text)
        except OSError as e:  # the storage failed: the cell goes on (its output still shows); finish says it again
            self._closed = True
            print(f"gpulease: cannot write {self.local}/output.log ({e}); the cell's output is not saved there",
                  file=sys.stderr)

    def finish(self, meta: dict[str, Any]) -> None:
        """Close ``output.log``, make what the cell wrote the user's only (or its group's to read), and write
        ``meta.json`` last (whole, under its name at once)."""
        self._open_log().close()
        self._closed = True
        self._make()
        seal(self.local, self.mode)
        tmp = os.path.join(self.local, f".meta.json.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, self.file_mode)
        with open(fd, "w", encoding="utf-8") as f:
            os.fchmod(fd, self.file_mode)  # exactly, whatever the umask
            json.dump(meta, f, indent=1, default=str)
        os.replace(tmp, os.path.join(self.local, "meta.json"))
        if self._staged:
            upload(self.local, self.url)
            shutil.rmtree(self.local, ignore_errors=True)

    @property
    def display_path(self) -> str:
        return self.local if not self._staged else self.url


def upload(local: str, url: str) -> None:
    """Copy a finished lease directory to a remote root, ``meta.json`` last: a reader that finds ``meta.json``
    (:func:`load`) finds every other file too. (One recursive ``put`` goes in name order: ``meta.json`` before
    ``output.log``.)"""
    fs, path = fsspec.core.url_to_fs(url)
    path = path.rstrip("/")
    fs.makedirs(path, exist_ok=True)
    sources: list[str] = []
    targets: list[str] = []
    for parent, dirs, files in os.walk(local):
        rel = os.path.relpath(parent, local)
        there = path if rel == "." else path + "/" + rel.replace(os.sep, "/")
        for name in dirs:  # empty directories the cell made are kept too
            fs.makedirs(there + "/" + name, exist_ok=True)
        for name in files:
            if rel == "." and name == "meta.json":
                continue
            sources.append(os.path.join(parent, name))
            targets.append(there + "/" + name)
    if sources:
        fs.put(sources, targets)
    fs.put_file(os.path.join(local, "meta.json"), path + "/meta.json")


def seal(top: str, mode: int) -> None:
    """Everything under ``top`` (a lease's directory: what the cell wrote) the user's only, or with ``mode`` 0750 its
    group's to read too: the owner's bits kept, the group's at most read and search, nothing for others. Links are
    not followed."""
    group = bool(mode & 0o050)
    me = os.geteuid()
    for parent, dirs, files in os.walk(top):
        for name in (*dirs, *files):
            path = os.path.join(parent, name)
            try:
                st = os.lstat(path)
                if stat.S_ISLNK(st.st_mode) or st.st_uid != me:
                    continue
                own = st.st_mode & 0o700
                want = own | ((own & 0o500) >> 3 if group else 0)
                if stat.S_IMODE(st.st_mode) != want:
                    os.chmod(path, want)
            except OSError:  # gone meanwhile
                continue


@dataclass
class Artifact:
    """A lease's artifacts, loaded back: ``meta``, ``log``, ``files``, and ``open(name)``."""

    lease_id: str
    url: str
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def log(self) -> str:
        return self._fs_read("output.log")

    @property
    def files(self) -> list[str]:
        fs, path = fsspec.core.url_to_fs(self.url)
        return sorted(os.path.relpath(p, path) for p in fs.find(path))

    def open(self, name: str, mode: str = "rb") -> Any:
        fs, path = fsspec.core.url_to_fs(self.url)
        return fs.open(path.rstrip("/") + "/" + name, mode)

    def _fs_read(self, name: str) -> str:
        try:
            with self.open(name, "r") as f:
                return str(f.read())
        except FileNotFoundError:
            return ""

    def __repr__(self) -> str:
        when = self.meta.get("started_at")
        return f"<Artifact {self.lease_id} {self.url} status={self.meta.get('status')} started={when}>"


def load(lease_id: str, root: str | None = None) -> Artifact:
    """Load a lease's artifacts back (from any fsspec root)."""
    root = root or default_root()
    url = root.rstrip("/") + "/" + lease_id
    fs, path = fsspec.core.url_to_fs(url)
    try:
        with fs.open(path.rstrip("/") + "/meta.json", "r") as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"No artifacts for lease {lease_id} under {root}") from None
    return Artifact(lease_id, url, meta)


def recent(root: str | None = None, limit: int = 20) -> list[Artifact]:
    """The most recent artifact directories, newest first."""
    root = root or default_root()
    fs, path = fsspec.core.url_to_fs(root)
    try:
        entries = fs.ls(path, detail=True)
    except FileNotFoundError:
        return []
    out = []
    for e in entries:
        if e.get("type") != "directory":
            continue
        lease_id = Path(e["name"]).name
        try:
            out.append(load(lease_id, root))
        except (FileNotFoundError, ValueError):
            continue
    out.sort(key=lambda a: a.meta.get("started_at") or "", reverse=True)
    return out[:limit]


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")
