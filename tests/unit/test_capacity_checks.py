"""The great-expectations suite for demand history (real GX, ephemeral context)."""

from __future__ import annotations

import pytest

from gpusched.capacity.demand_checks import suite_path, validate_demand, validate_series
from gpusched.capacity.forecast import DemandSeries, synthetic_demand
from gpusched.errors import ForecastError


@pytest.fixture(scope="module")
def good() -> DemandSeries:
    return synthetic_demand(24 * 4, capacity=100.0)


def test_suite_ships_with_the_expectations() -> None:
    text = suite_path().read_text(encoding="utf-8")
    for name in ("expect_column_values_to_not_be_null", "expect_column_values_to_be_increasing",
                 "expect_column_values_to_be_between", "expect_column_values_to_be_in_set"):
        assert name in text


def test_valid_history_passes(good: DemandSeries) -> None:
    checks = validate_series(good)
    assert len(checks) == 7 and all(c.success for c in checks)


def test_failures_are_named(good: DemandSeries) -> None:
    frame = good.to_frame()
    frame.loc[3, "gpus"] = 500.0  # above capacity
    frame.loc[5, "gpus"] = None  # a null value
    frame = frame.drop(index=[10]).reset_index(drop=True)  # an hour missing
    frame.loc[20, "timestamp"] = frame.loc[19, "timestamp"]  # a repeated timestamp
    with pytest.raises(ForecastError) as info:
        validate_demand(frame, capacity=100.0)
    message = str(info.value)
    assert "expect_column_values_to_be_between(gpus): unexpected 500.0" in message
    assert "expect_column_values_to_not_be_null(gpus)" in message
    assert "expect_column_values_to_be_in_set(step_s)" in message
    assert "expect_column_values_to_be_increasing(timestamp)" in message
    assert "expect_column_values_to_not_be_null(timestamp)" not in message


def test_too_short_and_missing_columns(good: DemandSeries) -> None:
    with pytest.raises(ForecastError, match="row_count"):
        validate_demand(good.to_frame().head(10), capacity=100.0)
    with pytest.raises(ForecastError, match="lacks column"):
        validate_demand(good.to_frame().rename(columns={"gpus": "value"}), capacity=100.0)
    with pytest.raises(ForecastError, match="capacity"):
        validate_series(DemandSeries(good.start, 3600, good.values, None))


def test_validation_is_quiet(good: DemandSeries, capfd: pytest.CaptureFixture[str],
                             caplog: pytest.LogCaptureFixture) -> None:
    # GX draws a progress bar on stderr (an Airflow task log shows it as errors) and logs ~200
    # INFO lines about itself; the forecast's log should hold only what the DAG reports.
    with caplog.at_level("INFO"):
        validate_series(good)
    assert capfd.readouterr().err == ""
    assert len([r for r in caplog.records if r.name.startswith("great_expectations")]) <= 2
