"""The GPU events: ``gpus`` (the summary: counts by state), published at most every ``GPU_EVENT_INTERVAL``;
``gpu_samples`` (what each GPU does now), published at each inventory sample for the sidebar's live charts."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..core.driver import Driver
from ..core.gpu import GpuSample

#: The GPU summary is published at most this often: at once after a quiet spell, then on the trailing edge.
#: A busy broker would otherwise rebuild it twice per grant and release.
GPU_EVENT_INTERVAL = 0.1


class GpuSummary:
    def __init__(self, *, publish: Callable[..., None], summary: Callable[[], dict[str, Any]],
                 driver: Driver) -> None:
        """``publish``: ``LeaseOps.publish``, which publishes once what memory holds now is stored, so the summary
        never shows a change that a failed commit then undoes."""
        self.publish, self.summary, self.driver = publish, summary, driver
        self._dirty, self._sent = False, -1e9

    def changed(self) -> None:
        """Publish the summary: at once, or at most every GPU_EVENT_INTERVAL (the latest state wins)."""
        if self._dirty:
            return  # already scheduled: it will carry this change too
        if not self.driver.deferred:  # no loop (the replay, tests with a virtual clock): at once
            self._flush()
            return
        self._dirty = True
        self.driver.call_later(max(0.0, self._sent + GPU_EVENT_INTERVAL - time.monotonic()), self._flush)

    def _flush(self) -> None:
        self._dirty, self._sent = False, time.monotonic()
        self.publish("gpus", summary=self.summary())

    def sampled(self, samples: dict[str, GpuSample], known: dict[str, Any]) -> None:
        """Publish a new inventory sample: per GPU its utilisation (percent) and memory used (bytes).

        Everyone sees these figures in the GPU view already; no processes, pids or users are in it."""
        gpus = [{"id": gpu_id, "utilization": s.utilization, "memory_used": s.memory_used}
                for gpu_id, s in samples.items() if gpu_id in known]
        if gpus:
            self.publish("gpu_samples", user=None, gpus=gpus)
