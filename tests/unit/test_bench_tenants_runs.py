"""The tenants harness measures a restarted job's use over its runs, not the wait in between."""

from __future__ import annotations

from gpusched.bench.tenants_measure import partition_rows, tenant_rows
from gpusched.model import DeviceShare
from gpusched.quota.policy import QuotaPolicy
from gpusched.request import GPURequest, Partition
from gpusched.sim.engine import SimJob
from gpusched.sim.fleets import uniform_fleet
from gpusched.sim.results import JobRecord, SimResult, TimelinePoint

WEEK = 7 * 86400


def test_a_preempted_jobs_wait_is_neither_budget_use_nor_partition_use() -> None:
    fleet = uniform_fleet(1, 8, "P100")  # P100 = 0.25 A100
    device = next(iter(fleet.devices()))
    shares = (DeviceShare(device.uuid, device.node, device.index, 1000, 0),)
    job = SimJob("j", GPURequest(count=1, tenant="a", partition=Partition.DEV), 0.0, 7200.0)
    # ran 0-1 h, waited 1-2 h (preempted), ran 2-3 h
    record = JobRecord("j", 0.0, 0.0, 10_800.0, shares, ("P100",), 1,
                       runs=((0.0, 3600.0, shares), (7200.0, 10_800.0, shares)))
    result = SimResult("gpusched", fleet, [record], {}, [], [TimelinePoint(0.0, 0, 0)], 8000, 10_800.0)
    policy = QuotaPolicy(budgets_hours={"a": 1}, period_s=WEEK)
    rows = tenant_rows(result, {"j": job}, policy, {"a": 0.5}, {"a": 0.5}, 0.0)
    assert rows["a"]["worst_period_gpu_hours"] == 0.5  # 2 GPU-h × 0.25, not 3 × 0.25
    parts = partition_rows(result, {"j": job}, policy, 0.0, 10_800.0)
    assert parts["dev"]["gpu_hours"] == 2.0
