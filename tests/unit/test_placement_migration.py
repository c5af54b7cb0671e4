"""Migration between GPU types (pure): a job moves only when its throughput gain over the horizon
exceeds the restart cost, exchanges follow comparative advantage, and no plan over-commits."""

from __future__ import annotations

from collections import Counter

import pytest

from gpusched.model import DeviceShare, FleetSnapshot
from gpusched.node_builder import SIM_LAYOUT, make_node
from gpusched.placement import Policy, RunningTask
from gpusched.placement.migration import MigrationPlan, MigrationRequest, plan_migrations
from gpusched.quota.policy import QuotaState
from gpusched.request import GPURequest

NOW = 10_000.0
V100, K80 = "V100-SXM2-16GB", "K80"
# steps/s: "cnn" runs 4x faster on a V100; "rec" nearly as fast on a K80 (0.9).
POLICY = Policy.named("gpusched", throughput={"cnn": {V100: 4.0, K80: 1.0}, "rec": {V100: 1.0, K80: 0.9}})


def _fleet(v100: int, k80: int) -> FleetSnapshot:
    nodes = [make_node("v", V100, v100, layout=SIM_LAYOUT, cpu_milli=0, memory_bytes=0)] if v100 else []
    if k80:
        nodes.append(make_node("k", K80, k80, layout=SIM_LAYOUT, cpu_milli=0, memory_bytes=0))
    return FleetSnapshot(tuple(nodes))


def _on(node: str, index: int, key: str, *, started: float = NOW - 3600, model: str | None = None
        ) -> RunningTask:
    request = GPURequest.build(gpus=1, model=model) if model else GPURequest.build(gpus=1)
    share = DeviceShare(f"{node}/gpu{index}", node, index, 1000, 0)
    return RunningTask(key, request, (share,), started, None)


def _plan(fleet: FleetSnapshot, running: list[RunningTask], types: dict[str, str], **kw: object
          ) -> MigrationPlan:
    used = fleet.with_usage(s for r in running for s in r.shares)
    request = MigrationRequest(used, tuple(running), POLICY, NOW, QuotaState.unlimited(), job_types=types,
                               **kw)  # type: ignore[arg-type]
    return plan_migrations(request)


def _after(fleet: FleetSnapshot, running: list[RunningTask], plan: MigrationPlan) -> Counter[str]:
    """milli-GPU per device once the plan is applied."""
    moved = {m.key: m.placement for m in plan.moves}
    use: Counter[str] = Counter()
    for task in running:
        for share in moved.get(task.key, task.shares):
            use[share.uuid] += share.milli
    return use


def test_a_job_moves_to_a_free_faster_type_when_the_gain_exceeds_the_restart_cost() -> None:
    fleet = _fleet(1, 1)
    running = [_on("k", 0, "a")]
    plan = _plan(fleet, running, {"a": "cnn"}, restart_s=60.0, horizon_s=360.0)
    assert [(m.key, m.from_model, m.to_model) for m in plan.moves] == [("a", K80, V100)]
    assert plan.moves[0].placement[0].uuid == "v/gpu0"
    # gain = H·(n(V100) − n(K80)) − C·n(V100) = 360·(1 − 0.25) − 60·1 = 210 best-GPU-seconds
    assert plan.moves[0].gain == pytest.approx(210.0)


def test_no_move_when_the_restart_cost_exceeds_the_gain() -> None:
    fleet = _fleet(1, 1)
    # 360·0.75 = 270 s of work gained < 300 s lost to the restart
    assert _plan(fleet, [_on("k", 0, "a")], {"a": "cnn"}, restart_s=300.0).moves == ()
    # "rec" gains 360·(1 − 0.9) = 36 < 60
    assert _plan(fleet, [_on("k", 0, "b")], {"b": "rec"}, restart_s=60.0).moves == ()
    # the horizon is at most the expected remaining run: 30 s left on the K80 = 7.5 s on the V100;
    # after a 25 s restore it would end at 32.5 s, later than staying; after 20 s, sooner
    ending = RunningTask("a", GPURequest.build(gpus=1), _on("k", 0, "a").shares, NOW - 60, NOW + 30)
    assert _plan(fleet, [ending], {"a": "cnn"}, restart_s=25.0).moves == ()
    assert _plan(fleet, [ending], {"a": "cnn"}, restart_s=20.0).moves[0].gain == pytest.approx(2.5)


