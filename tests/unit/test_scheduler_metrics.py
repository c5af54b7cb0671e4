"""The scheduler's metrics: reason kinds from the reasons the producers write, the families a
scrape reads (decision histogram, waiting tasks by kind, holds, preemptions, moves, lost hosts,
budget use), and the endpoint ``[gpusched] metrics_port`` starts."""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass
from typing import Any

import pytest
from _placement_support import no_quota
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpusched.airflow.scheduler_metrics import (
    REASON_KINDS,
    SchedulerMetrics,
    reason_kind,
    serve,
    stop_serving,
)
from gpusched.catalog import Vendor
from gpusched.deploy.airflow_instance import free_port
from gpusched.ledger import Allocation
from gpusched.model import Device, DeviceShare, FleetSnapshot, Node
from gpusched.placement import PendingTask, Policy, place
from gpusched.placement.reasons import host_reason
from gpusched.quota.policy import QuotaPolicy, QuotaState, check_budget
from gpusched.request import GPURequest
from gpusched.scheduler.cycle import CycleReply, Hold, Launch
from gpusched.scheduler.hosts import slot_full_reason

GIB = 2**30
H100 = Device("GPU-a", 0, "n1", "H100-SXM-80GB", Vendor.NVIDIA, "sm_90", 80 * GIB)


def _fleet() -> FleetSnapshot:
    return FleetSnapshot((Node("n1", "rack", (H100,)),), source="simulated")


def _families(metrics: SchedulerMetrics, now: float) -> dict[str, Any]:
    registry = CollectorRegistry(auto_describe=False)

    class _One:
        def collect(self) -> Any:
            return metrics.families(now)

    registry.register(_One())  # type: ignore[arg-type]
    text = generate_latest(registry).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def _values(family: Any, suffix: str = "") -> dict[str, float]:
    def label(labels: dict[str, str]) -> str:
        return next(iter(labels.values()), "")  # each family has at most one label

    return {label(s.labels): s.value for s in family.samples if s.name == family.name + suffix}


def test_reason_kinds_of_the_reasons_the_producers_write() -> None:
    busy = _fleet().with_usage([DeviceShare("GPU-a", "n1", 0, 1000, 0)])
    policy = Policy.configured("gpusched")
    plan = place(no_quota([PendingTask("k", GPURequest.build(gpus=1), 0.0)], busy, policy, now=0.0))
    (rejection,) = plan.rejections
    assert reason_kind(Hold("k", rejection.reason, rejection.permanent)) == "capacity"
    big = place(no_quota([PendingTask("k", GPURequest.build(gpus=4), 0.0)], _fleet(),
                         policy, now=0.0)).rejections[0]
    assert big.permanent and reason_kind(Hold("k", big.reason, True)) == "never_fits"
    state = QuotaState(QuotaPolicy(budgets_hours={"vision": 1.0}), {"vision": 10**12}, 0.0)
    verdict = check_budget(state, "vision", 10)
    assert not verdict.allowed and reason_kind(Hold("k", verdict.reason)) == "quota"
    task = PendingTask("k", GPURequest.build(gpus=1), 0.0, cpu_milli=200_000)
    assert reason_kind(Hold("k", host_reason(task.request, task, False))) == "host_resources"
    slots = f"{rejection.reason}; {slot_full_reason('host-a', 8, 8)}"
    assert reason_kind(Hold("k", slots)) == "worker_slots"
    assert reason_kind(Hold("k", "fits, but waits behind earlier work (strict FIFO)",
                            queued_behind=True)) == "queued_behind"
    assert reason_kind(Hold("k", "multi-node gang g: 1 of 2 members queued; waiting for the rest")) == "gang"
    assert reason_kind(Hold("k", "waiting for preempted dag/low/run to stop")) == "preemption"
    assert reason_kind(Hold("k", f"{big.reason}; GPU host(s) h lost: waiting for them to come back")) \
        == "host_unavailable"
    assert reason_kind(Hold("k", "GPU host h is lost; waiting for its agent")) == "host_unavailable"
    assert reason_kind(Hold("k", "cannot expose the chosen devices: no UUID")) == "other"
    assert set(REASON_KINDS) >= {"capacity", "quota", "other"}


def test_a_cycle_shows_its_decision_time_its_waiting_tasks_and_new_holds() -> None:
    metrics = SchedulerMetrics(clock=lambda: 1000.0)
    launch = Launch("k0", GPURequest.build(gpus=1), (), {})
    capacity = Hold("k1", "waiting for 1 GPU: 1 matching devices in service, 1 busy")
    metrics.decided(0.03, CycleReply((launch,), (capacity,)))
    metrics.held(capacity, 400.0, None)
    metrics.held(Hold("k2", "tenant t used 2.0 of 1.0 A100-h this week; resets Mon"), 900.0, None)
    metrics.cycle_done()
    metrics.decided(2.0, CycleReply((), (capacity,)))
    metrics.held(capacity, 400.0, capacity.reason)  # the same reason again: no new hold
    metrics.cycle_done()
    families = _families(metrics, now=1000.0)
    decision = families["gpusched_scheduler_decision_seconds"]
    buckets = {s.labels["le"]: s.value for s in decision.samples if s.name.endswith("_bucket")}
    assert buckets["0.025"] == 0 and buckets["0.05"] == 1 and buckets["2.5"] == 2 and buckets["+Inf"] == 2
    assert _values(decision, "_count") == {"": 2} and _values(decision, "_sum") == {"": 2.03}
    assert _values(families["gpusched_scheduler_placements"], "_total") == {"": 1}
    pending = _values(families["gpusched_scheduler_pending_tasks"])
    assert set(pending) == set(REASON_KINDS) and pending["capacity"] == 1 and sum(pending.values()) == 1
    assert _values(families["gpusched_scheduler_oldest_wait_seconds"])["capacity"] == 600.0
    holds = _values(families["gpusched_scheduler_holds"], "_total")
    assert holds["capacity"] == 1 and holds["quota"] == 1 and sum(holds.values()) == 2
    metrics.periodic(_Ledger([]), waiting_gpu_work=False, now=1000.0)  # nothing queued any more
    assert sum(_values(_families(metrics, 1000.0)["gpusched_scheduler_pending_tasks"]).values()) == 0


