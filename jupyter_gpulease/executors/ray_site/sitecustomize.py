"""(First on ``PYTHONPATH`` of a GPU node's ``ray start``: its Ray worker processes.) Defer ``rfc3987_syntax``'s IRI
grammar that ``import ray`` would build (``jupyter_gpulease.executors.ray_lazy_import``), then run the
``sitecustomize`` this one shadows, if the site has one."""

import importlib
import os
import sys

try:
    from jupyter_gpulease.executors.ray_lazy_import import defer_iri_grammar
except ImportError:  # jupyter-gpulease is not installed in this interpreter: nothing to defer
    pass
else:
    defer_iri_grammar()


def _shadowed() -> None:
    here = os.path.normpath(os.path.dirname(os.path.abspath(__file__)))
    path = sys.path[:]
    ours = sys.modules.pop("sitecustomize", None)
    try:
        sys.path[:] = [p for p in path if os.path.normpath(os.path.abspath(p or os.curdir)) != here]
        importlib.import_module("sitecustomize")
    except ImportError as e:
        if e.name != "sitecustomize":
            raise
    finally:
        sys.path[:] = path
        if ours is not None:
            sys.modules["sitecustomize"] = ours


_shadowed()
