"""The FGD packing procedure on a tiny cluster the test writes itself."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

import gpusched.sim.openb as openb
from gpusched.sim.openb import (
    node_order,
    openb_policy,
    pod_request,
    run_openb,
    run_openb_seeds,
    tune_workload,
    typical_shapes,
)
from gpusched.sim.traces import OpenbPod, load_openb_nodes

NODES = """sn,cpu_milli,memory_mib,gpu,model
a,16000,65536,2,T4
b,16000,65536,2,T4
c,8000,32768,1,V100M16
"""


def _nodes(tmp_path: Path):  # type: ignore[no-untyped-def]
    path = tmp_path / "nodes.csv"
    path.write_text(NODES, encoding="utf-8")
    return load_openb_nodes(path)


PODS = [
    OpenbPod("half", 2000, 4096, 1, 500),
    OpenbPod("whole", 4000, 8192, 1, 1000),
    OpenbPod("pair", 8000, 16384, 2, 1000),
    OpenbPod("cpu", 3000, 4096, 0, 0),
    OpenbPod("v100", 2000, 4096, 1, 300, ("V100M16",)),
]


def test_tuning_reaches_the_factor_and_stops_there() -> None:
    capacity = 5000
    tuned = tune_workload(PODS, capacity, random.Random(1), 1.3)
    total = sum(p.total_gpu_milli for p in tuned)
    # FGD's order: every trace task first (shuffled), the draws after them
    assert sorted(tuned[: len(PODS)], key=lambda p: p.name) == sorted(PODS, key=lambda p: p.name)
    assert len(tuned) > len(PODS)
    # FGD's rule: draws are kept while the total stays within the target, tested with the
    # draw's per-GPU share (so only a multi-GPU draw can pass it, by less than its total).
    assert total <= 1.3 * capacity or tuned[-1].num_gpu > 1
    assert total - tuned[-1].total_gpu_milli + tuned[-1].gpu_milli <= 1.3 * capacity
    assert total + 1000 > 1.3 * capacity - 1000  # it stopped only near the target
    assert tune_workload(PODS, capacity, random.Random(1)) == tuned  # seeded


def test_a_list_above_the_target_loses_random_tasks() -> None:
    many = [OpenbPod(f"w{i}", 1000, 1, 1, 1000) for i in range(20)]  # 20 GPUs on a 10-GPU target
    tuned = tune_workload(many, 10_000, random.Random(2), 1.0)
    assert len(tuned) == 10 and len({p.name for p in tuned}) == 10


def test_requests_follow_the_pod() -> None:
    assert pod_request(PODS[0]).milli_per_gpu == 500 and pod_request(PODS[0]).count == 1
    assert pod_request(PODS[2]).count == 2 and pod_request(PODS[2]).gang
    assert pod_request(PODS[4]).models == frozenset({"V100-SXM2-16GB"})
    policy = openb_policy("gpusched", PODS)
    shapes = policy.workload
    assert {(s.count, s.milli) for s in shapes} == {(1, 500), (1, 1000), (2, 1000), (1, 300), (0, 0)}
    assert all(s.cpu_milli > 0 and s.host_memory_bytes > 0 for s in shapes)
    pinned = {(s.count, s.milli): s.models for s in shapes}
    assert pinned[(1, 300)] == frozenset({"V100-SXM2-16GB"}) and pinned[(1, 500)] == frozenset()
    # The default preset is judged as fgd-memory is: GPU pods by shapes with RAM, CPU-only
    # pods by the same shapes without it, with a coarse integer score and the look-ahead.
    memory = openb_policy("fgd-memory", PODS)
    assert (shapes, policy.host_task_workload) == (memory.workload, memory.host_task_workload)
    assert 0 < policy.score_levels < memory.score_levels and policy.lookahead_ties > 0
    assert not openb_policy("random", PODS).fractions_need_partitioning


def test_fgd_typical_pods_are_exact_classes_up_to_95_percent() -> None:
    pods = [OpenbPod(f"p{i}", 1000, 1, 1, 500) for i in range(60)]
    pods += [OpenbPod(f"c{i}", 2000, 1, 0, 0) for i in range(36)]
    pods += [OpenbPod(f"r{i}", 3000 + i, 1, 1, 1000) for i in range(4)]  # 4 rare classes
    shapes = typical_shapes(pods)
    # 60 + 36 = 96 % covered after two classes: the rare ones are left out
    assert [(s.count, s.milli, s.cpu_milli) for s in shapes] == [(1, 500, 1000), (0, 0, 2000)]
    assert abs(sum(s.weight for s in shapes) - 1) < 1e-9 and shapes[0].weight == 60 / 96
    assert openb_policy("fgd", pods).workload == shapes and openb_policy("fgd").score_levels == 100
    # fgd-full: the same rule against every class, the rare ones included
    full = openb_policy("fgd-full", pods)
    assert full.workload == typical_shapes(pods, popularity=1.0) and full.score_levels == 100
    assert len(full.workload) == 6 and abs(sum(s.weight for s in full.workload) - 1) < 1e-9
    assert {s.cpu_milli for s in full.workload} >= {3000, 3003}


def test_fgd_typical_pods_order_ties_and_type_strings_as_fgd() -> None:
    # Equal frequencies: FGD sorts classes in decreasing (frequency, CPU, milli, count, type
    # string) order, so at the 95 % cut the class with more CPU is kept.
    pods = [OpenbPod(f"p{i}", 1000, 1, 1, 500) for i in range(90)]
    pods += [OpenbPod(f"a{i}", 2000, 1, 1, 1000) for i in range(5)]
    pods += [OpenbPod(f"b{i}", 4000, 1, 1, 1000) for i in range(5)]
    shapes = typical_shapes(pods)
    assert [s.cpu_milli for s in shapes] == [1000, 4000]
    # The trace's type string is the class: a repeated model is another class, as in FGD.
    pinned = [OpenbPod(f"v{i}", 1000, 1, 1, 1000, ("V100M16", "V100M32")) for i in range(50)]
    pinned += [OpenbPod(f"w{i}", 1000, 1, 1, 1000, ("V100M16", "V100M32", "V100M32")) for i in range(50)]
    assert len(typical_shapes(pinned)) == 2
    assert len({s.models for s in typical_shapes(pinned)}) == 1  # both allow the same models


def test_measurement_window_around_full_arrival(tmp_path: Path) -> None:
    nodes = _nodes(tmp_path)
    rng = random.Random(3)
    tasks = tune_workload(PODS, 5000, rng, 1.3)
    cumulative = 0
    expected_arrivals = 0
    for expected_arrivals, pod in enumerate(tasks, start=1):  # noqa: B007
        cumulative += pod.total_gpu_milli
        if cumulative >= 5000:
            break
    for policy in ("random", "best-fit", "fgd", "gpusched"):
        run = run_openb(PODS, nodes, policy, seed=3)
        assert run.capacity_milli == 5000 and run.tuned_tasks == len(tasks)
        # the crossing point: right after the arrival that brings the request to >= 100 %
        assert run.tasks_arrived == expected_arrivals and run.arrived_milli == cumulative
        assert 0 < run.allocated_milli <= run.capacity_milli
        assert run.at_crossing == round(100 * (1 - run.allocated_milli / 5000), 4)
        # on 5 GPUs no arrival lands within 99.5-100.5 %: the mean over 99-101 % or the crossing
        assert 0 <= run.unallocated_gpu_pct <= 100


def test_host_cpu_limits_what_fits(tmp_path: Path) -> None:
    # Each node has room for GPUs but the pods need more CPU than any node offers.
    hungry = [OpenbPod("h", 32000, 1024, 1, 500)]
    run = run_openb(hungry, _nodes(tmp_path), "best-fit", seed=0)
    assert run.allocated_milli == 0 and run.tasks_failed == run.tasks_arrived


def test_seeds_give_a_median(tmp_path: Path) -> None:
    result = run_openb_seeds(PODS, _nodes(tmp_path), "random", [0, 1, 2])
    assert result["seeds"] == [0, 1, 2] and len(result["unallocated_gpu_pct"]) == 3
    assert result["unallocated_gpu_pct_median"] == sorted(result["unallocated_gpu_pct"])[1]


def test_measure_is_the_mean_over_arrivals_at_99_5_to_100_5_percent(tmp_path: Path) -> None:
    # 20 nodes x 8 GPUs and 0.1-GPU pods: everything fits until the cluster is full, so the
    # allocation follows the arrivals up to 100 % and the window mean sits just below 100 %.
    path = tmp_path / "big.csv"
    rows = "".join(f"n{i},96000,393216,8,T4\n" for i in range(20))
    path.write_text("sn,cpu_milli,memory_mib,gpu,model\n" + rows, encoding="utf-8")
    pods = [OpenbPod("s", 100, 10, 1, 100)]
    run = run_openb(pods, load_openb_nodes(path), "best-fit", seed=0)
    assert run.at_crossing == 0.0  # at the crossing arrival every GPU is taken
    # 99.5, 99.5625, ..., 100.5 % (0.1 GPU of 160 each); both ends round to 100 as in pandas
    assert run.window_arrivals == 17
    # allocation 99.5 ... 100 (9 arrivals) then 100 (8 more)
    expected = 100 - (sum(round(99.5 + 0.0625 * i, 2) for i in range(9)) + 8 * 100) / 17
    assert abs(run.unallocated_gpu_pct - expected) < 1e-3


def test_ties_go_by_a_seeded_random_node_order_as_in_the_fgd_simulator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The FGD simulator prefixes every node name with its index in a seeded rand.Perm and breaks
    # equal scores by the lowest name, so its tie order is a random permutation per seed, not the
    # trace's name order. Our policies break ties by inventory order: the fleet must be built in
    # such a permutation (drawn after the tuning, from the same generator).
    path = tmp_path / "same.csv"
    names = [f"n{i:02d}" for i in range(12)]
    rows = "".join(f"{n},32000,131072,2,T4\n" for n in names)
    path.write_text("sn,cpu_milli,memory_mib,gpu,model\n" + rows, encoding="utf-8")
    nodes = load_openb_nodes(path)
    built: list[list[str]] = []
    real = openb.openb_fleet

    def spy(listed, **kw):  # type: ignore[no-untyped-def]
        built.append([n.name for n in listed])
        return real(listed, **kw)

    monkeypatch.setattr(openb, "openb_fleet", spy)
    pods = [OpenbPod("w", 4000, 8192, 1, 1000), OpenbPod("c", 2000, 4096, 0, 0)]
    orders = {}
    for seed in (5, 6):
        run_openb(pods, nodes, "fgd", seed=seed)
        orders[seed] = built[-1]
        rng = random.Random(seed)
        tune_workload(pods, 24000, rng, 1.3)
        assert orders[seed] == [n.name for n in node_order(nodes, rng)]
        assert sorted(orders[seed]) == names and orders[seed] != names
    assert orders[5] != orders[6]
    run_openb(pods, nodes, "fgd", seed=5, shuffle_nodes=False)
    assert built[-1] == names


def test_fgd_memory_gives_gpu_pods_ram_in_their_shapes_and_cpu_only_pods_none(tmp_path: Path) -> None:
    pods = [OpenbPod("a", 1000, 4096, 1, 500), OpenbPod("b", 1000, 8192, 1, 500)]
    pods.append(OpenbPod("c", 2000, 4096, 0, 0))
    policy = openb_policy("fgd-memory", pods)
    # RAM splits (1000, 500) into two classes for GPU decisions; without it they are one.
    assert sorted((s.milli, s.host_memory_bytes) for s in policy.workload) == [
        (0, 4096 * 2**20), (500, 4096 * 2**20), (500, 8192 * 2**20)
    ]
    assert policy.host_task_workload == typical_shapes(pods, popularity=1.0)
    assert all(s.host_memory_bytes == 0 for s in policy.host_task_workload)
    assert policy.lookahead_ties == openb_policy("fgd-lookahead", pods).lookahead_ties > 0
    assert not openb_policy("fgd-lookahead", pods).host_task_workload
    # And the procedure runs with it end to end.
    run = run_openb(PODS, _nodes(tmp_path), "fgd-memory", seed=3)
    assert 0 < run.allocated_milli <= run.capacity_milli
