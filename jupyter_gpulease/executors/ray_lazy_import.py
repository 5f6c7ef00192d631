"""Ray's import without ``rfc3987_syntax``'s IRI grammar: the one stand-in, for the kernel and for Ray's worker
processes on a GPU node. Importable without Ray (and cheap: a Ray worker's ``sitecustomize`` imports it).

``import ray`` imports jsonschema (for its runtime_env schemas), which imports the optional ``rfc3987_syntax``
(installed with ``jsonschema[format-nongpl]``, a dependency of jupyter-events, so of every JupyterLab environment),
whose import builds three Earley parsers: 1.1-1.6 s of CPU of the 1.5-2.2 s ``import ray`` takes on the 2-core
benchmark machine (``python -X importtime -c 'import ray'``). ``defer_iri_grammar`` puts a stand-in in
``sys.modules`` that loads the real module when something first checks an IRI.

Where: the kernel calls it before its first ``import ray`` (executors/ray.py: ``_connect``). A Ray worker process
(an actor, a task's worker) imports Ray before any code of ours runs, from the environment its raylet started it
with; so the stand-in reaches it only through that environment: ``site_dir()`` (``python -m
jupyter_gpulease.executors.ray_lazy_import`` prints it) holds a ``sitecustomize`` that installs the stand-in and
then runs the site's own ``sitecustomize`` it shadows; put it first on ``PYTHONPATH`` where a GPU node's Ray node
starts (``ray start``). A Ray ``runtime_env`` from the kernel cannot do it: with one, the raylet starts each worker
through ``setup_worker.py``, which imports Ray with the grammar before it applies the ``env_vars`` (Ray 2.60:
2.2-2.5 s to an actor's first answer against 1.9 s without, the grammar built once all the same). The cell's own
interpreter never gets the directory (``cell_pythonpath``): its environment is the kernel's and the lease's.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import threading
import types
from typing import Any

NAME = "rfc3987_syntax"
_LOCK = threading.Lock()


def defer_iri_grammar() -> None:
    """Build ``rfc3987_syntax``'s IRI grammar when something first checks an IRI, not at its import (before the
    first ``import ray`` of this process). The module stands in ``sys.modules`` until first used:
    ``is_valid_syntax`` (what jsonschema takes) and any other name load the real module then, and it replaces the
    stand-in; nothing where the package is missing or already loaded."""
    with _LOCK:
        if NAME in sys.modules:
            return
        try:
            spec = importlib.util.find_spec(NAME)
        except (ImportError, ValueError):
            return
        if spec is None:
            return

        def real() -> types.ModuleType:
            with _LOCK:
                if sys.modules.get(NAME) is stand_in:
                    del sys.modules[NAME]
                return importlib.import_module(NAME)

        class Deferred(types.ModuleType):
            def __getattr__(self, attr: str) -> Any:
                if attr.startswith("__"):
                    raise AttributeError(attr)
                return getattr(real(), attr)

        def is_valid_syntax(term: str, value: str) -> bool:
            return bool(real().is_valid_syntax(term, value))

        stand_in = Deferred(NAME)
        stand_in.__spec__ = spec
        stand_in.__path__ = list(spec.submodule_search_locations or [])
        stand_in.is_valid_syntax = is_valid_syntax  # type: ignore[attr-defined]
        sys.modules[NAME] = stand_in


def site_dir() -> str:
    """The directory whose ``sitecustomize`` defers the grammar in every Python started with it first on
    ``PYTHONPATH`` (a GPU node's Ray worker processes, when its ``ray start`` has it)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "ray_site")


def cell_pythonpath(pythonpath: str) -> str:
    """``PYTHONPATH`` for a cell's interpreter started by a Ray actor: the actor's without ``site_dir()``."""
    ours = os.path.normpath(site_dir())
    return os.pathsep.join(p for p in pythonpath.split(os.pathsep) if p and os.path.normpath(p) != ours)


if __name__ == "__main__":
    print(site_dir())
