"""``gpusched check`` and ``assert_gpu_tasks_fit``: real Airflow parsing of DAG files, the scheduler's
own decision against a fleet file or the live ledger, one-line errors for bad input."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpusched.airflow.fit_check import Verdict, assert_gpu_tasks_fit, load_dags
from gpusched.cli import main
from gpusched.hardware.simulated import SimulatedBackend, default_fleet_path
from gpusched.ledger import Ledger
from gpusched.model import MILLI, DeviceShare
from gpusched.request import GPURequest

ROOT = Path(__file__).resolve().parents[2]
SMALL_FLEET = default_fleet_path().with_name("small.yaml")

DAG_TEMPLATE = '''
from datetime import datetime

from airflow.sdk import dag, task

from gpusched.airflow.authoring import gpu


@dag(dag_id="{dag_id}", schedule=None, start_date=datetime(2026, 1, 1))
def checked():
{tasks}


checked()
'''


@pytest.fixture(autouse=True)
def _default_fleet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUSCHED_FLEET", raising=False)  # the bundled default fleet unless a test names one


def _dag_file(folder: Path, dag_id: str, **requests: str) -> Path:
    """A DAG file with one task per keyword: ``name="gpus=1"`` -> ``@task(**gpu(gpus=1))``."""
    body = "".join(f"    @task(**gpu({args}))\n    def {name}() -> None: ...\n\n    {name}()\n\n"
                   for name, args in requests.items())
    path = folder / f"{dag_id}.py"
    path.write_text(DAG_TEMPLATE.format(dag_id=dag_id, tasks=body.rstrip() or "    pass"), encoding="utf-8")
    return path


def _check(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[dict[str, Any]]]:
    code = main(["check", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def _by_task(reports: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {f"{r['dag_id']}.{r['task']}": r for r in reports}


def _one_line_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(["check", *argv]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and captured.out == "", captured
    assert lines[0].startswith("gpusched check: error: ")
    return lines[0]


def test_the_bundled_dags_fit_the_default_fleet_and_the_gang_needs_the_standby_node() -> None:
    done = subprocess.run([sys.executable, "-m", "gpusched.cli", "check", "dags", "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    reports = _by_task(json.loads(done.stdout))
    gang = reports["example_multi_node_gang.pretrain"]
    assert gang["gang"] is True and gang["task_ids"] == ["pretrain__node0", "pretrain__node1"]
    assert gang["verdict"] == "fits only with standby nodes" and gang["fits"] is True
    assert "multi-node gang pretrain" in gang["reason"]  # the scheduler's words on the active fleet
    assert [(w["task_id"], w["node"], w["devices"]) for w in gang["where"]] == [
        ("pretrain__node0", "a-h100-1", list(range(8))), ("pretrain__node1", "a-h100-2", list(range(8)))]
    others = [r for key, r in reports.items() if key != "example_multi_node_gang.pretrain"]
    assert others and {r["verdict"] for r in others} == {"fits when idle"}
    assert "example_multi_gpu_nvlink_training.train_resnet50" in reports
    assert not any(r["dag_id"] == "gpusched_fault_recovery" for r in reports.values())  # no GPU task


def test_an_impossible_request_never_fits_with_the_placement_reason_and_exit_code_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _dag_file(tmp_path, "too_big", huge='gpus=64', fine='gpus=1',
              half_hard='gpus=0.5, memory="20GiB", isolation="hard"',
              slice_ok='gpus=0.25, memory="8GiB", isolation="hard"')
    code, reports = _check(capsys, str(tmp_path))
    assert code == 1
    by_task = _by_task(reports)
    huge = by_task["too_big.huge"]
    assert huge["verdict"] == "never fits" and huge["fits"] is False and huge["where"] == []
    assert huge["reason"] == "needs 64 same-node GPUs; the largest matching node in the fleet has 8"
    half = by_task["too_big.half_hard"]  # no slice holds it; the MIG A100 can be re-laid out
    assert half["verdict"] == "fits after a re-partition" and half["fits"] is True
    assert half["reason"].startswith("waiting for a MIG re-partition of GPU-sim-a-a100mig-1-0")
    (spot,) = by_task["too_big.slice_ok"]["where"]
    assert spot["node"] == "a-a100mig-1" and spot["shares"][0]["profile"]  # a MIG instance
    assert by_task["too_big.fine"]["verdict"] == "fits when idle"

    assert main(["check", str(tmp_path)]) == 1
    text = capsys.readouterr().out
    assert "huge: 64 same-node GPUs: never fits" in text
    assert "why: needs 64 same-node GPUs; the largest matching node in the fleet has 8" in text
    assert ": fits after a re-partition\n    how: waiting for a MIG re-partition" in text
    summary = "4 GPU task(s): 2 fits when idle, 1 fits after a re-partition, 1 never fits"
    assert text.rstrip().endswith(summary)


def test_json_output_has_one_entry_per_gpu_task_with_its_request_and_placement(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _dag_file(tmp_path, "shapes", pair='gpus=2, interconnect="island"', share='gpus=0.5, memory="8GiB"')
    code, reports = _check(capsys, str(tmp_path / "shapes.py"), "--fleet", str(SMALL_FLEET))
    assert code == 0
    assert [r["task"] for r in reports] == ["pair", "share"]
    keys = {"dag_id", "task", "task_ids", "file", "gang", "request", "describe", "verdict", "fits", "reason",
            "where"}
    for report in reports:
        assert set(report) == keys
        assert GPURequest.from_dict(report["request"]).describe() == report["describe"]
        for spot in report["where"]:
            assert set(spot) == {"task_id", "node", "devices", "shares"}
            assert [s["index"] for s in spot["shares"]] == spot["devices"]
    pair, share = reports
    assert len(pair["where"][0]["devices"]) == 2 and pair["verdict"] == "fits when idle"
    assert share["where"][0]["shares"][0]["milli"] == 500


def test_the_live_ledger_says_what_fits_now(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with Ledger() as ledger:  # the default ledger of this AIRFLOW_HOME, where the CLI looks
        ledger.migrate()
        ledger.sync_inventory(SimulatedBackend(default_fleet_path()).discover(), source="simulated")
        h100 = ledger.snapshot().node("a-h100-1").devices
        shares = tuple(DeviceShare(d.uuid, d.node, d.index, MILLI, d.memory_bytes) for d in h100)
        ledger.allocate("airflow/other/train/-1/1/r1", GPURequest.build(gpus=8), shares, holder="other")
    _dag_file(tmp_path, "live", busy='gpus=4, models=["H100-SXM-80GB"], interconnect="island"',
              free="gpus=1")
    code, reports = _check(capsys, str(tmp_path), "--ledger")
    assert code == 0
    busy, free = reports
    assert busy["verdict"] == "fits when idle" and busy["reason"].startswith("needs 4 ")
    assert busy["where"][0]["node"] == "a-h100-1"  # where it goes once the fleet is idle
    assert free["verdict"] == "fits now" and free["reason"] == ""


def test_the_helper_passes_for_a_fitting_dag_and_fails_with_the_reason(tmp_path: Path) -> None:
    fitting = _dag_file(tmp_path, "fits", train='gpus=4, interconnect="island"')
    (report,) = assert_gpu_tasks_fit(fitting)
    assert report.verdict is Verdict.FITS_WHEN_IDLE and len(report.where[0].devices) == 4
    (dag,) = load_dags(fitting)
    assert assert_gpu_tasks_fit(dag)[0].fits
    with pytest.raises(AssertionError, match=r"fits\.train: never fits: .* the largest matching island in "
                                             r"the fleet has 2"):
        assert_gpu_tasks_fit(dag, fleet=SMALL_FLEET)

    (tmp_path / "other").mkdir()
    impossible = _dag_file(tmp_path / "other", "impossible_dag", huge="gpus=64")
    with pytest.raises(AssertionError, match=re.escape("impossible_dag.huge: never fits: needs 64 same-node "
                                                       "GPUs; the largest matching node in the fleet has 8")):
        assert_gpu_tasks_fit(impossible)
    gang_dag = ROOT / "dags" / "example_multi_node_gang.py"
    with pytest.raises(AssertionError, match=r"example_multi_node_gang\.pretrain: fits only with standby"):
        assert_gpu_tasks_fit(gang_dag, standby=False)


def test_bad_input_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "no DAG file or folder at" in _one_line_error(capsys, str(tmp_path / "missing"))
    _dag_file(tmp_path, "ok", one="gpus=1")
    bad_fleet = tmp_path / "fleet.yaml"
    bad_fleet.write_text("racks: []\n", encoding="utf-8")
    assert f"fleet file {bad_fleet}" in _one_line_error(capsys, str(tmp_path), "--fleet", str(bad_fleet))
    assert "no ledger at" in _one_line_error(capsys, str(tmp_path), "--ledger")
    (tmp_path / "empty.db").touch()
    assert "has no gpusched ledger schema" in _one_line_error(capsys, str(tmp_path), "--url",
                                                              f"sqlite:///{tmp_path / 'empty.db'}")
    assert "give one of them" in _one_line_error(capsys, str(tmp_path), "--fleet", str(SMALL_FLEET),
                                                 "--url", "sqlite://")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no DAG found in" in _one_line_error(capsys, str(empty))


def test_a_dag_file_that_fails_to_import_is_named_in_one_line(tmp_path: Path) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("from airflow.sdk import dag\nfrom gpusched.airflow.authoring import gpu\n"
                      "gpu(gpus=0.5)\n", encoding="utf-8")
    done = subprocess.run([sys.executable, "-m", "gpusched.cli", "check", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"gpusched check: error: DAG file {broken} fails to import: ")
    assert "must say how much device memory it needs" in done.stderr


def test_a_hand_written_invalid_request_never_fits_with_the_executors_words(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "hand.py").write_text(
        "from datetime import datetime\nfrom airflow.sdk import dag, task\n\n"
        "@dag(dag_id='hand', schedule=None, start_date=datetime(2026, 1, 1))\n"
        "def hand():\n"
        "    @task(executor_config={'gpusched': {'count': 'x'}})\n"
        "    def typo() -> None: ...\n"
        "    typo()\n\nhand()\n", encoding="utf-8")
    code, (report,) = _check(capsys, str(tmp_path))
    assert code == 1 and report["verdict"] == "never fits" and report["request"] is None
    assert report["reason"] == ("invalid GPU request in executor_config: GPURequest.count: 'x' is not valid; "
                                "accepted: a whole number ≥ 1 and ≤ 4096")
