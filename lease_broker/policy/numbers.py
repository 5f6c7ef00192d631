"""The numbers of the policy: every ``Float`` and ``Integer`` option of ``LeasePolicy`` is finite and at least 0
(``positive=True``: above 0; ``min=``: at least that), and a bad value (NaN, an infinity, a negative number, an
integer too large for a JSON client) is refused naming the option and quoting the value, wherever it comes from:
the config file at start, a SIGHUP reload, ``PUT /api/v1/policy``.

``lease_policy.py`` imports these two in place of traitlets' own, so an option added there (or a
``Dict`` of numbers, through its ``value_trait``) is covered without a validator of its own: one rule, not one
``@validate`` per option. The broker's other numeric options (``LeaseBroker``'s, ``HubIdentity``'s, the
inventories') use them too (``max=``: at most that), and its size options ``Size``.
"""

from __future__ import annotations

import math
from typing import Any

import traitlets
from traitlets import TraitError, Undefined

from gpulease_protocol.requests import parse_size, quoted

#: The largest whole number every JSON parser reads exactly (JavaScript's Number.MAX_SAFE_INTEGER).
LARGEST_INT = 2**53 - 1


def _refuse(trait: traitlets.TraitType[Any, Any], obj: Any, value: Any) -> TraitError:
    where = f"{type(obj).__name__}.{trait.name}" if trait.name else f"a value of {type(obj).__name__}"
    return TraitError(f"{where}={quoted(value)}: must be {trait.info_text}")


class Float(traitlets.Float):  # type: ignore[type-arg]
    """A policy number (seconds, GPUs, hours, a weight): finite, >= ``min`` (0), > 0 with ``positive``."""

    def __init__(self, default_value: Any = Undefined, *, positive: bool = False, **kwargs: Any) -> None:
        kwargs.setdefault("min", 0.0)
        self.positive = positive
        super().__init__(default_value, **kwargs)
        bound = f" and at most {self.max:g}" if math.isfinite(self.max) else ""
        self.info_text = f"a finite number {'>' if positive else '>='} {self.min:g}{bound}"

    def validate(self, obj: Any, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.error(obj, value)
        try:
            number = float(value)
        except OverflowError:  # an integer of hundreds of digits
            raise _refuse(self, obj, value) from None
        low = number <= self.min if self.positive else number < self.min
        if not math.isfinite(number) or low or number > self.max:
            raise _refuse(self, obj, value)
        return number


class Integer(traitlets.Integer):  # type: ignore[type-arg]
    """A policy count (GPUs, requests, a rank): a whole number from ``min`` (0) to ``LARGEST_INT``."""

    def __init__(self, default_value: Any = Undefined, **kwargs: Any) -> None:
        kwargs.setdefault("min", 0)
        kwargs.setdefault("max", LARGEST_INT)
        super().__init__(default_value, **kwargs)
        self.info_text = f"a whole number from {self.min} to {self.max}"

    def validate(self, obj: Any, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            self.error(obj, value)
        if not self.min <= value <= self.max:
            raise _refuse(self, obj, value)
        return int(value)


class Size(traitlets.Unicode):  # type: ignore[type-arg]
    """A size option in bytes or units (``'80G'``, ``'256M'``), refused at once where ``parse_size`` cannot read it."""

    def validate(self, obj: Any, value: Any) -> str:
        text = str(super().validate(obj, value))
        try:
            parse_size(text, f"{type(obj).__name__}.{self.name}")
        except ValueError as e:  # a config error, said as the numbers' are
            raise TraitError(str(e)) from None
        return text
