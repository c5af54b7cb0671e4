"""Quotas: partition shares with borrowing, tenant budgets in A100-equivalent GPU-hours."""

from __future__ import annotations

import pytest

from gpusched.capacity import standby_rules
from gpusched.errors import ConfigurationError
from gpusched.model import MILLI, DeviceShare, FleetSnapshot
from gpusched.node_builder import make_node
from gpusched.placement import PendingTask, PlacementRequest, Policy, RunningTask, place
from gpusched.quota.policy import (
    UNITS_PER_A100_HOUR,
    QuotaPolicy,
    QuotaState,
    check,
    check_budget,
    check_partition,
    normalised_rate,
    partition_capacity,
    usable_gpus,
)
from gpusched.request import GPURequest, Partition

CAP = 10 * MILLI  # ten GPUs: shares 7 / 2 / 1


def test_partition_within_share_is_allowed() -> None:
    policy = QuotaPolicy(borrowing=False)
    used = {Partition.TRAINING: 5 * MILLI}
    assert check_partition(policy, Partition.TRAINING, 2 * MILLI, used, CAP).allowed
    verdict = check_partition(policy, Partition.TRAINING, 3 * MILLI, used, CAP)
    assert not verdict.allowed
    assert "partition 'training' uses 5 of its 70% share (7 of 10 GPUs)" in verdict.reason
    assert "borrowing is off" in verdict.reason


def test_borrowing_idle_capacity_but_not_what_waiting_tasks_need() -> None:
    policy = QuotaPolicy()
    used = {Partition.DEV: MILLI}
    verdict = check_partition(policy, Partition.DEV, 2 * MILLI, used, CAP)
    assert verdict.allowed and verdict.borrowed_milli == 2 * MILLI
    # Training has 7 GPUs of pending demand within its share: dev may borrow only what is left.
    pending = {Partition.TRAINING: 7 * MILLI}
    assert check_partition(policy, Partition.DEV, 2 * MILLI, used, CAP, pending).allowed
    refused = check_partition(policy, Partition.DEV, 3 * MILLI, used, CAP, pending)
    assert not refused.allowed and "kept for other partitions' waiting tasks" in refused.reason


def test_shares_are_configurable_and_validated() -> None:
    policy = QuotaPolicy.from_dict({"shares": {"training": 50, "burst": 30, "dev": 20}, "borrowing": False})
    assert policy.share_milli(Partition.BURST, CAP) == 3 * MILLI
    with pytest.raises(ConfigurationError, match="summing to 100"):
        QuotaPolicy(shares_pct={Partition.TRAINING: 80, Partition.BURST: 20, Partition.DEV: 10})
    with pytest.raises(ConfigurationError, match="unknown quota setting"):
        QuotaPolicy.from_dict({"share": {}})


def test_budget_in_a100_equivalent_hours() -> None:
    snap = FleetSnapshot((make_node("h", "H100-SXM-80GB", 1), make_node("t", "T4", 1)))
    h100 = DeviceShare("h-gpu0", "h", 0, MILLI, 0)
    t4 = DeviceShare("t-gpu0", "t", 0, MILLI, 0)
    assert normalised_rate([h100], snap) == 2500  # an H100 hour costs 2.5 A100-hours
    assert normalised_rate([t4], snap) == 200
    state = QuotaState(QuotaPolicy(budgets_hours={"vision": 10}), used={"vision": 6 * UNITS_PER_A100_HOUR})
    one_h100_hour = normalised_rate([h100], snap) * 3600
    assert check_budget(state, "vision", one_h100_hour).allowed
    verdict = check_budget(state, "vision", one_h100_hour, committed=2 * UNITS_PER_A100_HOUR)
    assert not verdict.allowed and not verdict.permanent
    assert "used 6.0 of 10.0 A100-h" in verdict.reason and "+2.0 committed" in verdict.reason
    assert "needs ~2.5" in verdict.reason and "resets " in verdict.reason
    assert check_budget(state, "vision", 11 * UNITS_PER_A100_HOUR).permanent
    assert check_budget(state, "unlisted", 10**15).allowed  # no default budget = unlimited


