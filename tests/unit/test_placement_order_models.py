"""Model-aware fragmentation (shapes pinned to models), shortest-first queue order with aging,
and packing as a pure tie-breaker."""

from __future__ import annotations

import numpy as np
import pytest
from _placement_support import no_quota

from gpusched.model import MILLI, DeviceShare, FleetSnapshot
from gpusched.placement import PendingTask, Placer, Policy, QueueOrder, WorkloadShape, place
from gpusched.placement.index import FreeState, fleet_index
from gpusched.placement.score import FragStats
from gpusched.placement.workload import Workload, estimate_workload
from gpusched.request import GPURequest
from gpusched.testing import make_node

T4 = "T4"
V100 = "V100-SXM2-16GB"


def _fleet() -> FleetSnapshot:
    return FleetSnapshot((make_node("t4", T4, 2), make_node("v100", V100, 2)))


def test_capacity_on_a_model_a_shape_cannot_use_is_fragment_for_it() -> None:
    snap = _fleet()
    index = fleet_index(snap)
    pinned = Workload.of((WorkloadShape(1, MILLI, 1.0, models=frozenset({V100})),))
    stats = FragStats(index, FreeState(index, snap), pinned)
    t4, v100 = index.node_pos["t4"], index.node_pos["v100"]
    # Both free T4s are useless to a V100-only shape: all 2000 milli count; the V100s none.
    assert stats.node_fragmentation(np.array([t4, v100])).tolist() == [2 * MILLI, 0.0]
    # Taking a T4 lowers the T4 node's fragmentation by what it takes; taking a V100 costs nothing now.
    assert stats.delta_whole(np.array([t4]), 1)[0] == pytest.approx(-MILLI)
    assert stats.delta_whole(np.array([v100]), 1)[0] == pytest.approx(0.0)
    # Without the model constraint the two nodes are equal.
    free = FragStats(index, FreeState(index, snap), Workload.of((WorkloadShape(1, MILLI, 1.0),)))
    assert free.node_fragmentation(np.array([t4, v100])).tolist() == [0.0, 0.0]


def test_unpinned_work_leaves_the_scarce_model_to_pinned_work() -> None:
    snap = _fleet()
    shapes = (WorkloadShape(1, MILLI, 0.5), WorkloadShape(1, MILLI, 0.5, models=frozenset({V100})))
    policy = Policy.named("gpusched", workload=shapes)
    plan = place(no_quota([PendingTask("any", GPURequest.build(gpus=1), 0.0)], snap, policy, now=0.0))
    assert plan.assignments[0].shares[0].node == "t4"
    # The same request with an unconstrained workload has no reason to avoid the V100s; the
    # model-aware measure is what moves it (so the check above can fail).
    plain = Policy.named("gpusched", workload=(WorkloadShape(1, MILLI, 1.0),), speed=0.0, energy=0.0)
    stats = Placer(snap, plain).stats
    assert stats.delta_whole(np.array([0, 1]), 1).tolist() == [0.0, 0.0]


def test_fractions_and_refresh_stay_model_aware() -> None:
    snap = _fleet()
    shapes = (WorkloadShape(1, 500, 1.0, models=frozenset({T4})),)
    placer = Placer(snap, Policy.named("fgd", workload=shapes))
    v100 = placer.index.node_pos["v100"]
    assert placer.stats.node_fragmentation(np.array([v100]))[0] == 2 * MILLI
    uuid = snap.node("v100").devices[0].uuid
    placer.apply([DeviceShare(uuid, "v100", 0, 300, 1)])
    assert placer.stats.node_fragmentation(np.array([v100]))[0] == 2 * MILLI - 300


def test_estimated_workload_keeps_request_models() -> None:
    req = GPURequest.build(gpus=1, models=[V100])
    w = estimate_workload([req, req])
    assert frozenset({V100}) in w.s_models and w.host_aware


