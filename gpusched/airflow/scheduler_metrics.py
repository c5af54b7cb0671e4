"""The scheduler's own Prometheus metrics: what the GPU executors decide, served from the scheduler.

The per-host agent serves device telemetry (:mod:`gpusched.agent.prometheus`); this module counts
what only the scheduler process knows, for both executors alike (their shared core,
:class:`~gpusched.airflow.gpu_scheduling.GPUScheduling`, calls it where it decides):

- ``gpusched_scheduler_decision_seconds`` (histogram): one scheduling cycle's decision — its
  inputs read from the ledger, placement (and re-planning), preemption — per cycle that had GPU
  work to place;
- ``gpusched_scheduler_placements_total`` (counter): tasks those cycles placed;
- ``gpusched_scheduler_pending_tasks{reason}`` and ``gpusched_scheduler_oldest_wait_seconds{reason}``
  (gauges): the GPU tasks the last cycle left waiting, by reason kind, and the longest of their
  waits (computed at scrape time);
- ``gpusched_scheduler_holds_total{reason}`` (counter): holds recorded — a task starts to wait, or
  the reason it waits for changes;
- ``gpusched_scheduler_preemptions_total``, ``gpusched_scheduler_migrations_total``,
  ``gpusched_scheduler_hosts_lost_total`` (counters): victims told to stop, moves started
  (``preemption = migrate``), GPU hosts this scheduler judged lost;
- ``gpusched_scheduler_gpu_hosts{state}`` (gauge): registered GPU hosts by state (live, lost,
  unconfirmed), as of the last host check;
- ``gpusched_scheduler_tenant_gpu_hours{tenant}`` and ``gpusched_scheduler_partition_gpu_hours{partition}``
  (gauges): use this budget period (:mod:`gpusched.quota.usage`: A100-equivalent hours per tenant
  as the quota counts them, physical GPU-hours per partition), read from the ledger every
  :attr:`SchedulerMetrics.usage_refresh_s` seconds while the metrics are served (never with
  ``metrics_port = 0``).

Reason labels are a fixed set (:data:`REASON_KINDS`, from :func:`reason_kind`), never the
free-text reason. ``[gpusched] metrics_port`` (0 = off, the default) and ``metrics_host``
(127.0.0.1) say where :func:`serve` listens; the executors start it in ``start()``. Every
executor of one process is served from one endpoint, their figures added up.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from gpusched import settings
from gpusched.quota.file import load_quota_policy
from gpusched.quota.policy import UNITS_PER_A100_HOUR
from gpusched.quota.usage import partition_usage, period_start, spans_of, tenant_usage
from gpusched.request import Partition
from gpusched.scheduler.cycle import CycleReply, Hold

__all__ = [
    "BUCKETS", "REASON_KINDS", "MetricsEndpoint", "SchedulerMetrics", "reason_kind", "serve", "stop_serving",
]

REASON_KINDS = (
    "capacity", "quota", "gang", "preemption", "host_resources", "worker_slots", "host_unavailable",
    "queued_behind", "never_fits", "other",
)
"""Why a GPU task waits, as a label: matching devices busy; its tenant's budget or partition
share; a multi-node gang not complete or not fitting yet; room being made by a preemption; devices
free but not the host's CPU or memory; the host's Celery worker slots all busy; its GPU host lost,
unconfirmed or without an agent; strict FIFO; a request this fleet can never hold
(``fail_unschedulable = False``); anything else."""

BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Upper bounds (seconds) of the decision-latency histogram's buckets (``+Inf`` added)."""

HOST_STATES = ("live", "lost", "unconfirmed", "standby")