def test_check_combines_budget_and_partition() -> None:
    state = QuotaState(QuotaPolicy(budgets_hours={"a": 1}, borrowing=False))
    req = GPURequest.build(gpus=2, tenant="a", partition="dev")
    verdict = check(req, state, cost=UNITS_PER_A100_HOUR // 2, partition_used={}, capacity_milli=CAP)
    assert not verdict.allowed and "partition 'dev'" in verdict.reason
    verdict = check(req, state, cost=2 * UNITS_PER_A100_HOUR, partition_used={}, capacity_milli=CAP)
    assert not verdict.allowed and "tenant a used 0.0 of 1.0 A100-h" in verdict.reason


def _fleet() -> FleetSnapshot:
    return FleetSnapshot(tuple(make_node(f"n{i}", "A100-PCIE-40GB", 2) for i in range(5)))  # 10 GPUs

GPUSCHED = Policy.named("gpusched")


def _task(key: str, partition: str, gpus: int = 1, **kw: object) -> PendingTask:
    return PendingTask(key, GPURequest.build(gpus=gpus, partition=partition, **kw), 0.0)


def test_engine_enforces_70_20_10_without_borrowing() -> None:
    snap = _fleet()
    assert partition_capacity(snap) == CAP
    quota = QuotaState(QuotaPolicy(borrowing=False))
    pending = [_task(f"dev{i}", "dev") for i in range(3)] + [_task(f"burst{i}", "burst") for i in range(3)]
    plan = place(PlacementRequest(pending=pending, snapshot=snap, policy=GPUSCHED, now=0.0, quota=quota))
    placed = sorted(a.key for a in plan.assignments)
    assert placed == ["burst0", "burst1", "dev0"]
    assert all("share" in r.reason for r in plan.rejections)


def test_nodes_left_out_for_busy_worker_slots_keep_their_share_of_the_partitions() -> None:
    from dataclasses import replace

    # n0–n2 are on hosts whose Celery slots are all busy: closed in this cycle's snapshot (no new
    # work there), but still capacity the partitions split (10 GPUs: dev's share is 1, burst's 2).
    snap = _fleet()
    busy = snap.with_closed(n.name for n in snap.nodes[:3])
    assert partition_capacity(busy) == CAP
    pending = [_task(f"burst{i}", "burst") for i in range(3)]
    quota = QuotaState(QuotaPolicy(borrowing=False))
    plan = place(PlacementRequest(pending=pending, snapshot=busy, policy=GPUSCHED, now=0.0, quota=quota))
    assert sorted(a.key for a in plan.assignments) == ["burst0", "burst1"]
    assert {s.node for a in plan.assignments for s in a.shares} <= {"n3", "n4"}
    # Cordoned instead (out of service), they would shrink the partitions: 20 % of the 4 GPUs
    # left is not one whole GPU.
    cordoned = snap.with_nodes([replace(n, cordoned=True) for n in snap.nodes[:3]])
    plan = place(PlacementRequest(pending=pending, snapshot=cordoned, policy=GPUSCHED, now=0.0, quota=quota))
    assert len(plan.assignments) == 0


def test_engine_borrows_idle_capacity_for_a_busy_partition() -> None:
    snap = _fleet()
    quota = QuotaState(QuotaPolicy())
    pending = [_task(f"dev{i}", "dev") for i in range(4)]
    plan = place(PlacementRequest(pending=pending, snapshot=snap, policy=GPUSCHED, now=0.0, quota=quota))
    assert len(plan.assignments) == 4  # 1 own + 3 borrowed: nobody else waits
    # With training work waiting for its 7 GPUs, dev may borrow only the 2 idle burst GPUs.
    pending += [_task(f"train{i}", "training", priority="low") for i in range(7)]
    plan = place(PlacementRequest(pending=pending, snapshot=snap, policy=GPUSCHED, now=0.0, quota=quota))
    placed = {a.key for a in plan.assignments}
    assert sum(k.startswith("dev") for k in placed) == 3
    assert sum(k.startswith("train") for k in placed) == 7


def test_engine_counts_running_tasks_against_partitions_and_budgets() -> None:
    snap = _fleet()
    shares = tuple(
        DeviceShare(d.uuid, d.node, d.index, MILLI, d.memory_bytes) for d in snap.node("n0").devices
    )
    running = [RunningTask("r", GPURequest.build(gpus=2, tenant="a"), shares, 0.0, 3600.0)]
    snap = snap.with_usage(shares)
    # Budget 2 A100-hours; the running task still needs 2 × 0.9 × 1 h = 1.8: one more hour of an
    # A100-40GB (0.9) does not fit.
    quota = QuotaState(QuotaPolicy(budgets_hours={"a": 2}))
    task = _task("t", "training", tenant="a", expected_duration="1h")
    plan = place(PlacementRequest(pending=[task], snapshot=snap, policy=GPUSCHED, now=0.0, quota=quota,
                                 running=running))
    assert not plan.assignments
    assert "used 0.0 of 2.0 A100-h this period (+1.8 committed" in plan.rejections[0].reason
    plan = place(PlacementRequest(pending=[task], snapshot=snap, policy=GPUSCHED, now=3000.0, quota=quota,
                                 running=running))
    assert plan.assignments


def test_running_tasks_on_devices_gone_from_the_fleet_are_tolerated() -> None:
    snap = _fleet()
    ghost = (DeviceShare("gone-gpu0", "gone", 0, MILLI, 0),)
    running = [RunningTask("r", GPURequest.build(gpus=1, tenant="a"), ghost, 0.0, 3600.0, cpu_milli=1000)]
    assert normalised_rate(ghost, snap) == MILLI
    quota = QuotaState(QuotaPolicy(budgets_hours={"a": 5}))
    plan = place(PlacementRequest(pending=[_task("t", "training", tenant="a")], snapshot=snap,
                                  policy=GPUSCHED, now=0.0, running=running, quota=quota))
    assert plan.assignments


def test_over_budget_setting_is_checked() -> None:
    from gpusched.errors import ConfigurationError
    from gpusched.scheduler.quota import over_budget_action

    class Conf:
        def __init__(self, value: str | None) -> None:
            self.value = value

        def get(self, section: str, name: str, fallback: str) -> str:
            return fallback if self.value is None else self.value

    assert over_budget_action(Conf(None)) == "finish" and over_budget_action(Conf(" Stop ")) == "stop"
    with pytest.raises(ConfigurationError, match="over_budget = 'kill' is not finish or stop"):
        over_budget_action(Conf("kill"))


def test_budgets_may_be_fractions_of_an_hour_and_a_wrong_one_is_named() -> None:
    from gpusched.quota.policy import hours

    policy = QuotaPolicy.from_dict({"budgets": {"vision": 0.01, "nlp": "2.5"}, "default_budget": 0.5})
    assert policy.budget("vision") == 36 * 1000  # 36 A100-seconds, not truncated to nothing
    assert (policy.budget("nlp"), policy.budget("other")) == (9000 * 1000, 1800 * 1000)
    assert (hours(36 * 1000), hours(1800 * 1000), hours(45_000 * 1000)) == ("0.01", "0.5", "12.5")
    wrong = r"quota budgets\.vision: 'lots' is not a number of GPU-hours"
    with pytest.raises(ConfigurationError, match=wrong):
        QuotaPolicy.from_dict({"budgets": {"vision": "lots"}})


def test_the_burst_reserve_keeps_gpus_free_for_burst_work_in_the_executors_placement() -> None:
    """Before: a forecast plan's burst reserve was read only by the pre-scaling simulation and the
    agent's scale-in; the executors' placement let training work take the reserved GPUs."""
    snap = _fleet()
    training = [_task(f"train{i}", "training") for i in range(10)]
    plan = place(PlacementRequest(pending=training, snapshot=snap, policy=GPUSCHED, now=0.0,
                                  quota=QuotaState(QuotaPolicy())))
    assert len(plan.assignments) == 10  # no reserve: training borrows every idle GPU
    quota = QuotaState(QuotaPolicy(), burst_reserve_gpus=2)
    plan = place(PlacementRequest(pending=training, snapshot=snap, policy=GPUSCHED, now=0.0, quota=quota))
    assert len(plan.assignments) == 8  # 10 GPUs less the 2 kept for burst work
    assert {r.permanent for r in plan.rejections} == {False}
    assert all("burst reserve keeps 2 GPU(s)" in r.reason for r in plan.rejections), plan.rejections
    # Burst work may take every free GPU, the reserved ones included.
    burst = [_task(f"burst{i}", "burst") for i in range(10)]
    plan = place(PlacementRequest(pending=burst, snapshot=snap, policy=GPUSCHED, now=0.0, quota=quota))
    assert len(plan.assignments) == 10
    assert standby_rules.usable_gpus is usable_gpus  # the standby rules' rule: one definition
    # Without a quota file nothing is enforced, the reserve neither.
    plan = place(PlacementRequest(pending=training, snapshot=snap, policy=GPUSCHED, now=0.0,
                                  quota=QuotaState.unlimited()))
    assert len(plan.assignments) == 10
