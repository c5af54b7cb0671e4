"""A placement engine kept warm between cycles plans exactly what a fresh one plans; the request
mix a scheduler keeps between cycles moves only past its drift.

Seeded cycles as the executor runs them: each cycle's tasks are planned by
``WarmPlacement.place`` and by ``place`` on the same request; some assignments are launched
(they enter the next snapshot's usage and the running tasks, with host CPU/RAM), others are held
back, some running tasks end. Every plan must be identical (devices, shares, scores, rejection
reasons, reservations), and the warm engine must have been reused, not rebuilt every cycle.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest

from gpusched.errors import ConfigurationError
from gpusched.model import DeviceShare, FleetSnapshot, Node
from gpusched.placement import (
    PendingTask,
    PlacementPlan,
    PlacementRequest,
    Policy,
    RunningTask,
    WorkloadShape,
    place,
)
from gpusched.placement.warm import WarmPlacement
from gpusched.placement.workload import DEFAULT_WORKLOAD, SteadyWorkload, distance, estimated_shapes
from gpusched.quota.policy import QuotaState
from gpusched.request import GPURequest
from gpusched.testing import synthetic_fleet, synthetic_requests


def _plan(plan: PlacementPlan) -> tuple[list[Any], list[Any], list[Any]]:
    return (
        [(a.key, a.shares, a.score) for a in plan.assignments],
        [(r.key, r.reason, r.permanent) for r in plan.rejections],
        [(r.key, r.shares, r.start) for r in plan.reservations],
    )


def _cordoned(snapshot: FleetSnapshot) -> FleetSnapshot:
    """``snapshot`` with its closed nodes cordoned in the inventory instead."""
    shut = [dataclasses.replace(n, cordoned=True) for n in snapshot.nodes if n.name in snapshot.closed]
    return snapshot.with_closed(()).with_nodes(shut)


def _cycles(policy: Policy, seed: int, cycles: int = 40, *, closing: bool = False) -> WarmPlacement:
    """``closing``: every cycle closes a few random nodes (busy worker slots) and the fresh plan is
    made on the fleet with those nodes cordoned instead."""
    rng = random.Random(seed)
    snapshot: FleetSnapshot = synthetic_fleet(48, 8, seed, used_fraction=0.3)
    stream = synthetic_requests(400, seed=seed)
    warm = WarmPlacement()
    running: list[RunningTask] = []
    waiting: list[PendingTask] = []
    for cycle in range(cycles):
        now = 60.0 * cycle
        arrivals = [dataclasses.replace(t, key=f"c{cycle}-{i}", submitted_at=now,
                                        cpu_milli=rng.choice((0, 4000, 16000)),
                                        host_memory_bytes=rng.choice((0, 32 << 30)))
                    for i, t in enumerate(rng.sample(stream, rng.randint(1, 6)))]
        if closing:
            snapshot = snapshot.with_closed(n.name for n in rng.sample(snapshot.nodes, rng.randint(0, 8)))
        request = PlacementRequest(pending=waiting + arrivals, snapshot=snapshot, policy=policy, now=now,
                                   quota=QuotaState.unlimited(), running=tuple(running), seed=cycle)
        got = warm.place(request)
        fresh = dataclasses.replace(request, snapshot=_cordoned(snapshot)) if closing else request
        assert _plan(got) == _plan(place(fresh)), f"cycle {cycle}"
        if closing:
            assert _plan(place(request)) == _plan(got), f"cycle {cycle}"
            closed = {s.node for a in got.assignments for s in a.shares} & snapshot.closed
            assert not closed, f"cycle {cycle}: placed on closed nodes {closed}"
        pending = {t.key: t for t in request.pending}
        waiting = [pending[r.key] for r in got.rejections if not r.permanent]
        for assignment in got.assignments:
            task = pending[assignment.key]
            if rng.random() < 0.2:  # held back after planning (a refused launch): waits again
                waiting.append(task)
                continue
            snapshot = snapshot.with_usage(assignment.shares)
            running.append(RunningTask(task.key, task.request, assignment.shares, now,
                                       now + rng.choice((600.0, 3600.0, 14400.0)),
                                       task.cpu_milli, task.host_memory_bytes))
        for task in [r for r in running if rng.random() < 0.25]:  # ended
            snapshot = snapshot.with_usage(task.shares, release=True)
            running.remove(task)
    return warm


@pytest.mark.parametrize("seed", [0, 1])
def test_warm_plans_equal_fresh_plans_with_the_policys_workload(seed: int) -> None:
    policy = Policy.named("gpusched", workload=DEFAULT_WORKLOAD)
    warm = _cycles(policy, seed)
    assert warm.built == 1 and warm.rebased == 39  # one engine for the whole run


@pytest.mark.parametrize("name", ["gpusched", "fgd", "best-fit"])
def test_warm_plans_equal_fresh_plans_with_an_estimated_workload(name: str) -> None:
    warm = _cycles(Policy.named(name), 3)
    # The estimate follows the mix of pending and running requests: a new mix, a new engine.
    assert warm.built + warm.rebased == 40 and warm.built >= 1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_closed_nodes_plan_as_cordoned_ones_on_one_engine(seed: int) -> None:
    # Nodes closed for a cycle (busy worker slots) are not an inventory change: the kept engine
    # and its index survive every change of the closed set, and each plan is the one a fresh
    # engine makes on the fleet with those nodes cordoned (reasons included).
    policy = Policy.named("gpusched", workload=DEFAULT_WORKLOAD)
    warm = _cycles(policy, seed, closing=True)
    assert warm.built == 1 and warm.rebased == 39


@pytest.mark.parametrize("name", ["fgd", "best-fit"])
def test_closed_nodes_plan_as_cordoned_ones_under_other_policies(name: str) -> None:
    _cycles(Policy.named(name, workload=DEFAULT_WORKLOAD), 4, closing=True)


def test_a_closed_node_takes_nothing_and_counts_as_cordoned_in_the_reason() -> None:
    fleet = synthetic_fleet(4, 8, 0, used_fraction=0.0)
    whole = GPURequest.build(gpus=8)
    policy = Policy.named("gpusched", workload=DEFAULT_WORKLOAD)
    warm = WarmPlacement()

    def plan(snapshot: FleetSnapshot) -> PlacementPlan:
        tasks = [PendingTask(f"t{i}", whole, 0.0) for i in range(2)]
        return warm.place(PlacementRequest(pending=tasks, snapshot=snapshot, policy=policy, now=0.0,
                                           quota=QuotaState.unlimited()))

    busy = fleet.with_usage(s for n in fleet.nodes[:2] for s in _whole_shares(n))  # two nodes full
    open_plan = plan(busy)
    assert {a.shares[0].node for a in open_plan.assignments} == {fleet.nodes[2].name, fleet.nodes[3].name}
    closed = busy.with_closed([fleet.nodes[3].name])
    shut = plan(closed)
    assert [a.shares[0].node for a in shut.assignments] == [fleet.nodes[2].name]
    reason = shut.rejections[0].reason
    assert "8 cordoned" in reason, reason
    assert _plan(shut) == _plan(place(PlacementRequest(
        pending=[PendingTask(f"t{i}", whole, 0.0) for i in range(2)], snapshot=_cordoned(closed),
        policy=policy, now=0.0, quota=QuotaState.unlimited())))
    assert _plan(plan(busy)) == _plan(open_plan)  # opened again: the same plan as before
    assert (warm.built, warm.rebased) == (1, 2)


def _whole_shares(node: Node) -> list[DeviceShare]:
    return [DeviceShare(d.uuid, d.node, d.index, 1000, d.memory_bytes) for d in node.devices]


def test_a_new_inventory_or_policy_builds_a_new_engine() -> None:
    fleet = synthetic_fleet(16, 8, 0, used_fraction=0.3)
    task = synthetic_requests(1, seed=0)[0]
    policy = Policy.named("gpusched", workload=DEFAULT_WORKLOAD)
    warm = WarmPlacement()

    def request(snapshot: FleetSnapshot, p: Policy) -> PlacementRequest:
        return PlacementRequest(pending=[task], snapshot=snapshot, policy=p, now=0.0,
                                quota=QuotaState.unlimited())

    warm.place(request(fleet, policy))
    warm.place(request(fleet.with_usage(()), policy))  # same inventory, new snapshot object
    assert (warm.built, warm.rebased) == (1, 1)
    cordoned = fleet.with_nodes([dataclasses.replace(fleet.nodes[0], cordoned=True)])
    assert _plan(warm.place(request(cordoned, policy))) == _plan(place(request(cordoned, policy)))
    assert warm.built == 2
    other = Policy.named("gpusched", workload=DEFAULT_WORKLOAD, locality=0.0)
    warm.place(request(cordoned, other))
    assert warm.built == 3


def _requests(mix: dict[float, int]) -> list[GPURequest]:
    return [GPURequest.build(gpus=g, memory="8GiB" if g < 1 else None)
            for g, n in mix.items() for _ in range(n)]


def test_the_distance_of_two_mixes_is_their_total_variation() -> None:
    same = estimated_shapes(_requests({1: 3, 2: 1}))
    assert distance(same, same) == 0.0
    one, two = (WorkloadShape(1, 1000, 1.0),), (WorkloadShape(2, 1000, 3.0),)
    assert distance(one, two) == pytest.approx(1.0)
    assert distance(one, (WorkloadShape(1, 1000, 1.0), WorkloadShape(2, 1000, 1.0))) == pytest.approx(0.5)


def test_the_steady_mix_moves_only_past_its_drift() -> None:
    steady = SteadyWorkload(0.1)
    kept = steady.shapes(_requests({1: 3, 2: 2}))
    assert steady.shapes(_requests({1: 3, 2: 2})) is kept
    # one 2-GPU task fewer: 0.075 of the blend (half the estimate is the prior) -> kept
    assert steady.shapes(_requests({1: 3, 2: 1})) is kept
    moved = steady.shapes(_requests({0.5: 6}))  # another mix altogether
    assert moved is not kept and moved == estimated_shapes(_requests({0.5: 6}))
    follows = SteadyWorkload(0.0)
    first = follows.shapes(_requests({1: 3, 2: 2}))
    assert follows.shapes(_requests({1: 3, 2: 1})) != first


def test_a_drift_outside_zero_to_one_is_refused_with_the_fix() -> None:
    with pytest.raises(ConfigurationError, match=r"workload drift 1.5 is outside 0..1; give a total"):
        SteadyWorkload(1.5)
