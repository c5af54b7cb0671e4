"""``gpusched bench forecast``: argument parsing; the benchmark is :mod:`gpusched.bench.forecast`.

    gpusched bench forecast [--trace ../shared/traces/philly/philly_jobs.csv] [--origins 14]
                            [--plot results/forecast/philly_forecast.png] [--no-prescale]
                            [--delay-s 900] [--measure-days 7] [--json] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from gpusched.bench.forecast import measure
from gpusched.capacity.forecast import MODELS
from gpusched.commands.args import int_range

__all__ = ["register_bench"]


def _default_trace() -> Path:
    return Path("..") / "shared" / "traces" / "philly" / "philly_jobs.csv"


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", type=Path, default=_default_trace(), help="Philly philly_jobs.csv")

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


def _main(args: argparse.Namespace) -> int:
    result = measure(args.trace, origins=args.origins, horizon=args.horizon, plot=args.plot,
                     prescale=not args.no_prescale, delay_s=args.delay_s,
                     measure_days=args.measure_days, model=args.model, progress=not args.quiet)
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
