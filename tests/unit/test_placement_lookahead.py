"""The look-ahead tie-break (``fgd-lookahead``): its per-node shape deltas agree with the scorer,
it only breaks ties of FGD's integer score, it prefers the candidate that leaves the next request
the least fragmentation (checked by brute force through the engine's public scorer), and it
leaves the working state exactly as it found it."""

from __future__ import annotations

import numpy as np
from _placement_support import no_quota_on

from gpusched.model import MILLI, DeviceShare, FleetSnapshot
from gpusched.node_builder import SIM_LAYOUT, make_node
from gpusched.placement import PendingTask, Placer, Policy, WorkloadShape
from gpusched.placement.ties import integer_score
from gpusched.request import GPURequest
from gpusched.sim.fleets import uniform_fleet


def _used(fleet: FleetSnapshot, busy: dict[int, list[int]]) -> FleetSnapshot:
    """``busy[node position]``: milli taken on the node's devices, in device order."""
    shares = []
    for pos, taken in busy.items():
        node = fleet.nodes[pos].name
        devices = [d for d in fleet.devices() if d.node == node]
        shares += [DeviceShare(d.uuid, d.node, d.index, m, 1)
                   for d, m in zip(devices, taken, strict=False) if m]
    return fleet.with_usage(shares)


# Whole-device shapes 1–4 GPUs, weights 3:3:1:3; nodes 0 and 1 have one GPU busy, 2 and 3 two.
WHOLE_SHAPES = tuple(WorkloadShape(c, MILLI, w) for c, w in ((1, 3), (2, 3), (3, 1), (4, 3)))
WHOLE_BUSY = {0: [MILLI], 1: [MILLI], 2: [MILLI, MILLI], 3: [MILLI, MILLI]}


def _placer(name: str, fleet: FleetSnapshot, shapes: tuple[WorkloadShape, ...]) -> Placer:
    return Placer(fleet, Policy.named(name, workload=shapes, fractions_need_partitioning=False))


def _next_request_cost(fleet: FleetSnapshot, node: str) -> float:
    """Brute force: take one GPU on ``node``, then the expected best fragmentation increase the
    next request (a shape of the workload) finds anywhere; its GPU demand where it fits nowhere."""
    placer = _placer("fgd-full", fleet, WHOLE_SHAPES)
    device = next(d for d in fleet.devices() if d.node == node and d.uuid not in fleet.usage)
    placer.apply([DeviceShare(device.uuid, node, device.index, MILLI, 1)])
    stats = placer.stats
    total = sum(s.weight for s in WHOLE_SHAPES)
    cost = 0.0
    for shape in WHOLE_SHAPES:
        fits = np.flatnonzero(stats.nfull >= shape.count)
        best = float(stats.delta_whole(fits, shape.count).min()) if len(fits) else shape.count * MILLI
        cost += shape.weight / total * best
    return cost


def test_lookahead_breaks_a_tie_toward_the_node_that_leaves_the_next_request_more() -> None:
    fleet = _used(uniform_fleet(4, 4, "T4"), WHOLE_BUSY)
    task = PendingTask("t", GPURequest(count=1), 0.0)
    chosen = {}
    for name in ("fgd-full", "fgd-lookahead"):
        placer = _placer(name, fleet, WHOLE_SHAPES)
        plan = placer.place(no_quota_on(placer, [task], now=0.0))
        chosen[name] = plan.assignments[0].shares[0].node
    first, ahead = fleet.nodes[0].name, fleet.nodes[2].name
    assert chosen == {"fgd-full": first, "fgd-lookahead": ahead}
    # Only a tie was broken: both nodes have FGD's highest integer score for this task ...
    stats = _placer("fgd-full", fleet, WHOLE_SHAPES).stats
    nodes = np.arange(4)
    levels = integer_score(stats.delta_whole(nodes, 1) / MILLI, 100)
    assert levels[0] == levels[2] == levels.max()
    # ... and the look-ahead's node leaves the next request less fragmentation.
    assert _next_request_cost(fleet, ahead) < _next_request_cost(fleet, first) - 1.0