def reason_kind(hold: Hold) -> str:
    """The reason kind (:data:`REASON_KINDS`) of ``hold``, as the executor records it.

    Read from the hold's flags, then from the fixed openings and phrases of the reasons the cycle,
    the quota, the gangs, the preemptions and the executors write (their numbers and names vary;
    these words do not). Unknown wording is ``other``.
    """
    reason = hold.reason
    if hold.queued_behind:
        return "queued_behind"
    if hold.permanent:
        return "never_fits"
    if "worker slot" in reason:  # an executor note added to any reason: the host's slots are full
        return "worker_slots"
    if reason.startswith("multi-node gang"):
        return "gang"
    if reason.startswith(("tenant ", "partition ")):
        return "quota"
    if reason.startswith("waiting for preempted ") or "starts once their devices are free" in reason:
        return "preemption"
    if "lost: waiting for them to come back" in reason or reason.startswith(("GPU host ", "node ")):
        return "host_unavailable"
    if "no node holding them has" in reason:
        return "host_resources"
    if reason.startswith(("waiting for ", "needs ", "devices taken meanwhile")):
        return "capacity"
    return "other"


class SchedulerMetrics:
    """What one executor decided, kept for the scrape (see the module docstring).

    The scheduler loop records; the HTTP server's thread reads :meth:`families`; one lock keeps
    them apart. ``clock``: the executor's (wall-clock seconds, for waits and the budget period).
    """

    usage_refresh_s = 60.0
    """How often :meth:`periodic` reads the budget period's use from the ledger."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.started_at = clock()
        self._lock = threading.Lock()
        self.buckets = [0] * (len(BUCKETS) + 1)  # the last one is +Inf
        self.decision_sum = 0.0
        self.decisions = 0
        self.placements = 0
        self.holds = dict.fromkeys(REASON_KINDS, 0)
        self.preemptions = self.migrations = self.hosts_lost = 0
        self.waiting: dict[str, tuple[str, float]] = {}  # ledger key -> (kind, waiting since): last cycle
        self._tally: dict[str, tuple[str, float]] = {}  # the cycle being carried out
        self.hosts: dict[str, int] | None = None  # state -> hosts (None: never checked)
        self.tenant_hours: dict[str, float] = {}
        self.partition_hours: dict[str, float] = {}
        self._usage_at = float("-inf")
        self.served = False  # set by serve(): the budget use is read only for a scrape to see

    # ---- the scheduler loop records ------------------------------------------------------------

    def decided(self, seconds: float, reply: CycleReply) -> None:
        """One cycle decided in ``seconds``; its holds are reported next (:meth:`held`)."""
        with self._lock:
            self.decisions += 1
            self.decision_sum += seconds
            self.buckets[next((i for i, bound in enumerate(BUCKETS) if seconds <= bound), len(BUCKETS))] += 1
            self.placements += len(reply.launches)
            self._tally = {}

    def held(self, hold: Hold, since: float, recorded: str | None) -> None:
        """``hold`` keeps its task waiting (since ``since``); ``recorded``: the reason the task
        waited for until now (a new or changed reason counts as a hold)."""
        kind = reason_kind(hold)
        with self._lock:
            self._tally[hold.key] = (kind, since)
            if recorded != hold.reason:
                self.holds[kind] += 1

    def cycle_done(self) -> None:
        """The cycle's holds are all reported: they are what waits now."""
        with self._lock:
            self.waiting, self._tally = self._tally, {}

    def preempted(self, before: Iterable[str], evictions: Mapping[str, Any]) -> None:
        """Count the victims in ``evictions`` (key -> :class:`~gpusched.scheduler.preemption.Eviction`)
        not in ``before`` and told since this process started (not those restored after a restart)."""
        known = set(before)
        new = [k for k, e in evictions.items() if k not in known and e.notice_at >= self.started_at]
        with self._lock:
            self.preemptions += len(new)

    def migrated(self, moves: Sequence[Any] | None) -> None:
        """Count the moves a migration round started."""
        with self._lock:
            self.migrations += len(moves or ())

    def hosts_judged(self, before: Iterable[Any], after: Iterable[Any]) -> None:
        """Count the hosts that went lost between ``before`` and ``after`` (host records, with
        ``name`` and ``state``) and keep ``after``'s states."""
        was = {h.name: h.state for h in before}
        now = {h.name: h.state for h in after}
        lost = sum(1 for name, state in now.items() if state == "lost" and was.get(name) != "lost")
        counts = dict.fromkeys(HOST_STATES, 0)
        for state in now.values():
            counts[state] = counts.get(state, 0) + 1
        with self._lock:
            self.hosts_lost += lost
            self.hosts = counts

    def periodic(self, ledger: Any, waiting_gpu_work: bool, now: float | None = None) -> None:
        """Every executor sync: forget the waiting tasks once none is queued any more, and (when
        :attr:`served`) read the budget period's use from ``ledger`` when :attr:`usage_refresh_s`
        have passed."""
        if not waiting_gpu_work:
            with self._lock:
                self.waiting = {}
        now = self.clock() if now is None else now
        if not self.served or now - self._usage_at < self.usage_refresh_s:
            return
        self._usage_at = now
        start = period_start(now, load_quota_policy().period_s)
        spans = spans_of(ledger.history(start, now))
        snapshot = ledger.snapshot(now)
        tenants = {t: u / UNITS_PER_A100_HOUR for t, u in tenant_usage(spans, snapshot, start, now).items()}
        partitions = {str(p): h for p, h in partition_usage(spans, snapshot, start, now).items()}
        with self._lock:
            self.tenant_hours, self.partition_hours = tenants, partitions

    # ---- the scrape reads ------------------------------------------------------------------------

    def families(self, now: float | None = None) -> list[Metric]:
        """This executor's metric families (as :func:`merged_families` of one)."""
        return merged_families([self], now)


