"""``gpusched bench forecast``: demand-forecast backtest on Philly and the pre-scaling simulation.

    gpusched bench forecast [--trace ../shared/traces/philly/philly_jobs.csv] [--origins 14]
                            [--plot results/forecast/philly_forecast.png] [--no-prescale]
                            [--delay-s 900] [--measure-days 7] [--json] [--out FILE]

(also ``python -m gpusched.commands.bench_forecast …``).

1. Hourly GPUs-busy series from the Philly trace; rolling-origin backtest (24-hour horizon) of
   seasonal-naive, ETS and SARIMAX; MASE of each and of the chosen model relative to
   seasonal-naive; a PNG of the last week, the chosen model's forecast and its 90 % interval.
2. :func:`gpusched.sim.prescale.compare` — predictive pre-scaling vs reactive scale-out with a
   ``--delay-s`` provisioning delay: burst jobs' p95 wait and the standby node-hours paid.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["register_bench", "run"]


def _default_trace() -> Path:
    return Path("..") / "shared" / "traces" / "philly" / "philly_jobs.csv"


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", type=Path, default=_default_trace(), help="Philly philly_jobs.csv")
    from gpusched.capacity.forecast import MODELS
    from gpusched.commands.args import int_range

    parser.add_argument("--origins", type=int_range(1, 1000), default=14,
                        help="backtest origins, 4 days apart (default 14)")
    parser.add_argument("--horizon", type=int_range(1, 24 * 366), default=24,
                        help="forecast horizon in hours (default 24)")
    parser.add_argument("--plot", type=Path, default=Path("results/forecast/philly_forecast.png"),
                        help="where to write the plot (default results/forecast/philly_forecast.png)")
    parser.add_argument("--no-prescale", action="store_true", help="skip the pre-scaling simulation")
    parser.add_argument("--delay-s", type=int_range(0, 86_400), default=900,
                        help="provisioning delay for the simulation, s (default 900)")
    parser.add_argument("--measure-days", type=int_range(1, 366), default=7,
                        help="days of the pre-scaling simulation that are measured (default 7)")
    parser.add_argument("--model", choices=MODELS, default="ets",
                        help=f"forecasting model inside the simulation: {', '.join(MODELS)} (default ets)")
    parser.add_argument("--json", action="store_true", help="print the full result as JSON")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.set_defaults(func=_main)


def register_bench(bench_subparsers: Any) -> None:
    """Add ``forecast`` under ``gpusched bench``."""
    _add_arguments(bench_subparsers.add_parser("forecast", help="demand forecast backtest + pre-scaling"))


def run(trace: Path, *, origins: int = 14, horizon: int = 24, plot: Path | None = None,
        progress: bool = True) -> dict[str, Any]:
    """Backtest on the trace's hourly demand, refit the chosen model, plot; returns the figures."""
    from gpusched.capacity.forecast import backtest, fit_forecast, load_philly_demand, plot_forecast

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


def _main(args: argparse.Namespace) -> int:
    progress = not args.quiet
    result = run(args.trace, origins=args.origins, horizon=args.horizon, plot=args.plot, progress=progress)
    if not args.no_prescale:
        from gpusched.sim.prescale import PrescaleConfig, compare

        if progress:
            print("pre-scaling simulation (reactive, then predictive)…", file=sys.stderr)
        result["prescale"] = compare(PrescaleConfig(provisioning_delay_s=args.delay_s,
                                                    measure_days=args.measure_days, model=args.model))
    text = json.dumps(result, indent=2)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n", encoding="utf-8")
    headline = (f"chosen {result['chosen']}: MASE {result['mase_chosen']:.3f} vs seasonal-naive "
                f"{result['mase_seasonal_naive']:.3f} (ratio {result['relative_mase_chosen']:.3f})")
    if "prescale" in result:
        pre = result["prescale"]
        headline += (f"; burst p95 wait predictive {pre['predictive']['burst_wait_p95_s']:.0f} s vs "
                     f"reactive {pre['reactive']['burst_wait_p95_s']:.0f} s")
    print(text if args.json else headline)
    return 0