def test_shape_deltas_agree_with_the_scorer() -> None:
    shapes = (
        WorkloadShape(1, MILLI, 2.0, cpu_milli=4000),
        WorkloadShape(2, MILLI, 1.0, cpu_milli=8000),
        WorkloadShape(1, 500, 2.0, cpu_milli=2000),
        WorkloadShape(1, 250, 1.0, cpu_milli=1000, models=frozenset({"T4"})),
        WorkloadShape(0, 0, 1.0, cpu_milli=2000),  # CPU-only: holds no GPUs, no look-ahead row
    )
    fleet = _used(uniform_fleet(3, 4, "T4"), {0: [500, 250, MILLI], 1: [750], 2: []})
    placer = _placer("fgd-lookahead", fleet, shapes)
    ahead = placer.lookahead
    assert ahead is not None
    stats = placer.stats
    deltas = ahead.current(stats, placer.state)
    idx = placer.index
    for n in range(3):
        devices = np.arange(idx.node_start[n], idx.node_start[n + 1])
        free = placer.state.free_milli[devices]
        for s, shape in enumerate(shapes):
            cpu_ok = placer.state.host_cpu[n] >= shape.cpu_milli
            if shape.count == 0:
                expected = np.inf
            elif shape.milli >= MILLI:
                fits = stats.nfull[n] >= shape.count and cpu_ok
                whole = stats.delta_whole(np.array([n]), shape.count, shape.cpu_milli)
                expected = float(whole[0]) if fits else np.inf
            else:
                ok = devices[free >= shape.milli]
                if not cpu_ok or not len(ok):
                    expected = np.inf
                else:
                    d = stats.delta_fraction(ok, shape.milli, placer.state.free_milli[ok], shape.cpu_milli)
                    level = integer_score(d / MILLI, 100)
                    expected = float(d[np.flatnonzero(level == level.max())[0]])
            assert np.isclose(deltas[n, s], expected, atol=1e-6) or deltas[n, s] == expected == np.inf


def test_pick_restores_the_working_state_and_statistics() -> None:
    # Node 0: one GPU busy (one free); node 1: two free. The next request is a half GPU or two
    # whole GPUs: half a GPU on node 1 leaves the 2-GPU shape nowhere to go; on node 0 it does not.
    shapes = (WorkloadShape(1, 500, 1.0), WorkloadShape(2, MILLI, 1.0))
    fleet = _used(uniform_fleet(2, 2, "T4"), {0: [MILLI]})
    placer = _placer("fgd-lookahead", fleet, shapes)
    ahead = placer.lookahead
    assert ahead is not None
    stats, state = placer.stats, placer.state
    before = (state.free_milli.copy(), state.host_cpu.copy(), state.host_mem.copy(), state.node_stamp.copy(),
              stats.total.copy(), stats.expected.copy(), stats.frac_frag.copy())
    node1_dev0, node0_free = int(placer.index.node_start[1]), int(placer.index.node_start[0]) + 1
    assert ahead.pick(stats, state, [([node1_dev0], 500), ([node0_free], 500)], 0, 0) == 1
    after = (state.free_milli, state.host_cpu, state.host_mem, state.node_stamp,
             stats.total, stats.expected, stats.frac_frag)
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))


def test_no_lookahead_without_the_policy_switch() -> None:
    fleet = uniform_fleet(2, 2, "T4")
    assert _placer("fgd-full", fleet, WHOLE_SHAPES).lookahead is None
    assert Policy.named("fgd-lookahead").lookahead_ties == 16


