"""``gpusched bench genetic`` and ``gpusched bench forecast`` on tiny inputs (shape of the JSON)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from gpusched.cli import main


def test_bench_genetic_small(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "g.json"
    code = main(["bench", "genetic", "--nodes", "12", "--pending", "8", "--runs", "3", "--replay-nodes", "4",
                 "--replay-jobs", "15", "--quiet", "--json", "--out", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == data
    assert data["runs"] == 3 and data["optimiser_ms_p99"] >= data["optimiser_ms_p50"] > 0
    assert data["objective_gain_pct_mean"] >= 0  # never worse than greedy
    # Jobs too large for four nodes are rejected permanently by both.
    assert 0 < data["replay"]["greedy"]["jobs_started"] == data["replay"]["optimiser"]["jobs_started"] <= 15
    assert data["weights"] == [1.0, 1.0, 0.1]


def test_bench_forecast_on_a_small_trace(tmp_path: Path) -> None:
    trace = tmp_path / "philly.csv"
    start = datetime(2017, 10, 2, tzinfo=UTC)
    rows = ["timestamp,duration,num_gpus,gpu_time,cluster"]
    for hour in range(24 * 9):
        when = start + timedelta(hours=hour)
        gpus = 4 + (8 if 9 <= when.hour < 18 else 0)
        rows.append(f"{when:%Y-%m-%d %H:%M:%S},3600,{gpus},{3600 * gpus},c")
    trace.write_text("\n".join(rows) + "\n", encoding="utf-8")
    out = tmp_path / "f.json"
    code = main(["bench", "forecast", "--trace", str(trace), "--origins", "2", "--no-prescale", "--quiet",
                 "--plot", str(tmp_path / "fc.png"), "--out", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    assert data["backtest"]["origins"] == 2 and data["chosen"] in ("seasonal_naive", "ets", "sarimax")
    assert data["mase_chosen"] <= data["mase_seasonal_naive"]
    assert (tmp_path / "fc.png").exists() and (tmp_path / "fc_backtest.png").exists()


def test_bench_cycle_small(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, png = tmp_path / "c.json", tmp_path / "c.png"
    code = main(["bench", "cycle", "--nodes", "24", "--cycles", "4", "--pending", "3", "--quiet",
                 "--out", str(out), "--png", str(png)])
    assert code == 0
    data = json.loads(out.read_text())
    assert "| nodes (GPUs) |" in capsys.readouterr().out and png.stat().st_size > 0
    (row,) = data["sweep"]
    assert row["nodes"] == 24 and row["gpus"] == 192 and row["running"] == 24
    # The kept engine is built once and rebased every later cycle (usage moved, inventory not).
    assert (row["warm_engine_built"], row["warm_engine_rebased"]) == (1, 3)
    for way in ("fresh", "warm"):
        assert row[f"{way}_cycle_cpu_p99_ms"] >= row[f"{way}_cycle_cpu_p50_ms"] > 0
    assert row["warm_first_cycle_cpu_ms"] > 0  # kept apart from the warm percentiles
    assert row["warm_over_fresh_cycle_cpu_p50"] == pytest.approx(
        row["warm_cycle_cpu_p50_ms"] / row["fresh_cycle_cpu_p50_ms"], rel=1e-2)
