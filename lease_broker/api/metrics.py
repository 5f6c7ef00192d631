"""Prometheus metrics, read from the manager at scrape time (imported at the first scrape: see metrics_http)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from ..core.lease import LeaseState
from ..manager.manager import LeaseManager
from ..notify.notifier import Notifier

_le: Callable[[float], str] = floatToGoString  # how Prometheus writes a bucket's bound: 1.073741824e+09, +Inf


class BrokerCollector(Collector):
    def __init__(self, manager: LeaseManager, notifier: Notifier | None = None) -> None:
        self.m, self.notifier = manager, notifier

    def collect(self) -> Iterator[Any]:
        m = self.m
        gpus = GaugeMetricFamily("gpulease_gpus", "GPUs by state", labels=["state", "simulated"])
        counts = m.summary()["states"]
        for state in ("free", "leased", "shared", "draining", "unhealthy"):
            gpus.add_metric([state, str(m.inventory.simulated).lower()], counts.get(state, 0))
        yield gpus
        leases = GaugeMetricFamily("gpulease_leases", "Live leases by state", labels=["state"])
        by_state: dict[str, float] = {}
        for lease in m.leases.values():
            by_state[lease.state.value] = by_state.get(lease.state.value, 0) + 1
        for state in LeaseState:
            if not state.terminal:
                leases.add_metric([state.value], by_state.get(state.value, 0))
        yield leases
        trans = CounterMetricFamily(
            "gpulease_transitions", "Lease state transitions since start", labels=["from_state", "to_state"]
        )
        for (a, b), n in sorted(m.transitions_total.items()):
            trans.add_metric([a, b], n)
        yield trans
        holder_ended = CounterMetricFamily(
            "gpulease_leases_holder_ended", "Leases ended because their holder went, by cause (exited: its process "
            "exited, reason holder_exited; heartbeat: no heartbeat for heartbeat_timeout, reason holder_gone)",
            labels=["cause"])
        for cause, n in sorted(m.holders.ended_total.items()):
            holder_ended.add_metric([cause], n)
        yield holder_ended
        per_user = GaugeMetricFamily("gpulease_user_gpus", "GPUs held per user", labels=["user"])
        for user, count in sorted(m.state.held_by_user().items()):
            per_user.add_metric([user], count)
        yield per_user
        unleased = GaugeMetricFamily(
            "gpulease_unleased_processes", "Processes using a GPU without a lease", labels=["gpu", "index", "user"]
        )
        watch = m.enforcer.watch
        for gpu_id, procs in sorted(watch.unleased.items()):
            by_user: dict[str, int] = {}
            for r in procs.values():
                by_user[r["user"]] = by_user.get(r["user"], 0) + 1
            index = str(m.gpu_by_id[gpu_id].index) if gpu_id in m.gpu_by_id else ""
            for user, n in sorted(by_user.items()):
                unleased.add_metric([gpu_id, index, user], n)
        yield unleased
        yield CounterMetricFamily(
            "gpulease_unleased_process_kills", "Unleased processes the broker stopped", value=watch.kills_total
        )
        util = GaugeMetricFamily("gpulease_gpu_utilization_percent", "GPU utilisation (latest sample)",
                                 labels=["gpu", "index"])
        for g in m.gpus:
            s = m.samples.get(g.id)
            if s is not None:
                util.add_metric([g.id, str(g.index)], s.utilization)
        yield util
        yield from self._usage()
        yield CounterMetricFamily("gpulease_store_commits", "Group commits of the lease store (one per event-loop "
                                  "iteration that changed leases)", value=m.group.groups)
        yield CounterMetricFamily("gpulease_store_writes", "Lease writes stored (in group commits)",
                                  value=m.group.writes)
        sent = CounterMetricFamily("gpulease_notifications", "Notifications by channel and result (sent, retried: "
                                   "an attempt failed and will be retried, failed: given up)",
                                   labels=["channel", "result"])
        for (channel, result), n in sorted((self.notifier.counts if self.notifier else {}).items()):
            sent.add_metric([channel, result], n)
        yield sent
        yield GaugeMetricFamily("gpulease_event_subscribers", "Open event streams", value=m.events.subscriber_count)


    def _usage(self) -> Iterator[Any]:
        """What leases use: a gauge per holding lease (as many series as leases hold GPUs: bounded by the GPUs and
        their shares), histograms of the ended leases' figures (since the broker started)."""
        m = self.m
        peak = GaugeMetricFamily("gpulease_lease_peak_memory_bytes", "Peak GPU memory of each holding lease so far",
                                 labels=["lease", "user"])
        mean = GaugeMetricFamily("gpulease_lease_mean_utilization_percent",
                                 "Mean GPU utilisation of each holding lease so far", labels=["lease", "user"])
        for lease in m.state.holding():
            if lease.use.samples:
                peak.add_metric([lease.id, lease.user], lease.use.peak_memory)
            if lease.use.util_mean is not None:
                mean.add_metric([lease.id, lease.user], lease.use.util_mean)
        yield peak
        yield mean
        for name, text, hist in (
            ("gpulease_ended_lease_peak_memory_bytes", "Peak GPU memory of leases that ended",
             m.metering.peak_memory),
            ("gpulease_ended_lease_mean_utilization_percent", "Mean GPU utilisation of leases that ended",
             m.metering.mean_utilization),
        ):
            buckets = [(_le(bound), float(n)) for bound, n in hist.buckets()]
            yield HistogramMetricFamily(name, text, buckets=buckets, sum_value=hist.sum)


def registry_for(manager: LeaseManager, notifier: Notifier | None = None) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)  # True would collect once at start, over every lease
    reg.register(BrokerCollector(manager, notifier))
    return reg
