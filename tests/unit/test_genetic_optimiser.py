"""The DEAP batch optimiser: never worse than greedy, feasible plans, budget, determinism."""

from __future__ import annotations

from collections import defaultdict

import pytest
from _placement_support import no_quota

from gpusched.catalog import arch_rank, default_catalog
from gpusched.model import MILLI, FleetSnapshot
from gpusched.placement import PendingTask, PlacementPlan, Policy, place
from gpusched.placement.genetic import optimise, optimise_with_report, plan_objective
from gpusched.request import GPURequest, Interconnect
from gpusched.testing import synthetic_fleet, synthetic_requests

NOW = 10_000.0


@pytest.fixture(scope="module")
def fleet() -> FleetSnapshot:
    return synthetic_fleet(24, seed=3, used_fraction=0.5)


@pytest.fixture(scope="module")
def pending() -> list[PendingTask]:
    tasks = synthetic_requests(40, seed=5, start=NOW - 3600)
    # Constraints the optimiser must keep: a minimum architecture and a big-memory fraction.
    tasks.append(PendingTask("arch", GPURequest.build(gpus=1, min_arch="sm_90"), NOW - 60))
    tasks.append(PendingTask("mem", GPURequest.build(gpus=0.5, memory="60GiB", vendor="nvidia"), NOW - 60))
    return tasks


def _check_feasible(plan: PlacementPlan, pending: list[PendingTask], fleet: FleetSnapshot) -> None:
    keys = [a.key for a in plan.assignments] + [r.key for r in plan.rejections]
    assert sorted(keys) == sorted(t.key for t in pending), "every key exactly once"
    by_key = {t.key: t.request for t in pending}
    milli: dict[str, int] = defaultdict(int)
    memory: dict[str, int] = defaultdict(int)
    catalog = default_catalog()
    for a in plan.assignments:
        req = by_key[a.key]
        assert len(a.shares) == req.count
        assert len({s.uuid for s in a.shares}) == req.count
        nodes = {s.node for s in a.shares}
        if req.interconnect in (Interconnect.SAME_NODE, Interconnect.SAME_NUMA, Interconnect.ISLAND):
            assert len(nodes) == 1, f"{a.key} spans nodes {nodes}"
        if req.interconnect is Interconnect.ISLAND and req.count > 1:
            assert len({fleet.device(s.uuid).island for s in a.shares}) == 1
        for s in a.shares:
            dev = fleet.device(s.uuid)
            assert not fleet.node(dev.node).standby
            if req.vendors:
                assert dev.vendor in req.vendors
            if req.min_arch:
                assert arch_rank(catalog.get(dev.model).architecture) >= arch_rank(req.min_arch)
                assert dev.architecture.startswith(req.min_arch[:3])
            if req.memory_per_gpu:
                assert dev.memory_bytes >= req.memory_per_gpu
            milli[s.uuid] += s.milli
            memory[s.uuid] += s.memory_bytes
    for uuid, used in milli.items():
        assert fleet.used(uuid).used_milli + used <= MILLI, f"{uuid} double-booked"
        assert fleet.used(uuid).used_memory_bytes + memory[uuid] <= fleet.device(uuid).memory_bytes


def test_never_worse_than_greedy_and_feasible(fleet: FleetSnapshot, pending: list[PendingTask]) -> None:
    policy = Policy.named("gpusched")
    greedy = place(no_quota(pending, fleet, policy, now=NOW))
    for seed in (0, 1, 2):
        result = optimise_with_report(no_quota(pending, fleet, policy, now=NOW, seed=seed), budget_ms=5_000,
                                      max_generations=15, greedy=greedy)
        _check_feasible(result.plan, pending, fleet)
        value = plan_objective(result.plan, pending, fleet, policy, now=NOW)
        base = plan_objective(greedy, pending, fleet, policy, now=NOW)
        assert result.greedy_objective == pytest.approx(base)
        assert value <= base + 1e-9
        assert result.objective == pytest.approx(value)
        assert result.generations == 15 and result.evaluations > 0
        if not result.improved:
            assert result.plan is greedy


def test_optimiser_improves_on_a_poor_warm_start(
    fleet: FleetSnapshot, pending: list[PendingTask]
) -> None:
    # Warm-started from first-fit's plan (speed- and fragmentation-blind) the GA must improve on it.
    policy = Policy.named("gpusched")
    poor = place(no_quota(pending, fleet, Policy.named("first-fit", round_up_fractions=False), now=NOW))
    result = optimise_with_report(no_quota(pending, fleet, policy, now=NOW), greedy=poor, budget_ms=5_000,
                                  max_generations=30)
    assert result.improved and result.gain_pct > 0
    _check_feasible(result.plan, pending, fleet)


def test_deterministic_with_seed(fleet: FleetSnapshot, pending: list[PendingTask]) -> None:
    policy = Policy.named("gpusched")
    first = optimise(no_quota(pending, fleet, policy, now=NOW, seed=7), budget_ms=10_000, max_generations=8)
    again = optimise(no_quota(pending, fleet, policy, now=NOW, seed=7), budget_ms=10_000, max_generations=8)
    assert first == again


def test_tiny_budget_still_returns_a_valid_plan(fleet: FleetSnapshot, pending: list[PendingTask]) -> None:
    policy = Policy.named("gpusched")
    result = optimise_with_report(no_quota(pending, fleet, policy, now=NOW), budget_ms=0.001)
    assert result.generations == 0
    _check_feasible(result.plan, pending, fleet)
    assert result.objective <= result.greedy_objective + 1e-9