def test_scarce_models_lose_their_ties_to_models_the_pinned_demand_leaves_room_on() -> None:
    # One V100 node before two T4 nodes; half the expected requests are pinned to each model.
    # Taking a GPU anywhere frees the other model's pinned shape of the same fragment, so the
    # three empty nodes tie at the top integer score. The pinned demand needs half of the free
    # GPUs of each model, but the V100s are a third of them: V100 is scarce, T4 is not.
    models = ("V100-SXM2-16GB", "T4", "T4")
    fleet = FleetSnapshot(
        tuple(make_node(f"n{i}-{m}", m, 4, layout=SIM_LAYOUT) for i, m in enumerate(models)), source="mixed"
    )
    pinned = (
        WorkloadShape(1, MILLI, 1.0, models=frozenset({"V100-SXM2-16GB"})),
        WorkloadShape(1, MILLI, 1.0, models=frozenset({"T4"})),
    )
    placer = _placer("fgd-lookahead", fleet, pinned)
    ahead = placer.lookahead
    assert ahead is not None
    scarce = dict(zip(placer.index.model_names, ahead.scarce_models(placer.stats, placer.state), strict=True))
    assert scarce == {"V100-SXM2-16GB": True, "T4": False}
    levels = integer_score(placer.stats.delta_whole(np.arange(3), 1) / MILLI, 100)
    assert levels[0] == levels[1] == levels[2]
    task = PendingTask("t", GPURequest(count=1), 0.0)  # may run on either model
    chosen = {}
    for name in ("fgd-full", "fgd-lookahead"):
        placer = _placer(name, fleet, pinned)
        chosen[name] = placer.place(no_quota_on(placer, [task], now=0.0)).assignments[0].shares[0].node
    assert chosen["fgd-full"] == "n0-V100-SXM2-16GB"  # the earliest of the tie
    assert chosen["fgd-lookahead"] in {"n1-T4", "n2-T4"}
    # Without pinned shapes no model is scarce.
    free = _placer("fgd-lookahead", fleet, WHOLE_SHAPES)
    assert free.lookahead is not None
    assert not free.lookahead.scarce_models(free.stats, free.state).any()


def test_the_vectorised_first_fill_equals_the_rows_node_by_node() -> None:
    # An openb-like cluster (host CPU/RAM, three models, pinned and host-heavy shapes) filled by
    # the gpusched preset itself; at every checkpoint the one-pass fill equals the rows computed
    # node by node (to the last bits of a sum: the scorer's matrix product may add in another
    # order for another batch shape), and so does what the engine keeps.
    import random

    from gpusched.placement import PlacementRequest
    from gpusched.quota.policy import QuotaState
    from gpusched.sim.fleets import openb_fleet
    from gpusched.sim.openb import openb_policy, pod_request
    from gpusched.sim.traces import OpenbNode, OpenbPod

    rng = random.Random(7)
    kinds = (("G2", 8, 96_000, 393_216), ("T4", 2, 104_000, 524_288), ("V100M16", 4, 32_000, 131_072))
    nodes = [OpenbNode(f"n{i:03d}", k[2], k[3], k[1], k[0]) for i, k in enumerate(rng.choices(kinds, k=60))]
    pods = [OpenbPod(f"p{i}", rng.choice((2_000, 8_000, 12_000)), rng.choice((4_096, 30_000, 47_000)),
                     *rng.choice(((1, 470), (1, 810), (1, 1000), (2, 1000), (8, 1000), (1, 320))),
                     ("V100M16",) if rng.random() < 0.15 else ())
            for i in range(400)]
    fleet = openb_fleet(nodes)
    policy = openb_policy("gpusched", pods)
    placer = Placer(fleet, policy)
    ahead = placer.lookahead
    assert ahead is not None and len(ahead.workload.s_p) > 10
    everything = np.arange(len(placer.index.nodes))
    checked = 0
    for i, pod in enumerate(pods):
        task = PendingTask(f"t{i}", pod_request(pod), float(i), cpu_milli=pod.cpu_milli,
                           host_memory_bytes=pod.memory_mib << 20)
        placer.place(PlacementRequest(pending=(task,), snapshot=fleet, policy=policy, now=float(i),
                                      quota=QuotaState.unlimited(), seed=i))
        if i % 50 == 49:
            stats, state = placer.stats, placer.state
            one_by_one = np.stack([ahead.row(stats, state, int(n)) for n in everything])
            for rows in (ahead.rows_of(stats, state, everything), ahead.current(stats, state)):
                assert np.array_equal(np.isinf(rows), np.isinf(one_by_one))
                assert np.allclose(rows, one_by_one, rtol=0.0, atol=1e-9)
            checked += int(np.isfinite(one_by_one).sum())
    free = placer.state.free_milli
    assert checked > 1000 and float(free.sum()) < 0.8 * len(free) * MILLI  # the fleet did fill


