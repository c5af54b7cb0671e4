"""The openb list generator on small synthetic pod lists (and the real ones when the traces are there)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from gpusched.bench.openb_lists import build_lists
from gpusched.cli import main
from gpusched.sim.openb_lists import (
    Recipe,
    Row,
    build,
    cpu_ratio_for,
    kind,
    measure,
    parse_csv,
    render_csv,
    sha256_text,
    spec_distribution,
)
from gpusched.sim.traces import default_trace_dir, load_openb_pods

COLUMNS = ["name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli", "gpu_spec", "qos", "pod_phase",
           "creation_time", "deletion_time", "scheduled_time"]
SPECS = {
    "share": [("T4", 5), ("P100", 3)],
    "gpu1": [("T4", 4), ("G2", 2), ("V100M16|V100M32", 1)],
    "gpu2": [("P100|V100M16|V100M32", 1)],
    "gpu4": [("G2", 2)],
    "gpu8": [("G2", 3), ("G3", 1)],
}


def _default(n: int = 600, seed: int = 7) -> list[Row]:
    """A default-like list: CPU-only, sharing, one-GPU and multi-GPU tasks in default's proportions."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        roll = rng.random()
        if roll < 0.13:
            num, milli, cpu = 0, 0, rng.choice([4000, 8000, 16000, 32000])
        elif roll < 0.51:
            num, milli, cpu = 1, rng.choice([100, 250, 460, 500, 750]), rng.choice([2000, 6000, 8000])
        elif roll < 0.98:
            num, milli, cpu = 1, 1000, rng.choice([8000, 12000, 16000])
        else:
            num, milli, cpu = rng.choice([2, 4, 8]), 1000, rng.choice([16000, 32000, 64000])
        rows.append({"name": f"openb-pod-{i:04d}", "cpu_milli": str(cpu), "memory_mib": str(cpu * 2),
                     "num_gpu": str(num), "gpu_milli": str(milli), "gpu_spec": "",
                     "qos": rng.choice(["LS", "BE"]), "pod_phase": "Running",
                     "creation_time": str(i * 10), "deletion_time": str(i * 10 + 99),
                     "scheduled_time": str(i * 10)})
    return rows


RECIPES = [
    Recipe("cpu-up", seed=1, cpu_ratio=0.6),
    Recipe("cpu-down", seed=1, cpu_ratio=0.05),
    Recipe("share-up", seed=2, gpushare=0.7),
    Recipe("share-down", seed=2, gpushare=0.1),
    Recipe("spec", seed=3, gpuspec=0.3),
    Recipe("multi", seed=4, multigpu=0.35),
    Recipe("mixed", seed=5, cpu_ratio=0.45, gpushare=0.6),
]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name)
def test_same_seed_same_list_and_the_target_is_reached(recipe: Recipe) -> None:
    base = _default()
    rows = build(base, recipe, specs=SPECS)
    assert rows == build(base, recipe, specs=SPECS)
    got = measure(rows)
    for knob, tolerance in (("cpu_ratio", 0.01), ("gpushare", 0.01), ("gpuspec", 0.01), ("multigpu", 0.02)):
        target = getattr(recipe, knob)
        if target is not None:
            assert got[knob] == pytest.approx(target, abs=tolerance), knob
    assert [r["name"] for r in rows] == [f"openb-pod-{i:04d}" for i in range(len(rows))]


def test_a_different_seed_draws_a_different_list() -> None:
    base = _default()
    assert build(base, Recipe("a", seed=1, gpushare=0.7)) != build(base, Recipe("a", seed=2, gpushare=0.7))


def test_each_knob_changes_only_what_the_family_changes() -> None:
    base = _default()
    before = measure(base)

    def gpu_tasks(rows: list[Row]) -> list[tuple[str, ...]]:
        return sorted((r["cpu_milli"], r["num_gpu"], r["gpu_milli"]) for r in rows if r["num_gpu"] != "0")

    cpu = build(base, Recipe("c", cpu_ratio=0.6))  # GPU tasks unchanged
    assert gpu_tasks(cpu) == gpu_tasks(base)
    share = build(base, Recipe("s", gpushare=0.7))  # same task count, CPU-only tasks kept
    assert len(share) == len(base) and measure(share)["cpu_only_tasks"] == before["cpu_only_tasks"]
    spec = build(base, Recipe("p", gpuspec=0.3), specs=SPECS)  # same tasks, some pinned
    def unpinned(rows: list[Row]) -> list[Row]:
        return [{k: v for k, v in r.items() if k != "gpu_spec"} for r in rows]

    assert unpinned(spec) == unpinned(base) and measure(spec)["gpuspec"] > 0
    multi = build(base, Recipe("m", multigpu=0.35))  # default's tasks first, then multi-GPU ones
    assert multi[: len(base)] == base and all(int(r["num_gpu"]) > 1 for r in multi[len(base):])
    # every drawn task is a copy of one of default's (all columns but the name)
    shapes = {tuple(v for k, v in r.items() if k != "name") for r in base}
    for rows in (cpu, share, multi):
        assert {tuple(v for k, v in r.items() if k != "name") for r in rows} <= shapes