def merged_families(metrics: Sequence[SchedulerMetrics], now: float | None = None) -> list[Metric]:
    """The families of every executor in ``metrics``, added up (waits: the longest; budget use:
    the latest read, all executors read the same ledger)."""
    at = time.time() if now is None else now
    buckets = [0] * (len(BUCKETS) + 1)
    total = 0.0
    decisions = placements = preemptions = migrations = hosts_lost = 0
    holds = dict.fromkeys(REASON_KINDS, 0)
    pending = dict.fromkeys(REASON_KINDS, 0)
    oldest: dict[str, float] = {}
    hosts: dict[str, int] | None = None
    tenants: dict[str, float] = {}
    partitions: dict[str, float] = {}
    usage_at = float("-inf")
    for m in metrics:
        with m._lock:
            buckets = [a + b for a, b in zip(buckets, m.buckets, strict=True)]
            total += m.decision_sum
            decisions += m.decisions
            placements += m.placements
            preemptions += m.preemptions
            migrations += m.migrations
            hosts_lost += m.hosts_lost
            for kind, count in m.holds.items():
                holds[kind] += count
            for kind, since in m.waiting.values():
                pending[kind] += 1
                oldest[kind] = min(since, oldest.get(kind, since))
            if m.hosts is not None:
                hosts = {s: (hosts or {}).get(s, 0) + n for s, n in m.hosts.items()}
            if m._usage_at > usage_at:
                usage_at, tenants, partitions = m._usage_at, dict(m.tenant_hours), dict(m.partition_hours)
    cumulative, running = [], 0
    for bound, count in zip((*map(str, BUCKETS), "+Inf"), buckets, strict=True):
        running += count
        cumulative.append((bound, running))
    families: list[Metric] = [HistogramMetricFamily(
        "gpusched_scheduler_decision_seconds",
        "Seconds one scheduling cycle took to decide (inputs read from the ledger, placement, "
        "re-planning, preemption), per cycle with GPU work to place.",
        buckets=cumulative, sum_value=total)]
    families.append(CounterMetricFamily("gpusched_scheduler_placements", "GPU tasks the cycles placed.",
                                        value=placements))
    waiting = GaugeMetricFamily("gpusched_scheduler_pending_tasks",
                                "GPU tasks the last scheduling cycle left waiting, by reason kind.",
                                labels=("reason",))
    wait = GaugeMetricFamily("gpusched_scheduler_oldest_wait_seconds",
                             "Seconds the longest-waiting GPU task of the reason kind has waited "
                             "(0: none waits for it).", labels=("reason",))
    held = CounterMetricFamily("gpusched_scheduler_holds",
                               "Holds recorded: a GPU task started to wait, or its reason changed, "
                               "by reason kind.", labels=("reason",))
    for kind in REASON_KINDS:
        waiting.add_metric((kind,), pending[kind])
        wait.add_metric((kind,), max(0.0, at - oldest[kind]) if kind in oldest else 0.0)
        held.add_metric((kind,), holds[kind])
    families += [waiting, wait, held]
    families.append(CounterMetricFamily("gpusched_scheduler_preemptions",
                                        "Running GPU tasks told to stop for waiting work (victims).",
                                        value=preemptions))
    families.append(CounterMetricFamily("gpusched_scheduler_migrations",
                                        "Moves of running GPU tasks to another GPU type started "
                                        "(preemption = migrate).", value=migrations))
    families.append(CounterMetricFamily("gpusched_scheduler_hosts_lost",
                                        "GPU hosts this scheduler judged lost.", value=hosts_lost))
    if hosts is not None:
        gauge = GaugeMetricFamily("gpusched_scheduler_gpu_hosts",
                                  "Registered GPU hosts by state, as of the last host check.",
                                  labels=("state",))
        for state, count in sorted(hosts.items()):
            gauge.add_metric((state,), count)
        families.append(gauge)
    tenant = GaugeMetricFamily("gpusched_scheduler_tenant_gpu_hours",
                               "A100-equivalent GPU-hours the tenant used this budget period (as the quota "
                               "counts them).", labels=("tenant",))
    for name, hours in sorted(tenants.items()):
        tenant.add_metric((name,), hours)
    partition = GaugeMetricFamily("gpusched_scheduler_partition_gpu_hours",
                                  "Physical GPU-hours the partition used this budget period.",
                                  labels=("partition",))
    for name in (str(p) for p in Partition) if usage_at > float("-inf") else ():
        partition.add_metric((name,), partitions.get(name, 0.0))
    return [*families, tenant, partition]


