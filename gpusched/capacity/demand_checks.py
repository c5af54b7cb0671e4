"""Validate a demand history with the great-expectations suite before it is forecast.

The suite lives in ``gpusched/include/expectations/demand_history.json``: non-null timestamps and
values, strictly increasing timestamps, no gaps at the step, values between 0 and the fleet
capacity, enough rows. It is run in an ephemeral GX context (nothing written to disk);
great_expectations and pandas are imported inside :func:`validate_demand`.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpusched.capacity.forecast import DemandSeries
from gpusched.errors import ForecastError
from gpusched.paths import include_dir

__all__ = ["DemandCheck", "suite_path", "validate_demand", "validate_series"]


@dataclass(frozen=True, slots=True)
class DemandCheck:
    """Outcome of one expectation: its type, column, success and a few unexpected values."""

    expectation: str
    column: str | None
    success: bool
    unexpected: tuple[str, ...] = ()

    def describe(self) -> str:
        """One line such as ``expect_column_values_to_be_between(gpus): unexpected 300``."""
        where = f"({self.column})" if self.column else ""
        extra = f": unexpected {', '.join(self.unexpected)}" if self.unexpected else ""
        return f"{self.expectation}{where}{extra}"


def suite_path() -> Path:
    """The expectation suite file (``gpusched/include/expectations/demand_history.json``)."""
    return include_dir() / "expectations" / "demand_history.json"


def _frame_with_steps(frame: Any, step_s: int) -> Any:
    import pandas as pd

    out = pd.DataFrame({"timestamp": frame["timestamp"], "gpus": frame["gpus"]}).reset_index(drop=True)
    stamps = pd.to_datetime(out["timestamp"], utc=True)
    steps = stamps.diff().dt.total_seconds()
    out["step_s"] = steps.fillna(float(step_s))
    return out


def validate_demand(
    frame: Any, *, capacity: float, step_s: int = 3600, min_rows: int = 72,
    suite_file: Path | None = None,
) -> tuple[DemandCheck, ...]:
    """Run the suite on a DataFrame with columns ``timestamp`` and ``gpus``.

    Returns every expectation's outcome when all pass.

    Raises:
        ForecastError: naming each failed expectation (and a few offending values), or when the
            suite file cannot be read.
    """
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    # GX logs its import and context set-up at INFO (~200 lines) and draws a progress bar on
    # stderr (an Airflow task log shows it as errors): the outcome below is what the caller reports.
    gx_log = logging.getLogger("great_expectations")
    level = gx_log.level
    gx_log.setLevel(max(level, logging.WARNING))
    try:
        return _validate(frame, capacity=capacity, step_s=step_s, min_rows=min_rows, suite_file=suite_file)
    finally:
        gx_log.setLevel(level)


def _validate(
    frame: Any, *, capacity: float, step_s: int, min_rows: int, suite_file: Path | None,
) -> tuple[DemandCheck, ...]:
    import great_expectations as gx
    from great_expectations.core.expectation_suite import ExpectationSuite
    from great_expectations.expectations.expectation_configuration import ExpectationConfiguration

    path = suite_file or suite_path()
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
        configs = [ExpectationConfiguration(type=e["type"], kwargs=e["kwargs"]) for e in spec["expectations"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ForecastError(
            f"cannot read expectation suite {path}: {exc}; restore it from the repository"
        ) from exc
    missing = {"timestamp", "gpus"} - set(getattr(frame, "columns", ()))
    if missing:
        raise ForecastError(
            f"demand frame lacks column(s) {sorted(missing)}; build it with DemandSeries.to_frame()"
        )
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    suite = context.suites.add(ExpectationSuite(name=str(spec.get("name", "demand_history")),
                                                expectations=configs))
    source = context.data_sources.add_pandas("gpusched_demand")
    batch = source.add_dataframe_asset("demand_history").add_batch_definition_whole_dataframe(
        "whole"
    ).get_batch(batch_parameters={"dataframe": _frame_with_steps(frame, step_s)})
    result = batch.validate(suite, expectation_parameters={
        "capacity": float(capacity), "step_set": [float(step_s)], "min_rows": int(min_rows),
    })
    checks = []
    for item in result.results:
        config = item.expectation_config
        kwargs = dict(config.kwargs) if config is not None else {}
        values = (item.result or {}).get("partial_unexpected_list") or []
        checks.append(DemandCheck(
            expectation=str(config.type) if config is not None else "?",
            column=kwargs.get("column"),
            success=bool(item.success),
            unexpected=tuple(str(v) for v in values[:3]),
        ))
    failed = [c for c in checks if not c.success]
    if failed:
        raise ForecastError(
            "demand history failed validation: " + "; ".join(c.describe() for c in failed)
            + " — fix the source (ledger demand_history or trace) or the capacity before forecasting"
        )
    return tuple(checks)


def validate_series(
    series: DemandSeries, *, capacity: float | None = None, min_rows: int = 72
) -> tuple[DemandCheck, ...]:
    """:func:`validate_demand` on a :class:`~gpusched.capacity.forecast.DemandSeries`.

    ``capacity`` defaults to the series' own; one of them is required.
    """
    cap = capacity if capacity is not None else series.capacity
    if cap is None:
        raise ForecastError("validating demand needs the fleet capacity in GPUs; pass capacity=")
    return validate_demand(series.to_frame(), capacity=cap, step_s=series.step_s, min_rows=min_rows)
