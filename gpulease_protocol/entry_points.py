"""A class chosen by name: the one way an inventory (``jupyter_gpulease.inventories``) or an executor
(``jupyter_gpulease.executors``) is picked, from a config option or from a lease's placement.

``EntryPointType`` is a traitlets ``Type`` that also takes the name of an entry point of its group (what packages
register in their ``pyproject.toml``) or ``module:Class``, and loads the class, refusing an unknown name with the
names installed. Our own classes are registered in ``pyproject.toml`` like any other package's.
"""

from __future__ import annotations

import functools
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from traitlets import TraitError, Type


@functools.cache
def installed(group: str) -> dict[str, EntryPoint]:
    """The entry points of ``group`` by name, read once per process (reading them costs 30-80 ms)."""
    return {ep.name: ep for ep in entry_points(group=group)}


class EntryPointType(Type):  # type: ignore[type-arg]
    """A class: given as the class, ``package.module.Class``, ``module:Class`` or an entry-point name of ``group``."""

    def __init__(self, default_value: Any = None, klass: Any = None, *, group: str, **kwargs: Any) -> None:
        self.group = group
        super().__init__(default_value, klass, **kwargs)

    def names(self) -> list[str]:
        """The entry-point names installed in this trait's group."""
        return sorted(installed(self.group))

    def load(self, name: str) -> type:
        """The class ``name`` stands for (an entry point of the group, or ``module:Class``), checked against
        ``klass``; an unknown name is refused with the names installed."""
        if ":" in name:
            found: Any = EntryPoint(name, name, self.group)
        else:
            found = installed(self.group).get(name)
        try:
            cls = found.load() if found is not None else None
        except (ImportError, AttributeError) as e:
            raise TraitError(f"{self._where()}={name!r} could not be loaded: {e}") from None
        if cls is None:
            raise TraitError(f"{self._where()}={name!r}: no such {self.group} entry point; "
                             f"installed are {', '.join(self.names())}")
        if isinstance(self.klass, type) and not (isinstance(cls, type) and issubclass(cls, self.klass)):
            raise TraitError(f"{self._where()}={name!r} is {cls!r}, not a subclass of {self.klass.__name__}")
        return cls

    def _resolve_string(self, string: str) -> Any:  # traitlets resolves a default and a value given by name here
        if ":" in string or "." not in string:  # not a dotted import path
            return self.load(string)
        return super()._resolve_string(string)

    def _where(self) -> str:
        owner = getattr(self, "this_class", None)
        return f"{owner.__name__}.{self.name}" if owner is not None and self.name else self.group