def test_exchange_gives_the_fast_type_to_the_job_that_gains_most() -> None:
    fleet = _fleet(1, 1)
    running = [_on("v", 0, "rec"), _on("k", 0, "cnn")]
    plan = _plan(fleet, running, {"rec": "rec", "cnn": "cnn"}, restart_s=60.0)
    assert {m.key: m.to_model for m in plan.moves} == {"cnn": V100, "rec": K80}
    # cnn: 360·0.75 − 60 = 210; rec: 360·(0.9 − 1) − 60·0.9 = −90; the pair gains 120 > 0
    assert plan.gain == pytest.approx(120.0)
    assert _after(fleet, running, plan) == {"v/gpu0": 1000, "k/gpu0": 1000}
    # Both of the same kind: nothing to gain by exchanging them.
    same = [_on("v", 0, "x"), _on("k", 0, "y")]
    assert _plan(fleet, same, {"x": "cnn", "y": "cnn"}).moves == ()


def test_a_plan_never_over_commits_and_the_largest_gain_wins_the_free_device() -> None:
    fleet = _fleet(1, 3)
    running = [_on("k", 0, "r0"), _on("k", 1, "c1"), _on("k", 2, "c2")]
    plan = _plan(fleet, running, {"r0": "rec", "c1": "cnn", "c2": "cnn"}, restart_s=60.0)
    assert len(plan.moves) == 1 and plan.moves[0].key in {"c1", "c2"} and plan.moves[0].to_model == V100
    assert max(_after(fleet, running, plan).values()) == 1000


def test_a_moved_fleet_is_stable_nothing_moves_back() -> None:
    fleet = _fleet(2, 2)
    running = [_on("v", 0, "r0"), _on("v", 1, "r1"), _on("k", 0, "c0"), _on("k", 1, "c1")]
    types = {"r0": "rec", "r1": "rec", "c0": "cnn", "c1": "cnn"}
    plan = _plan(fleet, running, types, restart_s=30.0)
    assert {m.key for m in plan.moves} == set(types)
    moved = {m.key: m.placement for m in plan.moves}
    again = [RunningTask(r.key, r.request, moved[r.key], NOW, None) for r in running]
    assert _plan(fleet, again, types, restart_s=30.0).moves == ()


def test_multi_device_pinned_protected_and_young_tasks_stay() -> None:
    fleet = _fleet(2, 2)
    pair = RunningTask("pair", GPURequest.build(gpus=2), tuple(
        DeviceShare(f"k/gpu{i}", "k", i, 1000, 0) for i in (0, 1)), NOW - 3600, None)
    assert _plan(fleet, [pair], {"pair": "cnn"}).moves == ()
    pinned = _on("k", 0, "p", model="K80")
    assert _plan(fleet, [pinned], {"p": "cnn"}).moves == ()
    assert _plan(fleet, [_on("k", 0, "a")], {"a": "cnn"}, protected=frozenset({"a"})).moves == ()
    young = _on("k", 0, "a", started=NOW - 10)
    assert _plan(fleet, [young], {"a": "cnn"}, min_runtime_s=60.0).moves == ()


def test_bad_costs_are_refused() -> None:
    fleet = _fleet(1, 1)
    with pytest.raises(ValueError, match="restart cost"):
        MigrationRequest(fleet, (), POLICY, NOW, QuotaState.unlimited(), restart_s=-1.0)
    with pytest.raises(ValueError, match="horizon"):
        MigrationRequest(fleet, (), POLICY, NOW, QuotaState.unlimited(), horizon_s=0.0)


def test_by_age_a_job_that_has_run_long_pays_a_restart_longer_than_a_round() -> None:
    fleet = _fleet(1, 1)
    old = _on("k", 0, "a", started=NOW - 3600)
    # one round: 360·0.75 − 300 = −30, no move; by age: 3600·0.75 − 300 = 2400
    assert _plan(fleet, [old], {"a": "cnn"}, restart_s=300.0).moves == ()
    plan = _plan(fleet, [old], {"a": "cnn"}, restart_s=300.0, by_age=True)
    assert plan.moves[0].gain == pytest.approx(2400.0)
    # the attained run time counts earlier runs too; a young job still gets one round at least
    young = _on("k", 0, "a", started=NOW - 10)
    assert _plan(fleet, [young], {"a": "cnn"}, restart_s=300.0, by_age=True).moves == ()
    assert _plan(fleet, [young], {"a": "cnn"}, restart_s=300.0, by_age=True, attained={"a": 7200.0}).moves
