"""The packing bound of the openb measure (gpusched.sim.packing_bound) and its use in run_openb."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from gpusched.sim.openb import run_openb, run_openb_seeds
from gpusched.sim.packing_bound import gpu_items, gpus_by_model, packing_bound, unallocated_bound_pct
from gpusched.sim.traces import OpenbPod, load_openb_nodes


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
