"""The baselines behave like the published ones they stand for (FGD simulator, ATC '23)."""

from __future__ import annotations

from collections import Counter

import numpy as np
from _placement_support import no_quota, no_quota_on

from gpusched.model import DeviceShare, FleetSnapshot
from gpusched.placement import PendingTask, Placer, Policy, place
from gpusched.placement.ties import levels_best
from gpusched.request import GPURequest
from gpusched.sim.fleets import uniform_fleet


def _busy(fleet: FleetSnapshot, node: str, whole: int) -> FleetSnapshot:
    devs = [d for d in fleet.devices() if d.node == node][:whole]
    return fleet.with_usage([DeviceShare(d.uuid, d.node, d.index, 1000, d.memory_bytes) for d in devs])


def test_integer_node_score_ties_go_to_the_earliest_candidate() -> None:
    # int(100 * sigmoid(-s)): 0.02 and 0.015 both score 49, so the first wins although the
    # second is lower; 0.0 scores 50 and beats both.
    assert levels_best(np.array([0.02, 0.015]), 100) == 0
    assert levels_best(np.array([0.02, 0.015, 0.0]), 100) == 2
    assert levels_best(np.array([0.015, 0.02]), 100) == 0


def test_integer_node_score_ignores_float_summation_noise() -> None:
    # A fragment difference of 1e-17 is rounding noise, not a change: it must tie with 0 (50),
    # not drop to 49 (FGD's own sums give an exact 0 there).
    assert levels_best(np.array([1e-17, 0.0]), 100) == 0
    assert levels_best(np.array([1e-3, 0.0]), 100) == 1  # a real change still counts


def test_integer_node_score_with_a_packing_tie_break() -> None:
    # Among the highest integer level, the least "left" wins; lower levels never do.
    left = np.array([5.0, 1.0, 0.0])
    assert levels_best(np.array([0.0, 0.0, 0.5]), 100, left) == 1
    assert levels_best(np.array([0.0, 0.0, 0.5]), 100) == 0


def test_fgd_preset_packs_equal_nodes_in_inventory_order() -> None:
    fleet = uniform_fleet(4, 8, "T4")
    policy = Policy.named("fgd", fractions_need_partitioning=False)
    placer = Placer(fleet, policy)
    nodes = []
    for i in range(6):
        task = PendingTask(f"t{i}", GPURequest(count=1, milli_per_gpu=500, memory_per_gpu=1), 0.0)
        plan = placer.place(no_quota_on(placer, [task], now=0.0, seed=i))
        nodes.append(plan.assignments[0].shares[0].node)
    assert set(nodes) == {fleet.nodes[0].name}  # everything on the first node while it fits


def test_random_picks_a_node_uniformly_not_a_device() -> None:
    # Node 0 has 8 free devices, node 1 only one: a device-uniform draw would pick node 1 one
    # time in nine; FGD's Random picks each feasible node with the same probability.
    fleet = _busy(uniform_fleet(2, 8, "T4"), uniform_fleet(2, 8, "T4").nodes[1].name, 7)
    policy = Policy.named("random", fractions_need_partitioning=False)
    req = GPURequest(count=1, milli_per_gpu=300, memory_per_gpu=1)
    picks = Counter(
        place(no_quota([PendingTask("t", req, 0.0)],
            fleet, policy, now=0.0, seed=s)).assignments[0].shares[0].node
        for s in range(400)
    )
    assert 150 <= picks[fleet.nodes[1].name] <= 250


def test_best_fit_with_host_cpu_uses_the_published_key() -> None:
    # Published BestFit: 0.5 * CPU left / 128 cores + 0.5 * GPU left / 8 GPUs, in hundredths.
    # Node 1 has 2 GPUs taken, so after a 1-GPU task it leaves 5 of 8 GPUs: key 0.5*c + 0.3125
    # against node 0's 0.5*c + 0.4375 — node 1 wins.
    fleet = _busy(uniform_fleet(2, 8, "T4"), uniform_fleet(2, 8, "T4").nodes[1].name, 2)
    policy = Policy.named("best-fit")
    task = PendingTask("t", GPURequest(count=1), 0.0, cpu_milli=4000, host_memory_bytes=2**30)
    plan = place(no_quota([task], fleet, policy, now=0.0))
    assert plan.assignments[0].shares[0].node == fleet.nodes[1].name
