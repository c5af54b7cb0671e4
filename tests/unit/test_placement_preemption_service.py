"""Preemption mode ``service`` (pure): victims by a lower expected-service index beyond the margin,
never an equal or higher one nor higher priority; the fit proven, nothing over-committed; the
queue ordered by rank (``QueueOrder.RANKED``)."""

from __future__ import annotations

from collections import Counter

import pytest

from gpusched.model import DeviceShare, FleetSnapshot
from gpusched.node_builder import make_node
from gpusched.placement import PendingTask, PlacementRequest, Policy, RunningTask, place
from gpusched.placement.policy import QueueOrder
from gpusched.placement.preemption import NoPreemption, PreemptionPlan, PreemptionRequest, select_victims
from gpusched.quota.policy import QuotaState
from gpusched.request import GPURequest

NOW = 10_000.0
FLEET = FleetSnapshot((make_node("n0", "A100-SXM-80GB", 4),))


def _running(key: str, indexes: list[int], *, priority: str = "normal",
             started: float = NOW - 3600) -> RunningTask:
    shares = tuple(DeviceShare(f"n0-gpu{i}", "n0", i, 1000, 0) for i in indexes)
    return RunningTask(key, GPURequest.build(gpus=len(indexes), priority=priority), shares, started, None)


def _select(running: list[RunningTask], indices: dict[str, float], *, gpus: int = 2, priority: str = "normal",
            **kw: object) -> PreemptionPlan | NoPreemption:
    waiting = PendingTask("w", GPURequest.build(gpus=gpus, priority=priority), NOW - 5)
    used = FLEET.with_usage(s for r in running for s in r.shares)
    fields: dict[str, object] = {"mode": "service", "min_runtime_s": 60.0, "indices": indices}
    fields.update(kw)
    return select_victims(PreemptionRequest((waiting,), used, tuple(running), Policy.named("gpusched"), NOW,
                                            QuotaState.unlimited(), **fields))  # type: ignore[arg-type]


def test_a_running_task_of_much_lower_index_is_preempted_and_the_fit_is_proven() -> None:
    running = [_running("long", [0, 1]), _running("short", [2, 3])]
    plan = _select(running, {"w": 1e-2, "long": 1e-5, "short": 8e-3})
    assert isinstance(plan, PreemptionPlan), plan
    assert [v.key for v in plan.victims] == ["long"]
    assert "expected-service index 1e-05" in plan.victims[0].reason
    # No over-commit: the waiting task gets exactly the victim's devices, and every device holds
    # at most one whole-GPU task after the swap.
    assert {s.uuid for s in plan.placement["w"]} == {"n0-gpu0", "n0-gpu1"}
    after = Counter(s.uuid for r in running if r.key != "long" for s in r.shares)
    after.update(s.uuid for s in plan.placement["w"])
    assert max(after.values()) == 1


@pytest.mark.parametrize("victim_index", [1e-2, 5e-3, 2e-2])
def test_never_an_equal_higher_or_within_margin_index(victim_index: float) -> None:
    # 1e-2 equal, 5e-3 exactly half (not strictly beyond the 2× margin), 2e-2 higher.
    running = [_running("a", [0, 1]), _running("b", [2, 3])]
    outcome = _select(running, {"w": 1e-2, "a": victim_index, "b": victim_index})
    assert isinstance(outcome, NoPreemption)
    assert "lower expected-service index" in outcome.reason


def test_higher_priority_young_and_unranked_tasks_are_never_victims() -> None:
    running = [_running("vip", [0, 1], priority="high"), _running("young", [2, 3], started=NOW - 30)]
    assert isinstance(_select(running, {"w": 1.0, "vip": 1e-9, "young": 1e-9}), NoPreemption)
    unranked = [_running("x", [0, 1]), _running("y", [2, 3])]
    assert isinstance(_select(unranked, {"w": 1.0}), NoPreemption)
    # Lower priority stays a victim whatever its index (as in mode priority).
    low = [_running("low", [0, 1], priority="low"), _running("y", [2, 3])]
    plan = _select(low, {"w": 1e-6, "low": 1.0, "y": 1.0})
    assert isinstance(plan, PreemptionPlan) and [v.key for v in plan.victims] == ["low"]


def test_too_few_preemptible_devices_means_no_plan() -> None:
    running = [_running("long", [0, 1]), _running("short", [2, 3])]
    outcome = _select(running, {"w": 1e-2, "long": 1e-5, "short": 1e-2}, gpus=4)
    assert isinstance(outcome, NoPreemption) and "would still not make room" in outcome.reason


def test_ranked_queue_order_follows_the_rank_with_aging() -> None:
    policy = Policy.named("gpusched", queue_order=QueueOrder.RANKED)
    one = GPURequest.build(gpus=1)
    full = FLEET.with_usage(DeviceShare(f"n0-gpu{i}", "n0", i, 1000, 0) for i in range(3))
    first = PendingTask("first", one, NOW - 10, rank=5.0)
    second = PendingTask("second", one, NOW - 5, rank=1.0)
    plan = place(PlacementRequest(pending=[first, second], snapshot=full, policy=policy, now=NOW,
                                 quota=QuotaState.unlimited()))
    assert [a.key for a in plan.assignments] == ["second"]
    # Five days of waiting take five off the rank (aging: each day doubles the index).
    old = PendingTask("first", one, NOW - 5 * 86_400 - 10, rank=5.0)
    plan = place(PlacementRequest(pending=[old, second], snapshot=full, policy=policy, now=NOW,
                                 quota=QuotaState.unlimited()))
    assert [a.key for a in plan.assignments] == ["first"]
