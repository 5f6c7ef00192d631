"""What a cell needs from the kernel: its free names, and which of them ``--in auto`` may send."""

from __future__ import annotations

import ast
import builtins
import re
import types
from dataclasses import dataclass, field
from typing import Any

from gpulease_protocol.requests import format_size

from ..wire.transfer import approx_size

# Never sent implicitly: IPython's own names and anything that looks like a credential.
_KERNEL_NAMES = {"In", "Out", "get_ipython", "exit", "quit", "display"}
SECRET_NAME = re.compile(r"(passw|secret|token|api_?key|credential|private_?key|auth)", re.I)


def free_names(code: str) -> list[str]:
    """Names the cell reads before (or without) binding them, in order of first use."""
    try:
        tree = ast.parse(code)
    except SyntaxError:  # the worker reports it with the cell's own line numbers
        return []
    nodes = sorted(_outer_names(tree), key=lambda n: (n.lineno, n.col_offset))
    bound: set[str] = set()
    for n in ast.walk(tree):  # names bound by imports, defs and classes count as bound
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in n.names)
        elif isinstance(n, ast.arg):  # function and lambda parameters
            bound.add(n.arg)
    first: dict[str, bool] = {}
    for n in nodes:
        if n.id not in first:
            first[n.id] = isinstance(n.ctx, ast.Load)
    defs = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    return [name for name, loaded in first.items() if loaded and name not in bound and name not in defs]


_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)


def _outer_names(node: ast.AST, local: frozenset[str] = frozenset()) -> list[ast.Name]:
    """The ``Name`` nodes under ``node``, less those a comprehension binds for itself (``[x for x in xs]``: ``x`` is
    the comprehension's own, ``xs`` the cell's). ``local``: the names the enclosing comprehensions bind."""
    if isinstance(node, ast.Name):
        return [] if node.id in local else [node]
    if isinstance(node, _COMPREHENSIONS):
        out = _outer_names(node.generators[0].iter, local)  # evaluated in the enclosing scope
        bound = set(local)
        for i, gen in enumerate(node.generators):
            bound.update(n.id for n in ast.walk(gen.target) if isinstance(n, ast.Name))
            inner = frozenset(bound)
            if i:
                out += _outer_names(gen.iter, inner)
            for cond in gen.ifs:
                out += _outer_names(cond, inner)
        inner = frozenset(bound)
        elts = [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]
        for elt in elts:
            out += _outer_names(elt, inner)
        return out
    return [n for child in ast.iter_child_nodes(node) for n in _outer_names(child, local)]


@dataclass
class Selection:
    send: dict[str, Any] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # name -> why
    unknown: list[str] = field(default_factory=list)  # used, but not in the kernel either

    def note(self) -> str:
        parts = []
        if self.skipped:
            parts.append("not sent: " + "; ".join(f"{n} ({why})" for n, why in self.skipped.items()))
        if self.unknown:
            parts.append("used but not defined in the kernel: " + ", ".join(self.unknown))
        return ("gpulease: " + " | ".join(parts)) if parts else ""


def select_inputs(code: str, user_ns: dict[str, Any], explicit: list[str] | None, auto_max_bytes: int) -> Selection:
    """The values to send: the explicit ``--in`` names, or (auto) the free names the cell uses, guarded."""
    sel = Selection()
    used = free_names(code)
    if explicit is not None:
        for name in explicit:
            if name not in user_ns:
                raise NameError(f"--in names {name!r}, which is not defined in the kernel")
            sel.send[name] = user_ns[name]
        for name in used:
            if name in sel.send or hasattr(builtins, name):
                continue
            if name in user_ns:
                sel.skipped[name] = "not in --in"
            else:
                sel.unknown.append(name)
        return sel
    for name in used:
        if hasattr(builtins, name) and name not in user_ns:
            continue
        if name not in user_ns:
            sel.unknown.append(name)
            continue
        if name.startswith("_") or name in _KERNEL_NAMES:
            sel.skipped[name] = "kernel internal"
            continue
        value = user_ns[name]
        if isinstance(value, types.ModuleType):
            sel.send[name] = value  # travels by reference: imported again in the worker
            continue
        if SECRET_NAME.search(name):
            sel.skipped[name] = "looks like a secret; pass it with --in if you mean it"
            continue
        n = approx_size(value, auto_max_bytes)
        if n > auto_max_bytes:
            sel.skipped[name] = f"~{format_size(n)} is over GpuMagics.auto_max_bytes; pass it with --in"
            continue
        sel.send[name] = value
    return sel


def check_plain_python(shell: Any, code: str) -> None:
    """The worker runs plain Python: refuse IPython syntax (magics, !commands) with a clear message."""
    try:
        ast.parse(code)
        return
    except SyntaxError:
        pass
    transformed = shell.transform_cell(code) if shell is not None else code
    if "get_ipython()" in transformed:
        raise SyntaxError(
            "IPython syntax (%magics, !commands) cannot run inside a %%gpu cell: the cell runs in a plain "
            "Python worker. Use subprocess for shell commands, or move the magic to its own cell."
        )