def _compared(
    widen: int, score: list[float], others: list[float] | None = None, may_widen: bool = True
) -> tuple[list[int], int]:
    """The candidates (one per node, nodes 0..4) the look-ahead compares for ``score`` and the
    one it returns when its comparison prefers the second."""
    from gpusched.placement.lookahead import lookahead_best

    fleet = uniform_fleet(5, 2, "T4")
    placer = Placer(fleet, Policy.named("fgd-lookahead", score_levels=50, lookahead_widen=widen,
                                        workload=WHOLE_SHAPES))
    ahead = placer.lookahead
    assert ahead is not None and ahead.widen == widen
    seen: list[int] = []

    def pick(stats: object, state: object, options: list[tuple[list[int], int]], *rest: object) -> int:
        seen.extend(int(placer.index.dev_node[devices[0]]) for devices, _ in options)
        return 1

    ahead.pick = pick  # type: ignore[method-assign,assignment]
    chosen = lookahead_best(ahead, placer.stats, placer.state, PendingTask("t", GPURequest(count=1), 0.0),
                            np.array(score), np.arange(5),
                            lambda i: [int(placer.index.node_start[i])], MILLI,
                            None if others is None else np.array(others), may_widen)
    return seen, chosen


def test_a_node_alone_at_the_top_level_is_compared_with_the_levels_below() -> None:
    score = [-4.0, -3.5, -3.4, -3.0, 0.0]
    assert integer_score(np.array(score), 50).tolist() == [49, 48, 48, 47, 25]
    assert _compared(0, score) == ([], 0)  # alone at the top: taken as FGD takes it
    assert _compared(1, score) == ([0, 1, 2], 1)  # the next level joins; the others do not
    assert _compared(2, score) == ([0, 1, 2, 3], 1)
    # A level lost to locality, speed or energy is never traded for fragmentation.
    assert _compared(2, score, others=[0.0, 0.3, 0.0, 0.0, 0.0]) == ([0, 2, 3], 2)
    assert _compared(2, score, may_widen=False) == ([], 0)  # the caller keeps FGD's choice
    tied = [-4.0, -4.1, -3.5, 0.0, 0.0]  # two nodes at the top: only they are compared
    assert _compared(0, tied) == ([0, 1], 1) == _compared(2, tied)


def _one_at_a_time(widen: int, timed: bool) -> list[tuple[str, ...]]:
    """The devices each of 120 whole-device tasks (1–8 GPUs) gets, placed one at a time."""
    import random

    from gpusched.placement import PlacementRequest
    from gpusched.quota.policy import QuotaState
    from gpusched.testing import synthetic_fleet

    fleet = synthetic_fleet(32, 8, 0, used_fraction=0.3)
    policy = Policy.named("gpusched", lookahead_widen=widen)
    placer, rng, taken = Placer(fleet, policy), random.Random(0), []
    for i in range(120):
        request = GPURequest.build(gpus=rng.choice([1, 1, 1, 2, 2, 4, 8]),
                                   **({"expected_duration": "1h"} if timed else {}))
        task = PendingTask(f"t{i}", request, float(i))
        plan = placer.place(PlacementRequest(pending=[task], snapshot=fleet, policy=policy, now=float(i),
                                             quota=QuotaState.unlimited()))
        taken.append(tuple(s.uuid for a in plan.assignments for s in a.shares))
    return taken


def test_whole_device_tasks_with_a_known_duration_are_never_widened() -> None:
    """Widening is for packing: a whole-device task whose run time is known (speed terms apply)
    keeps FGD's choice at the top level; one without a duration may be placed elsewhere."""
    assert _one_at_a_time(2, timed=True) == _one_at_a_time(0, timed=True)
    assert _one_at_a_time(2, timed=False) != _one_at_a_time(0, timed=False)
