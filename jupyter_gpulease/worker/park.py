"""Parking a session worker's state in host memory, so that its lease can end without losing it.

When a ``%%gpu --session`` lease ends while the session waits for its next cell (idle revocation, a waiting
request's pressure, its time limit, a release), the worker pickles its namespace (tensors on a GPU to host
memory, marked to go back onto their device) into a file in host memory, writes a small manifest next to it and
exits: the GPU is free. The session's next cell gets a new lease and a new worker, which loads the namespace back
(``restore``) before the cell runs.

The manifest is written last (to a temporary name, then renamed): a worker killed while parking leaves no
manifest, and the session says its variables are gone, as without parking. The files are this user's only
(0600) and are removed once restored, or when the session is stopped or the kernel shuts down.

Private by construction: the state goes into a directory of the user's own, mode 0700 (``private_dir``: one that
another user made first is refused, not used), so nobody else can create a name there, and a manifest or buffer
file is unpickled only after ``open_private`` showed the user's own regular file that nobody else can write.
"""

from __future__ import annotations

import _pickle as pickle
import glob
import os
import sys
import time

from gpulease_protocol.private import UnsafePathError, create_private, open_private, private_dir
from gpulease_protocol.requests import format_size

from ..wire import transfer

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

#: names of a worker's namespace that are not the user's
_NOT_STATE = frozenset({"__builtins__", "__name__", "__gpulease_call__", "__doc__", "__loader__", "__spec__",
                        "__package__", "__annotations__"})


class RestoreError(Exception):
    """The parked state could not be loaded in the new worker (the cell does not run; the state stays parked)."""


class _Null:
    def write(self, data: Any) -> int:
        return len(data)


def _unpicklable(values: dict[str, Any]) -> dict[str, str]:
    """The names whose values cannot be pickled, and why (each pickled alone, big buffers not written)."""
    pickler = transfer._pickler_class(keep_devices=True)
    why = {}
    for name, value in values.items():
        try:
            pickler(_Null(), protocol=5, buffer_callback=lambda buf: False).dump(value)
        except Exception as e:
            why[name] = f"{type(e).__name__}: {e}"[:200]
    return why


def park(ns: dict[str, Any], directory: str, to: str) -> dict[str, Any]:
    """Pickle the user's names of ``ns`` (big buffers into a file in ``directory``) and write the manifest to
    ``to``. Names whose values cannot be pickled (an open file, a generator) are left out and named in
    ``dropped``. Returns the manifest's summary: names, dropped (name -> why), nbytes. The manifest's directory must
    be the user's own (made 0700 if missing; ``UnsafePathError`` if another user's)."""
    private_dir(os.path.dirname(to))
    values = {n: v for n, v in ns.items() if n not in _NOT_STATE}
    dropped: dict[str, str] = {}
    buffers = to + ".buf"  # named after the manifest: a worker killed while writing leaves nothing unnamed
    try:
        packed = transfer.dumps(values, directory, keep_devices=True, path=buffers)
    except OSError:
        raise  # the directory is full or gone: nothing to leave out
    except Exception:
        dropped = _unpicklable(values)
        for name in dropped:
            del values[name]
        packed = transfer.dumps(values, directory, keep_devices=True, path=buffers)
    summary = {"names": sorted(values), "dropped": dropped,
               "nbytes": len(packed["data"]) + sum(n for _, n in packed["spans"]), "at": time.time()}
    tmp = f"{to}.{os.getpid()}.tmp"
    try:
        with os.fdopen(create_private(tmp), "wb") as fh:
            pickle.dump({**summary, "packed": packed}, fh, protocol=5)
        os.replace(tmp, to)
    except BaseException:
        transfer.discard(packed)
        transfer.discard({"file": tmp})
        raise
    return summary


def read(to: str) -> dict[str, Any] | None:
    """The manifest a worker parked to ``to``, or None if there is none (never parked, or killed while parking).
    Unpickled only if it is the user's own regular file that nobody else can write, reached without a link: else
    ``UnsafePathError``, and nothing of it is loaded."""
    try:
        fh = os.fdopen(open_private(to), "rb")
    except FileNotFoundError:
        return None
    try:
        with fh:
            manifest: dict[str, Any] = pickle.load(fh)
    except (EOFError, pickle.UnpicklingError):
        return None
    return manifest


def discard(to: str) -> None:
    """Remove a parked state: its manifest, its buffer file, and what a worker killed while parking left."""
    for path in (to, to + ".buf", *glob.glob(glob.escape(to) + ".*.tmp")):
        transfer.discard({"file": path})


def restore(to: str) -> dict[str, Any]:
    """The parked namespace, loaded (tensors back onto their device); the files stay until the kernel removes them,
    so that a failed restore can be tried again on the next lease."""
    try:
        manifest = read(to)
    except UnsafePathError as e:
        raise RestoreError(f"the parked state was refused: {e}") from e
    if manifest is None:
        raise RestoreError(f"the parked state {to} is gone")
    t0 = time.monotonic()
    try:
        values: dict[str, Any] = transfer.loads(manifest["packed"], keep_file=True)
    except Exception as e:
        raise RestoreError(f"could not load the session's parked variables: {type(e).__name__}: {e}") from e
    n, size = len(values), manifest["nbytes"]
    what = f"{n} parked variable{'s' if n != 1 else ''} ({format_size(size)}) {'is' if n == 1 else 'are'}"
    sys.stdout.write(f"gpulease: the session's {what} back, in {time.monotonic() - t0:.2f} s\n")
    return values
