"""The packing bound of the openb measure (gpusched.sim.packing_bound) and its use in run_openb."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest

from gpusched.sim.openb import openb_bounds, reading_span, run_openb, run_openb_seeds, tune_workload
from gpusched.sim.packing_bound import (
    cpu_tasks,
    gpu_items,
    gpus_by_model,
    host_gpu_items,
    host_packing_bound,
    node_groups,
    packing_bound,
    unallocated_bound_pct,
    unallocated_host_bound_pct,
)
from gpusched.sim.traces import OpenbNode, OpenbPod, load_openb_nodes


def _best_by_enumeration(items: dict[int, int], gpus: int) -> int:
    """The exact optimum of a tiny instance: every way to hand each item to a GPU or to none."""
    flat = [s for s, n in items.items() for _ in range(n)]
    best = 0
    for owner in itertools.product(range(gpus + 1), repeat=len(flat)):  # gpus = left out
        load = [0] * gpus
        for size, g in zip(flat, owner, strict=True):
            if g < gpus:
                load[g] += size
        if max(load) <= 1000:
            best = max(best, sum(load))
    return best


ANY: frozenset[str] = frozenset()


def _any(items: dict[int, int]) -> dict[tuple[int, frozenset[str]], int]:
    return {(size, ANY): n for size, n in items.items()}


def test_the_bound_is_the_packing_optimum_on_instances_where_the_lp_is_integral() -> None:
    # Three 0.6s and two 0.5s on 3 GPUs: the 0.5s share one GPU, two 0.6s take the others.
    assert packing_bound(_any({600: 3, 500: 2}), {"T4": 3}) == pytest.approx(2200)
    assert _best_by_enumeration({600: 3, 500: 2}, 3) == 2200
    # Only 0.6s: every GPU wastes 0.4 whatever the placement.
    assert packing_bound(_any({600: 10}), {"T4": 4}) == pytest.approx(2400)
    # Enough room for everything: the bound is what arrived.
    assert packing_bound(_any({300: 2, 1000: 1}), {"T4": 4}) == pytest.approx(1600)
    assert packing_bound({}, {"T4": 4}) == 0.0


def test_pinned_items_fit_only_their_models() -> None:
    v100 = frozenset({"V100M16"})
    # Four whole GPUs pinned to V100 on a fleet of 2 V100 + 4 T4: only two can be held.
    assert packing_bound({(1000, v100): 4}, {"V100M16": 2, "T4": 4}) == pytest.approx(2000)
    # Pinned to a model the fleet lacks: nothing.
    assert packing_bound({(500, frozenset({"A100"})): 3}, {"T4": 4}) == 0.0
    # Unpinned items may use the V100s too.
    assert packing_bound({(1000, v100): 1, (1000, ANY): 5}, {"V100M16": 2, "T4": 4}) == pytest.approx(6000)


@pytest.mark.parametrize(
    ("items", "gpus"),
    [({700: 2, 400: 3, 300: 1}, 3), ({550: 3, 450: 2, 250: 2}, 3), ({900: 1, 350: 3, 200: 2}, 2)],
)
def test_the_bound_is_never_below_the_exact_optimum(items: dict[int, int], gpus: int) -> None:
    exact = _best_by_enumeration(items, gpus)
    bound = packing_bound(_any(items), {"T4": gpus})
    assert exact <= bound + 1e-6
    assert bound <= sum(s * n for s, n in items.items()) + 1e-6


def test_bad_item_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match=r"item sizes must lie in 1\.\.1000"):
        packing_bound({(1500, ANY): 1}, {"T4": 2})


def test_whole_gpu_pods_count_one_item_per_gpu_and_cpu_pods_none() -> None:
    pods = [
        OpenbPod("a", 1000, 10, 4, 1000),
        OpenbPod("m", 1000, 10, 2, 0),  # a multi-GPU pod takes whole GPUs whatever its gpu_milli
        OpenbPod("b", 1000, 10, 1, 250, ("P100",)),  # trace names resolve through the catalog
        OpenbPod("c", 1000, 10, 0, 0),
    ]
    p100 = frozenset({"P100-PCIE-16GB"})
    assert gpu_items(pods) == {(1000, ANY): 6, (250, p100): 1}
    fleet = {"P100-PCIE-16GB": 2, "T4": 6}
    assert unallocated_bound_pct(pods, fleet) == pytest.approx(100 * (1 - 6250 / 8000))
    assert unallocated_bound_pct(pods, {"T4": 8}) == pytest.approx(25.0)  # no P100: the 0.25 fits nowhere


def test_node_models_are_counted_by_catalog_name(tmp_path: Path) -> None:
    assert gpus_by_model(_fleet(tmp_path, 2, v100=3)) == {"T4": 8, "V100-SXM2-16GB": 6}


def _fleet(tmp_path: Path, nodes: int, v100: int = 0):  # type: ignore[no-untyped-def]
    path = tmp_path / "nodes.csv"
    rows = "".join(f"n{i},96000,393216,4,T4\n" for i in range(nodes))
    rows += "".join(f"v{i},96000,393216,2,V100M16\n" for i in range(v100))
    path.write_text("sn,cpu_milli,memory_mib,gpu,model\n" + rows, encoding="utf-8")
    return load_openb_nodes(path)


def test_no_policy_reads_below_the_bound_and_it_binds_when_sizes_waste_gpus(tmp_path: Path) -> None:
    nodes = _fleet(tmp_path, 10, v100=2)
    mixed = [
        OpenbPod("pinned", 2000, 1024, 1, 1000, ("V100M16",)),
        OpenbPod("big", 4000, 1024, 1, 850),
        OpenbPod("half", 2000, 1024, 1, 450),
        OpenbPod("third", 2000, 1024, 1, 300),
        OpenbPod("pair", 8000, 1024, 2, 1000),
    ]
    for policy, seed in itertools.product(("random", "best-fit", "fgd", "gpusched"), (0, 1)):
        run = run_openb(mixed, nodes, policy, seed)
        # each reading is rounded to 0.01 %, so a policy at the bound may read 0.005 below it
        assert run.unallocated_gpu_pct >= run.unallocated_bound_pct - 0.005, (policy, seed)
        assert run.unallocated_bound_pct > 0  # the 0.85s strand 0.15 of their GPU
    # 0.6-GPU pods only: every GPU holds one and wastes 0.4, so every policy reads the bound.
    only = [OpenbPod("s", 1000, 1024, 1, 600)]
    for policy in ("random", "best-fit", "fgd"):
        run = run_openb(only, nodes, policy, 0)
        assert run.unallocated_bound_pct == pytest.approx(40.0)
        assert run.unallocated_gpu_pct == pytest.approx(40.0, abs=0.01)


def test_the_seed_results_carry_the_bound_per_seed(tmp_path: Path) -> None:
    result = run_openb_seeds([OpenbPod("s", 1000, 1024, 1, 600)], _fleet(tmp_path, 4), "fgd", [0, 1])
    assert result["unallocated_gpu_pct_bound"] == [pytest.approx(40.0), pytest.approx(40.0)]


def test_a_solver_failure_keeps_a_valid_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    import scipy.optimize

    class Failed:
        success = False
        ineqlin = None

    monkeypatch.setattr(scipy.optimize, "linprog", lambda *args, **kwargs: Failed())
    # no LP answer: the bound falls back to what arrived (capped by the GPUs), never below the optimum
    assert packing_bound(_any({600: 3, 500: 2}), {"T4": 3}) == pytest.approx(2800)
    assert packing_bound(_any({600: 10}), {"T4": 4}) == pytest.approx(4000)


# ---- the bound that counts host CPU and memory (host_packing_bound) ----------------------------


def _exact_with_host(pods: list[OpenbPod], nodes: list[OpenbNode]) -> int | None:
    """The most GPU volume any placement holding every CPU-only pod can hold (None: none holds
    them all): every way to give each GPU pod GPUs of one node or nothing, and each CPU-only pod a
    node."""
    gpu_pods = [p for p in pods if p.num_gpu]
    cpu_only = [p for p in pods if not p.num_gpu]
    options: list[list[tuple[int, tuple[int, ...]] | None]] = []
    for p in gpu_pods:
        here: list[tuple[int, tuple[int, ...]] | None] = [None]
        for ni, n in enumerate(nodes):
            if not p.gpu_spec or n.model in p.gpu_spec:
                here += [(ni, gs) for gs in itertools.combinations(range(n.gpus), p.num_gpu)]
        options.append(here)
    best: int | None = None
    for choice in itertools.product(*options):
        load: dict[tuple[int, int], int] = {}
        cpu, mem, volume = [0] * len(nodes), [0] * len(nodes), 0
        for p, c in zip(gpu_pods, choice, strict=True):
            if c is not None:
                ni, gs = c
                cpu[ni] += p.cpu_milli
                mem[ni] += p.memory_mib
                milli = p.gpu_milli if p.num_gpu == 1 else 1000
                for g in gs:
                    load[(ni, g)] = load.get((ni, g), 0) + milli
                    volume += milli
        if any(v > 1000 for v in load.values()) or (best is not None and volume <= best):
            continue
        for owner in itertools.product(range(len(nodes)), repeat=len(cpu_only)):
            c2, m2 = cpu[:], mem[:]
            for p, ni in zip(cpu_only, owner, strict=True):
                c2[ni] += p.cpu_milli
                m2[ni] += p.memory_mib
            if all(c2[i] <= n.cpu_milli and m2[i] <= n.memory_mib for i, n in enumerate(nodes)):
                best = volume
                break
    return best


def _host(pods: list[OpenbPod], nodes: list[OpenbNode], **kwargs: int) -> float:
    return host_packing_bound(host_gpu_items(pods), cpu_tasks(pods), node_groups(nodes), **kwargs)


def _random_instance(rng: random.Random) -> tuple[list[OpenbPod], list[OpenbNode]]:
    nodes = [
        OpenbNode(f"n{i}", rng.choice([4000, 8000, 12000]), rng.choice([8192, 16384]), rng.choice([1, 2]),
                  rng.choice(["T4", "T4", "P100"]))
        for i in range(rng.randint(1, 3))
    ]
    pods = []
    for j in range(rng.randint(2, 5)):
        k = rng.choice([1, 1, 1, 2])
        pods.append(OpenbPod(f"g{j}", rng.choice([1000, 2000, 3000, 5000]), rng.choice([1024, 4096, 8192]), k,
                             rng.choice([300, 500, 700, 1000]) if k == 1 else 1000,
                             rng.choice([(), (), ("P100",)])))
    pods += [OpenbPod(f"c{j}", rng.choice([1000, 3000, 6000]), rng.choice([1024, 6000]), 0, 0)
             for j in range(rng.randint(0, 2))]
    return pods, nodes


def test_the_host_bound_lies_between_the_exact_optimum_and_the_gpu_only_bound() -> None:
    rng = random.Random(1)
    checked = tighter = 0
    for _ in range(120):
        pods, nodes = _random_instance(rng)
        exact = _exact_with_host(pods, nodes)
        if exact is None:
            continue
        host = _host(pods, nodes)
        gpu_only = packing_bound(gpu_items(pods), gpus_by_model(nodes))
        assert exact <= host + 1e-6 <= gpu_only + 2e-6, (pods, nodes, exact, host, gpu_only)
        # stopped after one round of column generation, the dual bound still holds
        assert exact <= _host(pods, nodes, max_rounds=1) + 1e-6
        checked += 1
        tighter += host < gpu_only - 1e-6
    assert checked >= 80 and tighter >= 20  # host CPU/RAM bind in many of them


def test_the_host_bound_is_strictly_tighter_where_cpu_only_tasks_starve_the_gpus() -> None:
    # Two one-GPU nodes of 8 cores; two CPU-only tasks of 6 cores must be held, one per node, so
    # no 0.5-GPU pod of 4 cores fits: the GPU-only bound holds all four (2,000), this one none.
    nodes = [OpenbNode(f"n{i}", 8000, 65536, 1, "T4") for i in range(2)]
    pods = [OpenbPod(f"g{j}", 4000, 1024, 1, 500) for j in range(4)]
    pods += [OpenbPod(f"c{j}", 6000, 1024, 0, 0) for j in range(2)]
    assert packing_bound(gpu_items(pods), gpus_by_model(nodes)) == pytest.approx(2000)
    assert _host(pods, nodes) == pytest.approx(0.0, abs=1e-6)
    assert _exact_with_host(pods, nodes) == 0
    assert unallocated_host_bound_pct(pods, nodes) == pytest.approx(100.0)
    assert unallocated_bound_pct(pods, gpus_by_model(nodes)) == pytest.approx(0.0)
    # Without the CPU-only tasks the CPU holds two pods per node: both bounds say everything.
    gpu_only = [p for p in pods if p.num_gpu]
    assert _host(gpu_only, nodes) == pytest.approx(2000)


def test_the_host_bound_counts_per_node_cpu_not_only_the_total() -> None:
    # 4 + 4 cores over two one-GPU nodes of 4 cores: in total an 8-core and a 0.3-GPU pod would fit,
    # but no node holds 8 cores; and a CPU-only task no node can hold is left out (it always fails).
    nodes = [OpenbNode(f"n{i}", 4000, 65536, 1, "T4") for i in range(2)]
    pods = [OpenbPod("big", 8000, 1024, 1, 700), OpenbPod("small", 4000, 1024, 1, 300),
            OpenbPod("huge", 16000, 1024, 0, 0)]
    assert packing_bound(gpu_items(pods), gpus_by_model(nodes)) == pytest.approx(1000)
    assert _host(pods, nodes) == pytest.approx(300)


def test_the_host_bound_falls_back_to_the_gpu_only_one_when_cpu_only_tasks_cannot_all_fit() -> None:
    nodes = [OpenbNode("n", 8000, 65536, 1, "T4")]
    pods = [OpenbPod("g", 1000, 1024, 1, 500)] + [OpenbPod(f"c{j}", 6000, 1024, 0, 0) for j in range(2)]
    assert _exact_with_host(pods, nodes) is None  # no placement holds both CPU-only tasks
    assert _host(pods, nodes) == pytest.approx(500)  # nothing to bound: the GPU-only bound


def test_the_host_bound_needs_a_node_with_all_of_a_pods_gpus_and_memory() -> None:
    nodes = [OpenbNode("a", 64000, 65536, 2, "T4"), OpenbNode("b", 64000, 8192, 2, "T4")]
    pods = [OpenbPod("quad", 4000, 1024, 4, 1000), OpenbPod("fat", 1000, 16384, 1, 1000),
            OpenbPod("fat2", 1000, 16384, 1, 1000), OpenbPod("fat3", 1000, 16384, 1, 1000)]
    # GPU-only: 4 whole GPUs of 4 arrivals fill the fleet; with hosts the 4-GPU pod fits no node and
    # the 16 GiB pods only node a (two GPUs).
    assert packing_bound(gpu_items(pods), gpus_by_model(nodes)) == pytest.approx(4000)
    assert _host(pods, nodes) == pytest.approx(2000)


def test_openb_bounds_cover_the_same_arrivals_as_a_run(tmp_path: Path) -> None:
    nodes = _fleet(tmp_path, 6, v100=2)
    pods = [
        OpenbPod("pinned", 2000, 1024, 1, 1000, ("V100M16",)),
        OpenbPod("big", 40000, 1024, 1, 850),
        OpenbPod("third", 2000, 1024, 1, 300),
        OpenbPod("cpu", 60000, 200000, 0, 0),
    ]
    for seed in (0, 1, 2):
        run = run_openb(pods, nodes, "best-fit", seed)
        bounds = openb_bounds(pods, nodes, seed)
        assert bounds["unallocated_bound_pct"] == run.unallocated_bound_pct
        assert bounds["unallocated_host_bound_pct"] >= run.unallocated_bound_pct
        if run.cpu_tasks_failed == 0:  # the host bound covers the run
            assert run.unallocated_gpu_pct >= bounds["unallocated_host_bound_pct"] - 0.005
    capacity = 6 * 4000 + 2 * 2000
    tasks = tune_workload(pods, capacity, random.Random(0))
    assert 0 < reading_span(tasks, capacity) <= len(tasks)
    assert "unallocated_host_bound_pct" not in openb_bounds(pods, nodes, 0, host=False)


def test_a_run_counts_the_cpu_only_tasks_it_could_not_place(tmp_path: Path) -> None:
    # Each CPU-only task takes a whole node's CPU; the 5th of them finds no node.
    nodes = _fleet(tmp_path, 4)
    pods = [OpenbPod("s", 1000, 1024, 1, 600)] * 20 + [OpenbPod("c", 96000, 1024, 0, 0)] * 5
    run = run_openb(pods, nodes, "best-fit", 0, shuffle_nodes=False)
    assert run.cpu_tasks_failed >= 1
    result = run_openb_seeds(pods, nodes, "best-fit", [0])
    assert result["cpu_tasks_failed"] == [run.cpu_tasks_failed]


def test_bench_openb_bound_writes_both_bounds_per_seed(tmp_path: Path) -> None:
    from gpusched.cli import main

    (tmp_path / "nodes.csv").write_text(
        "sn,cpu_milli,memory_mib,gpu,model\n" + "".join(f"n{i},8000,65536,1,T4\n" for i in range(2)),
        encoding="utf-8")
    (tmp_path / "pods.csv").write_text(
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\n"
        + "".join(f"g{j},4000,1024,1,500,\n" for j in range(4)) + "c0,6000,1024,0,0,\nc1,6000,1024,0,0,\n",
        encoding="utf-8")
    out = tmp_path / "b.json"
    code = main(["bench", "openb-bound", "--pods", str(tmp_path / "pods.csv"), "--nodes",
                 str(tmp_path / "nodes.csv"), "--seeds", "2", "--quiet", "--out", str(out)])
    assert code == 0
    data = json.loads(out.read_text(encoding="utf-8"))
    assert data["seeds"] == [0, 1] and len(data["unallocated_gpu_pct_bound"]) == 2
    host, gpu = data["unallocated_gpu_pct_bound_host"], data["unallocated_gpu_pct_bound"]
    assert all(h >= g for h, g in zip(host, gpu, strict=True))
    assert "cpu_tasks_failed" not in data
    code = main(["bench", "openb-bound", "--pods", str(tmp_path / "pods.csv"), "--nodes",
                 str(tmp_path / "nodes.csv"), "--seeds", "1", "--no-host", "--check", "gpusched,best-fit",
                 "--quiet", "--out", str(out)])
    data = json.loads(out.read_text(encoding="utf-8"))
    assert code == 0 and data["unallocated_gpu_pct_bound_host"] is None
    assert sorted(data["cpu_tasks_failed"]) == ["best-fit", "gpusched"]


def test_the_report_gives_both_bounds_and_the_distance_ratios(tmp_path: Path) -> None:
    from gpusched.bench.report import bound_distance_section

    def write(path: Path, data: dict[str, object]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data), encoding="utf-8")

    w = "openb_pod_list_cpu200"
    write(tmp_path / f"{w}__fgd.json",
          {"unallocated_gpu_pct_median": 5.0, "unallocated_gpu_pct_bound": [3.0, 3.0]})
    write(tmp_path / f"{w}__gpusched.json", {"unallocated_gpu_pct_median": 4.0})
    write(tmp_path / "built" / "openb_pod_list_x__gpusched.json",
          {"unallocated_gpu_pct_median": 4.0, "unallocated_gpu_pct_bound": [2.0]})
    assert "| cpu200 | 3.00 | — | 5.00 | 4.00 | 0.50 | — |" in bound_distance_section(tmp_path)
    write(tmp_path / "bounds" / f"{w}.json",
          {"unallocated_gpu_pct_bound": [3.0, 3.0, 3.0], "unallocated_gpu_pct_bound_host": [3.5, 3.5, 3.6]})
    lines = bound_distance_section(tmp_path)
    assert "| cpu200 | 3.00 | 3.50 | 5.00 | 4.00 | 0.50 | 0.33 ? |" in lines  # runs without the count
    assert "| x (`built/`) | 2.00 | — | — | 4.00 | — | — |" in lines
    assert bound_distance_section(tmp_path / "none") == []
    # A binding CPU/mem bound covers only the runs that held every CPU-only task.
    write(tmp_path / f"{w}__gpusched.json", {"unallocated_gpu_pct_median": 4.0, "cpu_tasks_failed": [0, 2]})
    write(tmp_path / f"{w}__fgd.json", {"unallocated_gpu_pct_median": 5.0, "cpu_tasks_failed": [0, 0]})
    assert "| cpu200 | 3.00 | 3.50 | 5.00 | 4.00 | 0.50 | 0.33 † |" in bound_distance_section(tmp_path)
    # runs without the count: openb-bound --check's count, where there is one
    write(tmp_path / f"{w}__gpusched.json", {"unallocated_gpu_pct_median": 4.0})
    write(tmp_path / "bounds" / "checks" / f"{w}.json", {"cpu_tasks_failed": {"gpusched": [0, 0]}})
    row = "| cpu200 | 3.00 | 3.50 | 5.00 | 4.00 | 0.50 | 0.33 (2/3 seeds checked) |"
    assert row in bound_distance_section(tmp_path)
