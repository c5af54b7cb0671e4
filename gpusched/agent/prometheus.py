"""Prometheus metrics of device telemetry through ``prometheus_client``, with DCGM-exporter names.

:func:`metric_families` (pure) turns the latest sample of each device, the fleet snapshot and the
active allocations into ``prometheus_client`` metric families; :func:`render_metrics` writes them
in the text format with the library's exposition. Device metrics carry the names and
labels of NVIDIA's dcgm-exporter (``gpu``, ``UUID``, ``device``, ``modelName``, ``Hostname``), so
existing Grafana dashboards work unchanged — for AMD and Ascend devices too. gpusched's own
metrics are prefixed ``gpusched_``.

:class:`MetricsServer` serves ``GET /metrics`` with ``prometheus_client``'s HTTP server from its
own registry (no process or platform collectors), whose collector reads the agent's latest
families at each scrape; bound to 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.registry import Collector

from gpusched.faults.alerts import HasShares
from gpusched.model import DeviceSample, FleetSnapshot, Health

__all__ = [
    "CONTENT_TYPE", "FamiliesCollector", "MetricsServer", "TenantBudget", "metric_families", "render_metrics",
    "scheduling_families",
]

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
"""What ``/metrics`` answers a scraper that asks for no particular format (text 0.0.4)."""
_MIB = 2**20

# name, type, help, value(sample) — the DCGM field names dcgm-exporter publishes.
_DCGM: tuple[tuple[str, str, str, Callable[[DeviceSample], float]], ...] = (
    ("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %).", lambda s: s.utilization_pct),
    ("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB).",
     lambda s: s.memory_used_bytes // _MIB),
    ("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB).",
     lambda s: max(0, s.memory_total_bytes - s.memory_used_bytes) // _MIB),
    ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C).", lambda s: s.temperature_mc / 1000),
    ("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W).", lambda s: s.power_mw / 1000),
    ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "unknown", "Total number of double-bit volatile ECC errors.",
     lambda s: s.ecc_uncorrected),
    ("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered.",
     lambda s: s.xid_errors[-1] if s.xid_errors else 0),
)


def _device_labels(snapshot: FleetSnapshot) -> dict[str, tuple[str, ...]]:
    """dcgm-exporter's label values (gpu, UUID, device, modelName, Hostname) of every device."""
    return {
        device.uuid: (str(device.index), device.uuid, f"{device.vendor}{device.index}", device.model,
                      device.node)
        for device in snapshot.devices()
    }


_DEVICE_LABELS = ("gpu", "UUID", "device", "modelName", "Hostname")


def _dcgm_family(name: str, kind: str, help_text: str) -> Metric:
    # A plain Metric keeps dcgm-exporter's exact names. The ECC total is "unknown" (untyped), not
    # "counter": prometheus_client's exposition renames a counter's family to <name>_total, which
    # would break the DCGM name (DCGM_FI_DEV_ECC_DBE_VOL_TOTAL_total) in HELP/TYPE.
    return Metric(name, help_text, kind)


def metric_families(
    samples: Iterable[DeviceSample],
    snapshot: FleetSnapshot,
    allocations: Sequence[HasShares] = (),
    *,
    counters: Mapping[tuple[str, str], int] | None = None,
    source: str | None = None,
) -> list[Metric]:
    """The newest sample of each device plus gpusched's own gauges, as metric families (pure).

    Args:
        samples: readings (any number per device; the newest one counts).
        snapshot: the fleet (model, node, health, cordon of each device).
        allocations: active allocations (``gpusched_allocations`` and per-device share).
        counters: alert actions taken so far, keyed by (rule, action kind).
        source: backend name for ``gpusched_fleet_info`` (e.g. "simulated").
    """
    latest: dict[str, DeviceSample] = {}
    for sample in samples:
        old = latest.get(sample.uuid)
        if old is None or sample.taken_at >= old.taken_at:
            latest[sample.uuid] = sample
    labels = _device_labels(snapshot)
    families: list[Metric] = []
    for name, kind, help_text, value in _DCGM:
        family = _dcgm_family(name, kind, help_text)
        for uuid in sorted(latest):
            values = labels.get(uuid) or ("", uuid, "", "", "")
            family.add_sample(name, dict(zip(_DEVICE_LABELS, values, strict=True)),
                              float(value(latest[uuid])))
        families.append(family)
    milli: dict[str, int] = {}
    memory: dict[str, int] = {}
    for alloc in allocations:
        for share in alloc.shares:
            milli[share.uuid] = milli.get(share.uuid, 0) + share.milli
            memory[share.uuid] = memory.get(share.uuid, 0) + share.memory_bytes
    families.append(GaugeMetricFamily("gpusched_allocations", "Active GPU allocations in the ledger.",
                                      value=len(allocations)))
    allocated = GaugeMetricFamily("gpusched_device_allocated_milli",
                                  "Compute share allocated on the device (1000 = whole).",
                                  labels=_DEVICE_LABELS)
    allocated_memory = GaugeMetricFamily("gpusched_device_allocated_memory_bytes",
                                         "Device memory allocated to tasks (bytes).", labels=_DEVICE_LABELS)
    for uuid, values in labels.items():
        allocated.add_metric(values, milli.get(uuid, 0))
        allocated_memory.add_metric(values, memory.get(uuid, 0))
    health = GaugeMetricFamily("gpusched_device_health", "Device health (1 for the current state).",
                               labels=(*_DEVICE_LABELS, "state"))
    cordoned = GaugeMetricFamily("gpusched_device_cordoned", "Whether the device (or its node) is cordoned.",
                                 labels=_DEVICE_LABELS)
    for node in snapshot.nodes:
        for device in node.devices:
            for state in Health:
                health.add_metric((*labels[device.uuid], str(state)), int(device.health is state))
            cordoned.add_metric(labels[device.uuid], int(device.cordoned or node.cordoned))
    actions = CounterMetricFamily("gpusched_alert_actions", "Alert actions applied by this agent.",
                                  labels=("rule", "action"))
    for (rule, kind), count in sorted((counters or {}).items()):
        actions.add_metric((rule, kind), count)
    info = GaugeMetricFamily("gpusched_fleet_info", "Where the fleet comes from (simulated fleets say so).",
                             labels=("source",))
    info.add_metric((source or snapshot.source,), 1)
    return [*families, allocated, allocated_memory, health, cordoned, actions, info]


