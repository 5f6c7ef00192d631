"""Every lease gets an artifact directory: ``output.log`` (what streamed), ``meta.json``
(lease, devices, times, exit status, code hash) and whatever the cell wrote to
``$GPULEASE_ARTIFACTS``.

The root is a local (or shared, e.g. NFS) path by default, or any fsspec URL. For a
remote root the worker writes to a local staging directory that is uploaded when the
cell ends.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
import sys
import tempfile
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec


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

    def __init__(self, root: str, lease_id: str) -> None:
        self.root, self.lease_id = root, lease_id
        self.url = root.rstrip("/") + "/" + lease_id
        local = local_root(root)
        if local is not None:
            self.local = os.path.join(local, lease_id)
            self._staged = False
        else:
            self.local = tempfile.mkdtemp(prefix=f"gpulease-{lease_id}-")
            self._staged = True
        self._log: Any = None  # output.log, once there is output (or at finish)
        self._closed = False

    def _open_log(self) -> Any:
        if self._log is None:
            os.makedirs(self.local, exist_ok=True)
            self._log = open(os.path.join(self.local, "output.log"), "a", encoding="utf-8")
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
        self._open_log().close()
        self._closed = True
        with open(os.path.join(self.local, "meta.json"), "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1, default=str)
        if self._staged:
            fs, path = fsspec.core.url_to_fs(self.url)
            fs.put(self.local.rstrip("/") + "/", path, recursive=True)
            shutil.rmtree(self.local, ignore_errors=True)

    @property
    def display_path(self) -> str:
        return self.local if not self._staged else self.url


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
