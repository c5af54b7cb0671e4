"""Demand forecasting: hourly GPU demand, model choice by rolling-origin backtest, intervals.

Policy module: pure functions over immutable series. numpy, pandas and statsmodels are imported
inside the functions that need them; :func:`plot_forecast` (matplotlib) and ``backtest``'s progress
bar (tqdm) need the ``lab`` extra (:mod:`gpusched.extras`).

The candidate models are

* ``seasonal_naive`` — the value one day earlier (the baseline every score is scaled by);
* ``ets`` — additive Holt-Winters with a damped trend and daily seasonality (statsmodels ETSModel);
* ``sarimax`` — SARIMAX(1,1,1)(1,0,0)\\ :sub:`24` with weekly Fourier terms as regressors, so
  both daily and weekly seasonality fit in seconds on two cores.

:func:`backtest` scores each on rolling origins with MASE (mean absolute error scaled by the
in-sample MAE of the daily seasonal-naive forecast); :func:`forecast_demand` refits the best one
on the whole window and returns a :class:`Forecast` with prediction intervals.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gpusched.capacity.demand import (
    DemandSeries,
    demand_from_history,
    demand_from_jobs,
    load_philly_demand,
    synthetic_demand,
)
from gpusched.errors import ForecastError
from gpusched.extras import lab_module, pyplot

__all__ = [
    "MODELS",
    "Backtest",
    "DemandSeries",
    "Forecast",
    "ModelScore",
    "backtest",
    "demand_from_history",
    "demand_from_jobs",
    "fit_forecast",
    "forecast_demand",
    "history_shortfall",
    "load_philly_demand",
    "plot_forecast",
    "since_first_demand",
    "synthetic_demand",
]

MODELS: tuple[str, ...] = ("seasonal_naive", "ets", "sarimax")
"""Candidate model names, baseline first."""

DAY = 24
WEEK_S = 7 * 86400


@dataclass(frozen=True, slots=True)
class Forecast:
    """Predicted demand for the steps after a series, with a central prediction interval."""

    model: str
    start: float
    step_s: int
    mean: tuple[float, ...]
    lower: tuple[float, ...]
    upper: tuple[float, ...]
    level: float

    def timestamps(self) -> tuple[float, ...]:
        """Epoch seconds of each forecast step's start."""
        return tuple(self.start + i * self.step_s for i in range(len(self.mean)))

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form (what the UI's ``/forecast`` endpoint serves)."""
        return {
            "model": self.model, "start": self.start, "step_s": self.step_s, "level": self.level,
            "mean": list(self.mean), "lower": list(self.lower), "upper": list(self.upper),
            "timestamps": [datetime.fromtimestamp(t, UTC).isoformat() for t in self.timestamps()],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Forecast:
        """Inverse of :meth:`to_dict`."""
        return cls(
            str(data["model"]), float(data["start"]), int(data["step_s"]),
            tuple(float(v) for v in data["mean"]), tuple(float(v) for v in data["lower"]),
            tuple(float(v) for v in data["upper"]), float(data["level"]),
        )


@dataclass(frozen=True, slots=True)
class ModelScore:
    """Backtest result of one model: mean MAE and MASE over the origins, fitting time."""

    model: str
    mae: float
    mase: float
    fit_seconds: float


@dataclass(frozen=True, slots=True)
class Backtest:
    """Rolling-origin backtest of every candidate; ``chosen`` has the lowest MASE."""

    horizon: int
    origins: int
    train_window: int
    scores: tuple[ModelScore, ...]
    chosen: str

    def score(self, model: str) -> ModelScore:
        """The score of ``model`` (KeyError when it was not a candidate)."""
        for item in self.scores:
            if item.model == model:
                return item
        raise KeyError(model)

    def relative_mase(self, model: str) -> float:
        """MASE of ``model`` divided by seasonal-naive's on the same origins (< 1 is better)."""
        base = self.score("seasonal_naive").mase
        return self.score(model).mase / base if base > 0 else math.inf

    def _relative_or_none(self, model: str) -> float | None:
        """:meth:`relative_mase` when it is a finite number (JSON has no infinity), else None."""
        if not any(x.model == "seasonal_naive" for x in self.scores):
            return None
        value = self.relative_mase(model)
        return value if math.isfinite(value) else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form."""
        return {
            "horizon": self.horizon, "origins": self.origins, "train_window": self.train_window,
            "chosen": self.chosen,
            "scores": [
                {"model": s.model, "mae": _finite(s.mae), "mase": _finite(s.mase),
                 "fit_seconds": s.fit_seconds, "relative_mase": self._relative_or_none(s.model)}
                for s in self.scores
            ],
        }


def _finite(value: float) -> float | None:
    """``value``, or None where it is NaN or infinite (JSON and Airflow's XCom refuse those)."""
    return value if math.isfinite(value) else None


def history_shortfall(series: DemandSeries, horizon: int = 24) -> str | None:
    """Why ``series`` cannot be backtested and forecast yet, in plain words; None when it can.

    Only the steps from the first non-zero demand on count: a new fleet's history before its
    first allocation is not history. Forecasting needs three days to fit on plus ``horizon``
    steps to score against.
    """
    need = 3 * DAY + horizon
    hours = series.step_s / 3600
    first = next((i for i, v in enumerate(series.values) if v > 0), None)
    if first is None:
        return (f"insufficient data: no GPU demand recorded in the {len(series) * hours:.0f} h of history; "
                f"the forecast starts by itself once {need * hours:.0f} h of demand are recorded")
    observed = len(series) - first
    if observed < need:
        return (f"insufficient data: {observed * hours:.0f} h of demand history, the forecast needs "
                f"{need * hours:.0f} h; it starts by itself in {(need - observed) * hours:.0f} h")
    return None


def since_first_demand(series: DemandSeries) -> DemandSeries:
    """``series`` from its first non-zero step (all of it when it never had demand is empty)."""
    first = next((i for i, v in enumerate(series.values) if v > 0), len(series))
    return series.window(first, len(series))


# ---- models -------------------------------------------------------------------------------


def _z(level: float) -> float:
    from scipy.stats import norm

    return float(norm.ppf(0.5 + level / 2))


def _weekly_terms(stamps: Any, k: int = 2) -> Any:
    import numpy as np

    phase = 2 * np.pi * (np.asarray(stamps) % WEEK_S) / WEEK_S
    return np.column_stack([f(j * phase) for j in range(1, k + 1) for f in (np.sin, np.cos)])


def _fit(model: str, history: Any, stamps: Any, future: Any, level: float) -> tuple[Any, Any, Any]:
    """Mean, lower, upper arrays for ``len(future)`` steps after ``history`` (numpy arrays)."""
    import numpy as np

    horizon = len(future)
    if model == "seasonal_naive":
        mean = np.tile(history[-DAY:], horizon // DAY + 1)[:horizon]
        sigma = float(np.std(history[DAY:] - history[:-DAY]))
        spread = _z(level) * sigma * np.sqrt(np.arange(horizon) // DAY + 1)
        return mean, mean - spread, mean + spread
    # Import first: statsmodels installs an "always" filter for its ConvergenceWarning on import,
    # which would override an "ignore" set before it.
    import pandas as pd
    from statsmodels.tsa.exponential_smoothing.ets import ETSModel
    from statsmodels.tsa.statespace.sarimax import SARIMAX

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if model == "ets":
            fitted = ETSModel(
                pd.Series(history), error="add", trend="add", damped_trend=True, seasonal="add",
                seasonal_periods=DAY,
            ).fit(disp=False, maxiter=200)
            frame = fitted.get_prediction(start=len(history), end=len(history) + horizon - 1)
            table = frame.summary_frame(alpha=1 - level)
            return (table["mean"].to_numpy(), table["pi_lower"].to_numpy(),
                    table["pi_upper"].to_numpy())
        if model == "sarimax":
            fitted = SARIMAX(
                history, exog=_weekly_terms(stamps), order=(1, 1, 1), seasonal_order=(1, 0, 0, DAY),
            ).fit(disp=False, maxiter=100)
            pred = fitted.get_forecast(horizon, exog=_weekly_terms(future))
            bounds = np.asarray(pred.conf_int(alpha=1 - level))
            return np.asarray(pred.predicted_mean), bounds[:, 0], bounds[:, 1]
    raise ForecastError(f"unknown forecasting model {model!r}; choose one of {', '.join(MODELS)}")


def fit_forecast(
    series: DemandSeries, model: str, horizon: int = 24, *, level: float = 0.9,
    train_window: int | None = 24 * 21,
) -> Forecast:
    """Fit ``model`` on the last ``train_window`` steps of ``series`` and forecast ``horizon`` steps.

    Forecasts and bounds are clipped at 0 and, when known, the series' capacity.
    """
    import numpy as np

    if model not in MODELS:
        raise ForecastError(f"unknown forecasting model {model!r}; choose one of {', '.join(MODELS)}")
    hist = series if train_window is None else series.window(len(series) - train_window, len(series))
    if len(hist) < 3 * DAY:
        raise ForecastError(
            f"demand history has {len(hist)} steps; forecasting needs at least {3 * DAY} "
            "(three days of hourly data) — collect more history or use a longer trace"
        )
    values = np.asarray(hist.values, dtype=float)
    stamps = np.asarray(hist.timestamps())
    begin = hist.start + len(hist) * hist.step_s
    future = begin + np.arange(horizon) * hist.step_s
    try:
        mean, lower, upper = _fit(model, values, stamps, future, level)
    except (ValueError, np.linalg.LinAlgError) as exc:
        raise ForecastError(f"model {model} could not be fitted: {exc}; try another model") from exc
    cap = series.capacity if series.capacity is not None else np.inf
    clip = lambda a: tuple(float(v) for v in np.clip(np.nan_to_num(a, nan=0.0), 0, cap))  # noqa: E731
    return Forecast(model, float(begin), hist.step_s, clip(mean), clip(lower), clip(upper), level)


def backtest(
    series: DemandSeries, models: Sequence[str] = MODELS, *, horizon: int = 24, origins: int = 14,
    spacing: int = 96, train_window: int = 24 * 21, progress: bool = False,
) -> Backtest:
    """Rolling-origin evaluation: the last ``origins`` cut points, ``spacing`` steps apart.

    At each origin every model is fitted on the preceding ``train_window`` steps and scored on
    the next ``horizon``; MASE divides its MAE by the in-sample MAE of the daily seasonal-naive
    forecast. Origins without enough history are skipped.
    """
    import numpy as np

    values = np.asarray(series.values, dtype=float)
    cuts = [len(values) - horizon - spacing * i for i in range(origins)]
    cuts = sorted(c for c in cuts if c >= 3 * DAY)
    if not cuts:
        raise ForecastError(
            f"series of {len(values)} steps is too short to backtest {horizon}-step forecasts; "
            f"it needs at least {3 * DAY + horizon} steps"
        )
    errors: dict[str, list[float]] = {m: [] for m in models}
    scaled: dict[str, list[float]] = {m: [] for m in models}
    seconds: dict[str, float] = dict.fromkeys(models, 0.0)
    iterator: Iterable[int] = cuts
    if progress:
        iterator = lab_module("tqdm").tqdm(cuts, desc="backtest origins", unit="origin")
    for cut in iterator:
        train = series.window(cut - train_window, cut)
        actual = values[cut:cut + horizon]
        hist = np.asarray(train.values)
        scale = float(np.mean(np.abs(hist[DAY:] - hist[:-DAY]))) or 1e-9
        for model in models:
            began = time.perf_counter()
            fc = fit_forecast(train, model, horizon, train_window=None)
            seconds[model] += time.perf_counter() - began
            mae = float(np.mean(np.abs(np.asarray(fc.mean) - actual)))
            errors[model].append(mae)
            scaled[model].append(mae / scale)
    scores = tuple(
        ModelScore(m, float(np.mean(errors[m])), float(np.mean(scaled[m])), seconds[m] / len(cuts))
        for m in models
    )
    chosen = min(scores, key=lambda s: s.mase).model
    return Backtest(horizon, len(cuts), train_window, scores, chosen)


def forecast_demand(
    series: DemandSeries, horizon: int = 24, *, models: Sequence[str] = MODELS, level: float = 0.9,
    origins: int = 7, spacing: int = 24, train_window: int = 24 * 21,
) -> tuple[Forecast, Backtest]:
    """Choose the model by :func:`backtest`, refit it on the latest window, forecast ``horizon``."""
    result = backtest(series, models, horizon=horizon, origins=origins, spacing=spacing,
                      train_window=train_window)
    return fit_forecast(series, result.chosen, horizon, level=level, train_window=train_window), result


def plot_forecast(
    series: DemandSeries, forecast: Forecast, path: str | Path, *, history_steps: int = 24 * 7,
    title: str = "GPU demand forecast", actual: DemandSeries | None = None,
) -> Path:
    """Write a PNG of the recent history, the forecast and its interval; returns the path.

    ``actual`` (optional) is drawn over the forecast window, for backtest pictures. Needs the
    ``lab`` extra (matplotlib): without it, :class:`~gpusched.errors.MissingExtraError`.
    """
    plt = pyplot()
    recent = series.window(len(series) - history_steps, len(series))
    import numpy as np

    as_dt = lambda ts: np.array([np.datetime64(int(t), "s") for t in ts])  # noqa: E731
    fig, ax = plt.subplots(figsize=(10, 4))
    try:
        ax.plot(as_dt(recent.timestamps()), recent.values, color="#333", lw=1, label="history")
        stamps = as_dt(forecast.timestamps())
        ax.plot(stamps, forecast.mean, color="#1f77b4", lw=1.5, label=f"forecast ({forecast.model})")
        ax.fill_between(stamps, forecast.lower, forecast.upper, color="#1f77b4", alpha=0.25,
                        label=f"{forecast.level:.0%} interval")
        if actual is not None:
            ax.plot(as_dt(actual.timestamps()), actual.values, color="#2ca02c", lw=1, label="actual")
        if series.capacity:
            ax.axhline(series.capacity, color="#d62728", ls="--", lw=1, label="capacity")
        ax.set_ylabel("GPUs in use")
        ax.set_title(title)
        ax.legend(loc="upper left")
        fig.autofmt_xdate()
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=100, bbox_inches="tight")
    finally:
        plt.close(fig)
    return out
