"""Rank tests of our openb runs against the published per-seed results (gpusched.bench.calibration)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpusched.bench.calibration import compare, holm, rank_p, read_published_seeds
from gpusched.bench.report import openb_report

HEADER = "# comment\nworkload\tpolicy\t" + "\t".join(f"seed{s}" for s in range(42, 52)) + "\n"
SAME = [5.0, 5.1, 5.2, 5.3, 5.4, 5.5, 5.6, 5.7, 5.8, 5.9]


def _row(workload: str, policy: str, values: list[float]) -> str:
    return f"{workload}\t{policy}\t" + "\t".join(f"{v:.2f}" for v in values) + "\n"


def _published(tmp_path: Path, shared: str, per_seed_rows: str) -> tuple[Path, Path]:
    """The openb results folder with ``published_per_seed.tsv``, and the published-medians TSV
    (FGD 5.45 on ``shared``)."""
    folder = tmp_path / "openb"
    folder.mkdir(exist_ok=True)
    medians = tmp_path / "pub.tsv"
    medians.write_text(
        "workload\tRandom\tDotProd\tGpuClustering\tGpuPacking\tBestFit\tFGD\n"
        f"{shared}\t13.75\t9.4\t8.4\t8.2\t7.09\t5.45\n"
    )
    (folder / "published_per_seed.tsv").write_text(HEADER + per_seed_rows)
    return folder, medians


def _run(where: Path, workload: str, policy: str, values: list[float], **extra: object) -> None:
    where.mkdir(parents=True, exist_ok=True)
    (where / f"{workload}__{policy}.json").write_text(json.dumps({
        "unallocated_gpu_pct_median": sorted(values)[len(values) // 2], "unallocated_gpu_pct": values,
        "seeds": list(range(len(values))), "measure": "window", **extra,
    }))


def test_holm_matches_the_step_down_by_hand() -> None:
    # sorted p: 0.01 (×3 = 0.03), 0.02 (×2 = 0.04), 0.04 (×1, kept monotone at 0.04)
    assert holm([0.04, 0.01, 0.02]) == pytest.approx([0.04, 0.03, 0.04])
    assert holm([0.5, 0.9]) == [1.0, 1.0]  # capped at 1


def test_rank_test_tells_a_shift_from_seed_noise() -> None:
    shifted = [v + 1.0 for v in SAME]
    assert rank_p(SAME, shifted, "less") < 1e-4  # every one of ours lower: exact p = 1 / C(20, 10)
    assert rank_p(shifted, SAME, "less") > 0.99
    interleaved = [v + 0.05 for v in SAME]
    assert rank_p(interleaved, SAME, "two-sided") > 0.5


def test_compare_corrects_over_every_row(tmp_path: Path) -> None:
    tsv = tmp_path / "per_seed.tsv"
    tsv.write_text(HEADER + _row("a", "fgd", SAME) + _row("b", "fgd", SAME))
    published = read_published_seeds(tsv)
    assert published[("a", "fgd")] == tuple(SAME)
    ours = {("a", "fgd"): [v - 1.0 for v in SAME], ("b", "fgd"): SAME, ("c", "fgd"): SAME}
    rows = compare(ours, published, [("fgd", "fgd")], "two-sided")
    assert [r.workload for r in rows] == ["a", "b"]  # "c" has no published runs
    a, b = rows
    assert a.delta == pytest.approx(-1.0)
    assert a.p_holm == pytest.approx(min(1.0, 2 * a.p))  # the smaller p of two tests doubles
    assert a.p_holm < 0.05 < b.p_holm


def test_openb_report_adds_the_rank_tests_when_per_seed_results_are_there(tmp_path: Path) -> None:
    workload = "openb_pod_list_default"
    folder, medians = _published(tmp_path, workload, _row(workload, "fgd", SAME))
    _run(folder, workload, "fgd", [v + 0.02 for v in SAME])
    _run(folder, workload, "fgd-lookahead", [v - 1.0 for v in SAME])
    text = openb_report(folder, medians)
    assert "Significant after correction: 0 of 1." in text  # fgd: +0.02, noise
    assert "- fgd-lookahead: significantly below on 1 of 1 lists." in text
    assert "| default | fgd-lookahead | fgd | 4.45 | 5.45 | -1.00 | 0.000 | **0.000** |" in text


def test_openb_report_tests_the_unseen_lists_apart_from_the_shared_ones(tmp_path: Path) -> None:
    shared, unseen = "openb_pod_list_default", "openb_pod_list_cpu250"
    folder, medians = _published(tmp_path, shared, _row(shared, "fgd", SAME) + _row(unseen, "fgd", SAME))
    _run(folder, shared, "fgd", [v + 0.02 for v in SAME])
    _run(folder / "unseen", unseen, "fgd", [v + 1.0 for v in SAME])
    text = openb_report(folder, medians)
    shared_part, unseen_part = text.split("(pod lists not in the shared traces, `unseen/`)")
    assert "Significant after correction: 0 of 1." in shared_part and "cpu250" not in shared_part
    # the unseen list is tested on its own, with its own correction, and is the one that is off
    assert "Significant after correction: 1 of 1 (cpu250 fgd)." in unseen_part
    assert "| cpu250 | fgd | fgd | 6.45 | 5.45 | +1.00 |" in unseen_part


def test_openb_report_sets_the_packing_bound_beside_the_published_fgd(tmp_path: Path) -> None:
    workload = "openb_pod_list_default"
    folder, medians = _published(tmp_path, workload, _row(workload, "fgd", SAME))
    _run(folder, workload, "random", [13.0] * 10, unallocated_gpu_pct_bound=[3.0] * 10)
    _run(folder, workload, "fgd-lookahead", [4.45] * 10, unallocated_gpu_pct_bound=[3.5, 3.5])
    text = openb_report(folder, medians)
    # the bound of the run with the most seeds (3.0); room 5.45 - 3.0; fgd-lookahead takes 1.00 of 2.45
    assert "| default | 3.00 | 5.45 | 2.45 | — | — | — | 4.45 (+41%) |" in text
