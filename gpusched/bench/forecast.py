"""Forecast benchmark: demand-forecast backtest on Philly and the pre-scaling simulation.

    gpusched bench forecast [--trace ../shared/traces/philly/philly_jobs.csv] [--origins 14]
                            [--plot results/forecast/philly_forecast.png] [--no-prescale]
                            [--delay-s 900] [--measure-days 7] [--json] [--out FILE]

1. Hourly GPUs-busy series from the Philly trace; rolling-origin backtest (24-hour horizon) of
   seasonal-naive, ETS and SARIMAX; MASE of each and of the chosen model relative to
   seasonal-naive; a PNG of the last week, the chosen model's forecast and its 90 % interval.
2. :func:`gpusched.sim.prescale.compare` — predictive pre-scaling vs reactive scale-out with a
   ``--delay-s`` provisioning delay: burst jobs' p95 wait and the standby node-hours paid.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from gpusched.capacity.forecast import backtest, fit_forecast, load_philly_demand, plot_forecast
from gpusched.sim.prescale import PrescaleConfig, compare

__all__ = ["measure", "run"]


def run(trace: Path, *, origins: int = 14, horizon: int = 24, plot: Path | None = None,
        progress: bool = True) -> dict[str, Any]:
    """Backtest on the trace's hourly demand, refit the chosen model, plot; returns the figures."""

    series = load_philly_demand(trace)
    result = backtest(series, horizon=horizon, origins=origins, spacing=96, progress=progress)
    forecast = fit_forecast(series, result.chosen, horizon)
    out: dict[str, Any] = {
        "trace": trace.name, "hours": len(series), "backtest": result.to_dict(),
        "chosen": result.chosen, "mase_chosen": result.score(result.chosen).mase,
        "mase_seasonal_naive": result.score("seasonal_naive").mase,
        "relative_mase_chosen": result.relative_mase(result.chosen),
    }
    if plot is not None:
        out["plot"] = str(plot_forecast(series, forecast, plot, title="Philly hourly GPU demand: forecast"))
        # One backtest origin drawn against what happened (the middle origin of the backtest).
        cut = len(series) - horizon - 96 * (result.origins // 2)
        past = series.window(0, cut)
        example = fit_forecast(past, result.chosen, horizon)
        picture = plot.with_name(plot.stem + "_backtest" + plot.suffix)
        out["plot_backtest"] = str(plot_forecast(
            past, example, picture, title=f"Philly: {result.chosen} forecast at one backtest origin",
            actual=series.window(cut, cut + horizon)))
    return out


def measure(trace: Path, *, origins: int = 14, horizon: int = 24, plot: Path | None = None,
            prescale: bool = True, delay_s: int = 900, measure_days: int = 7, model: str = "ets",
            progress: bool = True) -> dict[str, Any]:
    """:func:`run`, then (unless ``prescale`` is false) predictive vs reactive pre-scaling."""
    result = run(trace, origins=origins, horizon=horizon, plot=plot, progress=progress)
    if prescale:
        if progress:
            print("pre-scaling simulation (reactive, then predictive)…", file=sys.stderr)
        result["prescale"] = compare(PrescaleConfig(provisioning_delay_s=delay_s,
                                                    measure_days=measure_days, model=model))
    return result