def test_pinned_specs_come_from_the_task_shape_s_distribution() -> None:
    base = _default()
    for row in build(base, Recipe("p", seed=9, gpuspec=0.5), specs=SPECS):
        if row["gpu_spec"]:
            shape = kind(row)
            table = SPECS.get(shape) or SPECS["gpu8"]
            assert row["gpu_spec"] in {s for s, _ in table}


def test_an_n_gpu_shape_never_pinned_borrows_the_next_larger() -> None:
    rows = [{"name": "a", "cpu_milli": "1000", "memory_mib": "1", "num_gpu": "3", "gpu_milli": "1000",
             "gpu_spec": ""}]
    assert build(rows, Recipe("p", gpuspec=0.9), specs=SPECS)[0]["gpu_spec"] == "G2"


def test_the_identity_recipe_keeps_default() -> None:
    base = _default()
    rows = build(base, Recipe("default"))
    assert rows == base and measure(rows) == measure(base)
    assert render_csv(COLUMNS, rows) == render_csv(COLUMNS, base)


def test_asking_for_default_s_own_cpu_ratio_keeps_its_cpu_only_tasks() -> None:
    base = _default()
    cpu_only = sum(int(r["cpu_milli"]) for r in base if r["num_gpu"] == "0")
    gpu_cpu = sum(int(r["cpu_milli"]) for r in base if r["num_gpu"] != "0")
    assert build(base, Recipe("same", cpu_ratio=cpu_only / gpu_cpu)) == base


def test_rows_are_valid_for_the_trace_reader(tmp_path: Path) -> None:
    base = _default()
    for recipe in RECIPES:
        rows = build(base, recipe, specs=SPECS)
        text = render_csv(COLUMNS, rows)
        assert parse_csv(text) == (COLUMNS, rows)
        path = tmp_path / f"{recipe.name}.csv"
        path.write_text(text, encoding="utf-8")
        pods = load_openb_pods(path)
        assert len(pods) == len(rows)
        assert sum(p.total_gpu_milli for p in pods) == measure(rows)["gpu_request_milli"]


def test_bad_targets_are_refused() -> None:
    base = _default()
    with pytest.raises(ValueError, match="gpushare"):
        build(base, Recipe("x", gpushare=1.5))
    with pytest.raises(ValueError, match="cpu_ratio"):
        build(base, Recipe("x", cpu_ratio=-1))
    with pytest.raises(ValueError, match="spec distribution"):
        build(base, Recipe("x", gpuspec=0.2))


def test_cpu_ratio_interpolates_the_family_s_points() -> None:
    anchors = {50.0: 0.1, 100.0: 0.2, 200.0: 0.5}
    assert cpu_ratio_for(100, anchors) == 0.2
    assert cpu_ratio_for(150, anchors) == 0.35
    assert cpu_ratio_for(300, anchors) == 0.8  # the 100-200 slope, extended
    assert cpu_ratio_for(75, anchors) == 0.15


def test_spec_distribution_counts_by_shape() -> None:
    rows = [
        {"num_gpu": "1", "gpu_milli": "500", "gpu_spec": "T4"},
        {"num_gpu": "1", "gpu_milli": "500", "gpu_spec": "T4"},
        {"num_gpu": "1", "gpu_milli": "1000", "gpu_spec": "G2"},
        {"num_gpu": "8", "gpu_milli": "1000", "gpu_spec": "G3"},
        {"num_gpu": "1", "gpu_milli": "1000", "gpu_spec": ""},
    ]
    assert spec_distribution([rows]) == {"gpu1": [("G2", 1)], "gpu8": [("G3", 1)], "share": [("T4", 2)]}


def _synthetic_traces(root: Path) -> Path:
    folder = root / "openb"
    folder.mkdir(parents=True)
    base = _default()
    (folder / "openb_pod_list_default.csv").write_text(render_csv(COLUMNS, base), encoding="utf-8")
    for nnn, ratio in ((50, 0.05), (100, 0.1), (200, 0.25)):
        rows = build(base, Recipe(f"cpu{nnn}", cpu_ratio=ratio))
        (folder / f"openb_pod_list_cpu{nnn:03d}.csv").write_text(render_csv(COLUMNS, rows), encoding="utf-8")
    for nn in (10, 20, 25):
        rows = build(base, Recipe(f"gpuspec{nn}", gpuspec=nn / 100), specs=SPECS)
        (folder / f"openb_pod_list_gpuspec{nn}.csv").write_text(render_csv(COLUMNS, rows), encoding="utf-8")
    return root