@dataclass
class _Host:
    name: str
    state: str


@dataclass
class _Eviction:
    notice_at: float


def test_preemptions_moves_and_lost_hosts_are_counted_once() -> None:
    metrics = SchedulerMetrics(clock=lambda: 100.0)
    metrics.preempted(set(), {"restored": _Eviction(50.0), "new": _Eviction(120.0)})
    metrics.preempted({"restored", "new"}, {"restored": _Eviction(50.0), "new": _Eviction(120.0)})
    metrics.migrated([object(), object()])
    metrics.migrated(None)  # the round failed (logged by the ledger guard)
    live = [_Host("a", "live"), _Host("b", "live")]
    metrics.hosts_judged(live, [_Host("a", "lost"), _Host("b", "unconfirmed")])
    metrics.hosts_judged([_Host("a", "lost")], [_Host("a", "lost"), _Host("b", "live")])  # still lost
    families = _families(metrics, 130.0)
    assert _values(families["gpusched_scheduler_preemptions"], "_total") == {"": 1}
    assert _values(families["gpusched_scheduler_migrations"], "_total") == {"": 2}
    assert _values(families["gpusched_scheduler_hosts_lost"], "_total") == {"": 1}
    hosts = {"live": 1, "lost": 1, "unconfirmed": 0, "standby": 0}
    assert _values(families["gpusched_scheduler_gpu_hosts"]) == hosts


class _Ledger:
    def __init__(self, allocations: list[Allocation]) -> None:
        self.allocations = allocations
        self.reads = 0

    def history(self, since: float, until: float) -> list[Allocation]:
        self.reads += 1
        return self.allocations

    def snapshot(self, now: float) -> FleetSnapshot:
        return _fleet()


def test_gpu_hours_by_tenant_and_partition_are_read_once_a_minute(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUSCHED_QUOTA_FILE", "/nonexistent/quota.yaml")  # the default 30-day period
    now = 10 * 86400.0  # a Monday-aligned period holds the last two hours
    share = DeviceShare("GPU-a", "n1", 0, 1000, 0)
    alloc = Allocation("k", GPURequest.build(gpus=1, tenant="vision", partition="burst"), (share,), "h",
                       now - 7200, now + 600, released_at=now - 3600)
    ledger = _Ledger([alloc])
    metrics = SchedulerMetrics(clock=lambda: now)
    metrics.periodic(ledger, waiting_gpu_work=True, now=now)
    assert ledger.reads == 0  # not served ([gpusched] metrics_port = 0): the ledger is not read for it
    metrics.served = True
    metrics.periodic(ledger, waiting_gpu_work=True, now=now)
    metrics.periodic(ledger, waiting_gpu_work=True, now=now + 30)
    assert ledger.reads == 1
    families = _families(metrics, now)
    tenants = _values(families["gpusched_scheduler_tenant_gpu_hours"])
    assert set(tenants) == {"vision"} and tenants["vision"] > 1.0  # an H100 counts more than an A100
    partitions = _values(families["gpusched_scheduler_partition_gpu_hours"])
    assert partitions == {"training": 0, "burst": 1.0, "dev": 0}


class _Conf:
    def __init__(self, **values: str) -> None:
        self.values = values

    def get(self, section: str, key: str, fallback: str = "") -> str:
        return self.values.get(key, fallback)


class _Log:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def info(self, msg: str, *args: Any) -> None:
        self.lines.append(msg % args)

    error = info


def test_metrics_port_zero_serves_nothing_and_a_port_serves_every_executor_of_the_process() -> None:
    log = _Log()
    assert serve(SchedulerMetrics(), _Conf(), log) is None and log.lines == []
    port = free_port()
    one, two = SchedulerMetrics(), SchedulerMetrics()
    one.decided(0.01, CycleReply((), ()))
    two.decided(0.01, CycleReply((), ()))
    endpoint = serve(one, _Conf(metrics_port=str(port)), log)
    assert endpoint is not None and endpoint.host == "127.0.0.1" and endpoint.port == port
    try:
        assert serve(two, _Conf(metrics_port=str(port)), log) is endpoint  # shared, not a second bind
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
        assert "gpusched_scheduler_decision_seconds_count 2.0" in text
        assert 'gpusched_scheduler_pending_tasks{reason="capacity"} 0.0' in text
        assert log.lines == [f"gpusched: scheduler metrics on http://127.0.0.1:{port}/metrics"]
    finally:
        stop_serving(one)
        stop_serving(two)
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