def test_no_double_booking_when_capacity_is_scarce() -> None:
    # Two nodes, eight single-GPU tasks for seven free devices: one must wait, none may share.
    fleet = synthetic_fleet(1, seed=1, used_fraction=0.0)
    busy = fleet.nodes[0].devices[0]
    from gpusched.model import DeviceShare

    fleet = fleet.with_usage([DeviceShare(busy.uuid, busy.node, busy.index, MILLI, busy.memory_bytes)])
    tasks = [PendingTask(f"t{i}", GPURequest.build(gpus=1, expected_duration=3600 * (i + 1)), NOW - i)
             for i in range(8)]
    policy = Policy.named("gpusched")
    result = optimise_with_report(no_quota(tasks, fleet, policy, now=NOW), budget_ms=5_000,
                                  max_generations=20)
    _check_feasible(result.plan, tasks, fleet)
    assert len(result.plan.assignments) == 7 and len(result.plan.rejections) == 1


def test_terms_recombine_to_the_objective(fleet: FleetSnapshot, pending: list[PendingTask]) -> None:
    # The decoder's incremental fragmentation must agree with a full recount.
    weights = (1.0, 2.0, 0.5)
    policy = Policy.named("gpusched")
    result = optimise_with_report(no_quota(pending, fleet, policy, now=NOW), weights=weights, budget_ms=5_000,
                                  max_generations=10)
    for terms, value in ((result.greedy_terms, result.greedy_objective), (result.terms, result.objective)):
        assert sum(w * t for w, t in zip(weights, terms, strict=True)) == pytest.approx(value)


def test_parse_weights_reads_three_numbers_and_names_the_setting_when_wrong() -> None:
    from gpusched.errors import ConfigurationError
    from gpusched.placement.genetic import parse_weights

    assert parse_weights(" 1, 2.5 ,0.1", where="x") == (1.0, 2.5, 0.1)
    for bad in ("1,1", "1,1,0,2", "1,x,0"):
        with pytest.raises(ConfigurationError, match=r"\[gpusched\] replan_weights .* three numbers"):
            parse_weights(bad, where="[gpusched] replan_weights")


# ---- with quotas in force -----------------------------------------------------------------------

_TWO_MODELS = """name: t
racks:
  - name: r1
    nodes:
      - {name: n1, cpu: 32, memory: 256GiB, devices: {model: A100-SXM-80GB, count: 2}}
      - {name: n2, cpu: 32, memory: 256GiB, devices: {model: T4, count: 2}}
"""


def _two_models(tmp_path: pytest.TempPathFactory) -> FleetSnapshot:
    from gpusched.fleetfile import load_fleet

    path = tmp_path / "fleet.yaml"  # type: ignore[operator]
    path.write_text(_TWO_MODELS)
    return FleetSnapshot(tuple(load_fleet(path)))


@pytest.mark.parametrize("budget_hours", [100.0, 1.0])
def test_a_better_plan_the_quota_refuses_yields_to_greedy(tmp_path: pytest.TempPathFactory,
                                                          budget_hours: float) -> None:
    from gpusched.placement import PlacementRequest
    from gpusched.quota.policy import QuotaPolicy, QuotaState

    fleet = _two_models(tmp_path)
    # Greedy: the short tasks on the A100, the two-hour one on a T4. The optimiser swaps them
    # (less latency), which moves two A100-hours onto the tenant's bill.
    tasks = [PendingTask("t0", GPURequest.build(gpus=1, tenant="a"), NOW - 3),
             PendingTask("t1", GPURequest.build(gpus=0.5, memory="20GiB", tenant="a"), NOW - 2),
             PendingTask("t2", GPURequest.build(gpus=1, expected_duration="2h", tenant="a"), NOW - 1)]
    quota = QuotaState(QuotaPolicy(budgets_hours={"a": budget_hours}, default_duration_s=600))
    request = PlacementRequest(pending=tasks, snapshot=fleet, policy=Policy.named("gpusched"), now=NOW,
                               quota=quota, running=())
    greedy = place(request)
    assert {a.key: a.shares[0].node for a in greedy.assignments}["t2"] == "n2"
    result = optimise_with_report(request, greedy=greedy, budget_ms=10_000, max_generations=30)
    if budget_hours > 10:
        assert result.improved and not result.refused_by_quota
        assert {a.key: a.shares[0].node for a in result.plan.assignments}["t2"] == "n1"
    else:  # 2.1 A100-h of commitments against a budget of 1: greedy's 0.9 stands
        assert result.refused_by_quota and not result.improved and result.plan == greedy


def test_tasks_the_quota_refused_stay_waiting(tmp_path: pytest.TempPathFactory) -> None:
    from gpusched.placement import PlacementRequest
    from gpusched.quota.policy import QuotaPolicy, QuotaState

    fleet = _two_models(tmp_path)
    # Budget for one 10-minute A100 task of tenant b; the other three wait for it.
    tasks = [PendingTask(f"b{i}", GPURequest.build(gpus=1, tenant="b"), NOW - 10 + i) for i in range(4)]
    quota = QuotaState(QuotaPolicy(budgets_hours={"b": 0.2}, default_duration_s=600))
    request = PlacementRequest(pending=tasks, snapshot=fleet, policy=Policy.named("gpusched"), now=NOW,
                               quota=quota, running=())
    greedy = place(request)
    refused = [r for r in greedy.rejections if r.by_quota]
    assert len(greedy.assignments) + len(refused) == 4 and refused
    result = optimise_with_report(request, greedy=greedy, budget_ms=10_000, max_generations=30)
    assert {a.key for a in result.plan.assignments} == {a.key for a in greedy.assignments}
    assert {r.key for r in result.plan.rejections} == {r.key for r in refused}
