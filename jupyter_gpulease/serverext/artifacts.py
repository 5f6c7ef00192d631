"""Recent lease artifact directories (written by the %%gpu magic), for the sidebar."""

from __future__ import annotations

import json
import os
from typing import Any

from ..artifacts import local_root

MAX_META_BYTES = 256 * 1024


def _read_meta(path: str) -> dict[str, Any] | None:
    try:
        if os.path.getsize(path) > MAX_META_BYTES:
            return None
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def recent_artifacts(root: str, server_root: str, limit: int = 20) -> dict[str, Any]:
    """The ``limit`` most recently modified artifact directories under ``root``, newest first.

    Each entry has ``relative_path`` (to the Jupyter server's root_dir, so the sidebar can open it) or None
    when the directory lies outside it.
    """
    local = local_root(root)
    if local is None:
        return {"root": root, "local": False, "artifacts": [],
                "message": f"Artifact root {root} is not a local directory: the sidebar lists local ones only"}
    entries: list[tuple[float, os.DirEntry[str]]] = []
    try:
        with os.scandir(local) as it:
            for entry in it:
                if entry.is_dir(follow_symlinks=False):
                    try:
                        entries.append((entry.stat().st_mtime, entry))
                    except OSError:
                        continue
    except FileNotFoundError:
        return {"root": local, "local": True, "artifacts": []}
    except OSError as e:
        return {"root": local, "local": True, "artifacts": [], "message": f"Cannot list {local}: {e.strerror}"}
    entries.sort(key=lambda t: t[0], reverse=True)
    server_root = os.path.realpath(os.path.expanduser(server_root))
    out = []
    for mtime, entry in entries[: max(0, limit)]:
        real = os.path.realpath(entry.path)
        rel = None
        if real == server_root or real.startswith(server_root.rstrip(os.sep) + os.sep):
            rel = os.path.relpath(real, server_root).replace(os.sep, "/")
        try:
            files = sorted(os.listdir(entry.path))[:50]
        except OSError:
            files = []
        out.append({
            "lease_id": entry.name,
            "path": entry.path,
            "relative_path": rel,
            "modified": mtime,
            "meta": _read_meta(os.path.join(entry.path, "meta.json")),
            "files": files,
        })
    return {"root": local, "local": True, "artifacts": out}