def test_the_command_writes_the_lists_and_a_manifest_that_checks_them(tmp_path: Path) -> None:
    traces = _synthetic_traces(tmp_path / "traces")
    out, manifest = tmp_path / "lists", tmp_path / "lists.json"
    code = main(["bench", "openb-lists", "--out", str(out), "--traces", str(traces),
                 "--manifest", str(manifest)])
    assert code == 0
    data = json.loads(manifest.read_text(encoding="utf-8"))
    assert data["cpu_ratio_anchors"]["cpu200"] == pytest.approx(0.25, abs=0.01)
    assert len(data["lists"]) == 7
    for item in data["lists"]:
        text = (out / item["file"]).read_text(encoding="utf-8")
        assert sha256_text(text) == item["sha256"]
        assert parse_csv(text)[0] == COLUMNS
        assert len(parse_csv(text)[1]) == item["rows"]
    assert build_lists(traces, tmp_path / "again", only={"gpushare90"})["lists"][0]["sha256"] == next(
        i["sha256"] for i in data["lists"] if i["recipe"]["name"] == "gpushare90"
    )
    # Rebuilding one list keeps the others' entries in the manifest.
    assert main(["bench", "openb-lists", "--out", str(out), "--traces", str(traces),
                 "--manifest", str(manifest), "--only", "gpushare90"]) == 0
    again = json.loads(manifest.read_text(encoding="utf-8"))
    assert sorted(i["file"] for i in again["lists"]) == sorted(i["file"] for i in data["lists"])
    assert {i["file"]: i["sha256"] for i in again["lists"]} == {i["file"]: i["sha256"] for i in data["lists"]}


def test_an_unknown_list_name_is_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    traces = _synthetic_traces(tmp_path / "traces")
    code = main(["bench", "openb-lists", "--out", str(tmp_path / "o"), "--traces", str(traces),
                 "--manifest", str(tmp_path / "m.json"), "--only", "cpu999"])
    assert code == 2
    assert "no built list named cpu999" in capsys.readouterr().err


_TRACES = default_trace_dir()
_MANIFEST = Path(__file__).resolve().parents[2] / "results" / "openb" / "built" / "lists.json"


@pytest.mark.skipif(not (_TRACES / "openb" / "openb_pod_list_gpuspec25.csv").is_file(),
                    reason="the openb traces are not here (set GPUSCHED_TRACES)")
def test_the_committed_manifest_matches_a_rebuild_from_the_traces(tmp_path: Path) -> None:
    data = json.loads(_MANIFEST.read_text(encoding="utf-8"))
    rebuilt = build_lists(_TRACES, tmp_path)
    assert rebuilt["sources_sha256"] == data["sources_sha256"]
    assert [(i["file"], i["sha256"], i["rows"]) for i in rebuilt["lists"]] == [
        (i["file"], i["sha256"], i["rows"]) for i in data["lists"]
    ]
    text = (_TRACES / "openb" / "openb_pod_list_default.csv").read_text(encoding="utf-8")
    columns, default = parse_csv(text)
    assert render_csv(columns, build(default, Recipe("default"))) == text


def test_the_tables_read_the_results_beside_the_manifest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    traces = _synthetic_traces(tmp_path / "traces")
    folder = tmp_path / "built"
    folder.mkdir()
    (folder / "lists.json").write_text(json.dumps(build_lists(traces, tmp_path / "o")), encoding="utf-8")
    for policy, values in (("gpusched", [4.0, 4.1, 4.2]), ("fgd", [5.0, 5.1, 5.2])):
        (folder / f"openb_pod_list_cpu150__{policy}.json").write_text(json.dumps({
            "seeds": [0, 1, 2], "unallocated_gpu_pct": values, "unallocated_gpu_pct_median": values[1],
            "unallocated_gpu_pct_bound": [3.0, 3.1, 3.2],
        }), encoding="utf-8")
    assert main(["bench", "openb-lists", "--tables", str(folder)]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| cpu150 | 5.10"))
    # fgd, gpusched, best-fit, Δ, bound, distance ratio (4.1 - 3.1) / (5.1 - 3.1), p, seeds lower
    assert row.split(" | ")[1:8] == ["5.10", "4.10", "—", "-1.00", "3.10", "0.50", "0.05"]
    assert "3/3" in row
