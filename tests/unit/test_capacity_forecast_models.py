"""Demand series, backtest-based model choice, intervals, plots."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpusched.capacity.forecast import (
    DemandSeries,
    Forecast,
    backtest,
    demand_from_history,
    demand_from_jobs,
    fit_forecast,
    forecast_demand,
    load_philly_demand,
    plot_forecast,
    synthetic_demand,
)
from gpusched.errors import ForecastError


def test_demand_from_jobs_integrates_overlap() -> None:
    # 2 GPUs for the whole first hour, 4 GPUs for the last half of it and the first half of the next.
    series = demand_from_jobs([(0.0, 3600.0, 2), (1800.0, 3600.0, 4)], step_s=3600)
    assert series.start == 0.0
    assert series.values == pytest.approx((2 + 2, 2))
    later = demand_from_jobs([(100.0, 10.0, 1)], start=0.0, end=7200.0)
    assert later.values == pytest.approx((10 / 3600, 0.0))


def test_demand_from_history_converts_milli() -> None:
    series = demand_from_history([(7200.0, 1500), (3600.0, 500)], capacity=8)
    assert series.start == 3600.0 and series.values == (0.5, 1.5) and series.capacity == 8
    with pytest.raises(ForecastError, match="no demand history"):
        demand_from_history([])


def test_load_philly_demand_ends_at_last_submission(tmp_path: Path) -> None:
    trace = tmp_path / "philly.csv"
    trace.write_text(
        "timestamp,duration,num_gpus,gpu_time,cluster\n"
        "2017-10-01 00:00:00,7200,2,14400,a\n"
        "2017-10-01 03:30:00,36000,8,288000,b\n",
        encoding="utf-8",
    )
    series = load_philly_demand(trace)
    assert series.values == pytest.approx((2.0, 2.0, 0.0))  # drain after 03:00 is cut off
    with pytest.raises(ForecastError, match="--trace"):
        load_philly_demand(tmp_path / "missing.csv")


def test_backtest_prefers_a_model_that_beats_seasonal_naive() -> None:
    series = synthetic_demand(24 * 14, seed=1)
    result = backtest(series, ("seasonal_naive", "ets"), origins=3, spacing=24)
    assert result.origins == 3
    assert result.chosen == "ets"
    assert result.score("ets").mase < result.score("seasonal_naive").mase
    assert result.relative_mase("ets") < 1.0
    assert result.to_dict()["chosen"] == "ets"


@pytest.mark.parametrize("model", ["seasonal_naive", "ets", "sarimax"])
def test_forecast_has_ordered_interval_within_capacity(model: str) -> None:
    series = synthetic_demand(24 * 8, seed=2, capacity=60.0)
    fc = fit_forecast(series, model, 24, level=0.8)
    assert len(fc.mean) == len(fc.lower) == len(fc.upper) == 24
    assert fc.start == series.start + len(series) * 3600
    for lo, mid, hi in zip(fc.lower, fc.mean, fc.upper, strict=True):
        assert 0.0 <= lo <= mid + 1e-9 and mid <= hi + 1e-9 and hi <= 60.0
    assert Forecast.from_dict(fc.to_dict()) == fc


def test_forecast_errors_name_the_fix() -> None:
    short = DemandSeries(0.0, 3600, (1.0,) * 30, 10)
    with pytest.raises(ForecastError, match="at least 72"):
        fit_forecast(short, "ets")
    with pytest.raises(ForecastError, match="choose one of"):
        fit_forecast(synthetic_demand(24 * 4), "prophet")
    with pytest.raises(ForecastError, match="too short"):
        backtest(short)


def test_forecast_demand_and_plot(tmp_path: Path) -> None:
    series = synthetic_demand(24 * 10, seed=3)
    fc, result = forecast_demand(series, 12, models=("seasonal_naive", "ets"), origins=2)
    assert fc.model == result.chosen and len(fc.mean) == 12
    png = plot_forecast(series, fc, tmp_path / "out" / "fc.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_history_shortfall_says_why_a_new_fleet_cannot_be_forecast() -> None:
    from gpusched.capacity.forecast import DemandSeries, history_shortfall, since_first_demand

    idle = DemandSeries(0.0, 3600, (0.0,) * (28 * 24), 40.0)
    assert "no GPU demand recorded" in (history_shortfall(idle) or "")
    young = DemandSeries(0.0, 3600, (0.0,) * 600 + (1.0,) * 50, 40.0)
    assert "50 h of demand history, the forecast needs 96 h" in (history_shortfall(young) or "")
    assert len(since_first_demand(young)) == 50
    grown = DemandSeries(0.0, 3600, (0.0,) * 10 + (1.0, 2.0) * 60, 40.0)
    assert history_shortfall(grown) is None


def test_backtest_of_a_flat_series_is_json_compliant() -> None:
    import json

    from gpusched.capacity.forecast import DemandSeries, backtest

    flat = DemandSeries(0.0, 3600, (0.0,) * (5 * 24), 40.0)
    data = backtest(flat, ("seasonal_naive",), origins=1).to_dict()
    json.dumps(data, allow_nan=False)  # raises on inf/NaN, as Airflow's XCom push does
    assert data["scores"][0]["relative_mase"] is None