def _job(key: str, submitted: float, hours: float | None, gpus: int = 1) -> PendingTask:
    duration = f"{hours * 3600:.0f}s" if hours is not None else None
    kwargs: dict[str, object] = {"gpus": gpus}
    if duration is not None:
        kwargs["expected_duration"] = duration
    return PendingTask(key, GPURequest.from_dict(kwargs), submitted)


def test_shortest_first_orders_by_expected_gpu_time() -> None:
    snap = FleetSnapshot((make_node("n", T4, 1),))
    jobs = [_job("long", 0.0, 10.0), _job("short", 5.0, 0.1), _job("mid", 1.0, 1.0)]
    assert Policy.named("gpusched").queue_order is QueueOrder.SHORTEST_FIRST
    plan = place(no_quota(jobs, snap, Policy.named("gpusched"), now=10.0))
    assert [a.key for a in plan.assignments] == ["short"]
    fifo = place(no_quota(jobs, snap, Policy.named("gpusched", queue_order=QueueOrder.FIFO), now=10.0))
    assert [a.key for a in fifo.assignments] == ["long"]
    # GPU-time, not run time: 2 GPUs × 1 h loses to 1 GPU × 1.5 h.
    snap2 = FleetSnapshot((make_node("n", T4, 2),))
    wide = [_job("wide", 0.0, 1.0, gpus=2), _job("narrow", 1.0, 1.5)]
    assert place(no_quota(wide, snap2, Policy.named("gpusched"), now=2.0)).assignments[0].key == "narrow"


def test_shortest_first_ages_so_long_jobs_do_not_starve() -> None:
    snap = FleetSnapshot((make_node("n", T4, 1),))
    policy = Policy.named("gpusched", service_halving_s=3600.0)
    # 16 GPU-hours vs a fresh 1 GPU-hour job: log2(16) = 4 halvings, so after 4 h the long one wins.
    long_job = _job("long", 0.0, 16.0)
    for now, winner in ((3.5 * 3600, "fresh"), (4.5 * 3600, "long")):
        fresh = _job("fresh", now, 1.0)
        plan = place(no_quota([fresh, long_job], snap, policy, now=now))
        assert plan.assignments[0].key == winner, now
    # Priority still comes first, and unknown durations count as unknown_service_s.
    hi = PendingTask("hi", GPURequest.from_dict({"gpus": 1, "priority": "high"}), 0.0)
    assert place(no_quota([_job("tiny", 0.0, 0.01), hi], snap, policy, now=0.0)).assignments[0].key == "hi"
    unknown = place(no_quota([_job("u", 0.0, None), _job("k", 0.0, 2.0)], snap, policy, now=0.0))
    assert unknown.assignments[0].key == "u"  # 1 GPU-hour assumed < 2 GPU-hours


def test_packing_only_breaks_ties() -> None:
    # Two identical free nodes and one half-used: the fragmentation term decides between the
    # half-used node and the others; packing never overrides it but picks among exact ties.
    snap = FleetSnapshot((make_node("a", T4, 4), make_node("b", T4, 2), make_node("c", T4, 4)))
    snap = snap.with_usage([DeviceShare(snap.node("c").devices[0].uuid, "c", 0, MILLI, 1)])
    shapes = (WorkloadShape(1, MILLI, 1.0),)
    tie = Policy.named("gpusched", workload=shapes, locality=0.0, packing=0.01)
    # Every node gives delta 0 for a 1-GPU shape: packing picks the node left with least free.
    assert place(no_quota([_job("x", 0.0, None)], snap, tie, now=0.0)).assignments[0].shares[0].node == "b"
    huge = Policy.named("gpusched", workload=(WorkloadShape(4, MILLI, 1.0),), locality=0.0, packing=100.0)
    # With 4-GPU shapes, taking one of a's GPUs breaks the only node that fits 4: avoided, however
    # large the packing weight.
    assert place(no_quota([_job("x", 0.0, None)], snap, huge, now=0.0)).assignments[0].shares[0].node != "a"