@dataclass(frozen=True, slots=True)
class TenantBudget:
    """A tenant's use of its GPU-hour budget this period (A100-equivalent hours; None = no budget)."""

    tenant: str
    used_hours: float
    budget_hours: float | None


def scheduling_families(
    waiting_since: Mapping[str, float], budgets: Sequence[TenantBudget], now: float
) -> list[Metric]:
    """The queue and budget gauges the alert rules watch (pure).

    Args:
        waiting_since: partition -> when its longest-waiting task started waiting (epoch s),
            with ``gpusched_queue_waiting_tasks`` counted from the same entries.
        budgets: tenants' use of their budgets.
        now: the cycle's time.
    """
    oldest = GaugeMetricFamily("gpusched_queue_oldest_wait_seconds",
                               "Seconds the longest-waiting GPU task of the partition has waited.",
                               labels=("partition",))
    for partition, since in sorted(waiting_since.items()):
        oldest.add_metric((partition,), max(0.0, now - since))
    used = GaugeMetricFamily("gpusched_tenant_used_gpu_hours",
                             "A100-equivalent GPU-hours the tenant used this budget period.",
                             labels=("tenant",))
    budget = GaugeMetricFamily("gpusched_tenant_budget_gpu_hours",
                               "The tenant's GPU-hour budget this period (tenants with a budget).",
                               labels=("tenant",))
    for row in sorted(budgets, key=lambda b: b.tenant):
        used.add_metric((row.tenant,), row.used_hours)
        if row.budget_hours is not None:
            budget.add_metric((row.tenant,), row.budget_hours)
    return [oldest, used, budget]


class FamiliesCollector(Collector):
    """A ``prometheus_client`` collector that yields whatever ``families()`` returns at scrape time."""

    def __init__(self, families: Callable[[], Iterable[Metric]]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        """The current families (called by the registry at every scrape)."""
        yield from self._families()


def render_metrics(
    samples: Iterable[DeviceSample],
    snapshot: FleetSnapshot,
    allocations: Sequence[HasShares] = (),
    *,
    counters: Mapping[tuple[str, str], int] | None = None,
    source: str | None = None,
) -> str:
    """The Prometheus text (format 0.0.4) of :func:`metric_families`, written by ``prometheus_client``."""
    families = metric_families(samples, snapshot, allocations, counters=counters, source=source)
    return exposition(lambda: families)


def exposition(families: Callable[[], Iterable[Metric]]) -> str:
    """The families in the text format, through a private registry and the library's exposition."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FamiliesCollector(families))
    return generate_latest(registry).decode("utf-8")


class MetricsServer:
    """``GET /metrics`` by ``prometheus_client``'s HTTP server on a daemon thread.

    ``families`` is called for every scrape, through a collector in the server's own registry.
    Bind address defaults to 127.0.0.1 (loopback only); ``port=0`` picks a free port, readable
    from :attr:`port` after :meth:`start`.
    """

    def __init__(self, families: Callable[[], Iterable[Metric]], host: str = "127.0.0.1",
                 port: int = 9400) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(FamiliesCollector(families))
        self._host = host
        self._port = port
        self._server: Any = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The bound port (the requested one until started)."""
        return int(self._server.server_address[1]) if self._server else self._port

    def start(self) -> None:
        """Bind and serve in the background (OSError if the port is taken)."""
        self._server, self._thread = start_http_server(self._port, addr=self._host, registry=self.registry)

    def stop(self) -> None:
        """Stop serving and close the socket."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