class _Collector(Collector):
    def __init__(self, metrics: list[SchedulerMetrics]) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        yield from merged_families(list(self.metrics))


class MetricsEndpoint:
    """One ``GET /metrics`` server (``prometheus_client``'s, on a daemon thread) and the executors
    it serves, from its own registry (no process or platform collectors)."""

    def __init__(self, host: str, port: int) -> None:
        self.metrics: list[SchedulerMetrics] = []
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self.metrics))
        self.server, self.thread = start_http_server(port, addr=host, registry=self.registry)
        self.host = host

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


_ENDPOINTS: dict[tuple[str, int], MetricsEndpoint] = {}
_ENDPOINTS_LOCK = threading.Lock()


def serve(metrics: SchedulerMetrics, conf: Any, log: Any) -> MetricsEndpoint | None:
    """Serve ``metrics`` on ``[gpusched] metrics_host``:``metrics_port`` of ``conf`` (the
    executor's team-scoped config); None when the port is 0 (off) or cannot be bound (logged:
    the scheduler runs on without metrics). An executor of this process already serving there
    shares its endpoint."""
    port = settings.get_int("metrics_port", conf)
    host = settings.get_str("metrics_host", conf) or "127.0.0.1"
    if port <= 0:
        return None
    with _ENDPOINTS_LOCK:
        endpoint = _ENDPOINTS.get((host, port))
        if endpoint is None:
            try:
                endpoint = _ENDPOINTS[(host, port)] = MetricsEndpoint(host, port)
            except OSError as exc:
                log.error("gpusched: scheduler metrics not served on %s:%d: %s", host, port, exc)
                return None
            log.info("gpusched: scheduler metrics on http://%s:%d/metrics", host, endpoint.port)
        if metrics not in endpoint.metrics:
            endpoint.metrics.append(metrics)
        metrics.served = True
    return endpoint


def stop_serving(metrics: SchedulerMetrics) -> None:
    """Stop serving ``metrics``; an endpoint left with no executor closes."""
    with _ENDPOINTS_LOCK:
        for key, endpoint in list(_ENDPOINTS.items()):
            if metrics in endpoint.metrics:
                endpoint.metrics.remove(metrics)
                metrics.served = False
                if not endpoint.metrics:
                    endpoint.close()
                    del _ENDPOINTS[key]
