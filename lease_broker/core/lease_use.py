"""What a lease used: its peak GPU memory and its mean and peak GPU utilisation, from the inventory's samples.

A value (frozen): the lease's owner replaces it through its one mutation path (``Change(use=...)``) as samples
come in, without a store write; the store writes it with the lease's next transition (its end at the latest).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

#: Where the figures come from: NVML's per-process counters, or the whole device (a lease holding a GPU alone,
#: where NVML lists no processes or has no per-process utilisation).
SOURCES = ("process", "device")


@dataclasses.dataclass(frozen=True)
class LeaseUse:
    samples: int = 0  # samples that measured the lease's memory
    peak_memory: int = 0  # bytes, over all the lease's devices together
    util_samples: int = 0  # samples that measured its utilisation (none on a MIG slice: NVML has no counters)
    util_sum: float = 0.0  # percent, summed over util_samples (the mean's numerator)
    util_peak: float = 0.0  # percent
    source: str = ""  # "process" or "device" (see SOURCES); "" before the first sample

    def add(self, memory: int | None, util: float | None, source: str) -> LeaseUse:
        """These figures with one more sample: ``memory`` bytes and ``util`` percent (None: not measured)."""
        if memory is None and util is None:
            return self
        return LeaseUse(
            samples=self.samples + (memory is not None),
            peak_memory=max(self.peak_memory, memory or 0),
            util_samples=self.util_samples + (util is not None),
            util_sum=self.util_sum + (util or 0.0),
            util_peak=max(self.util_peak, util or 0.0),
            source=source if self.source in ("", source) else "device",  # mixed: say the coarser one
        )

    @property
    def util_mean(self) -> float | None:
        return self.util_sum / self.util_samples if self.util_samples else None

    def view(self, held_memory: int) -> dict[str, Any]:
        """The lease view's ``usage``; ``held_memory``: the bytes the lease held (its devices', or its cap on a
        shared GPU)."""
        mean = self.util_mean
        return {
            "samples": self.samples,
            "peak_memory": self.peak_memory if self.samples else None,
            "held_memory": held_memory,
            "mean_utilization": round(mean, 2) if mean is not None else None,
            "peak_utilization": round(self.util_peak, 2) if self.util_samples else None,
            "source": self.source or None,
        }

    def text(self) -> str:
        """As the store keeps it (compact JSON; '' before the first sample)."""
        if not self.samples and not self.util_samples:
            return ""
        return json.dumps(dataclasses.astuple(self), separators=(",", ":"))

    @staticmethod
    def parse(text: str) -> LeaseUse:
        if not text:
            return NO_USE
        try:
            return LeaseUse(*json.loads(text))
        except (ValueError, TypeError):
            return NO_USE  # an unreadable record of figures never stops a lease from loading


NO_USE = LeaseUse()
