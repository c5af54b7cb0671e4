"""GPU demand on a regular time grid, and the ways to build one.

:class:`DemandSeries` is what :mod:`gpusched.capacity.forecast` forecasts and
:mod:`gpusched.capacity.demand_checks` validates. Builders: :func:`demand_from_jobs` (job
records, integrated exactly), :func:`demand_from_history` (``Ledger.demand_history`` rows, plus
the ``Ledger.waiting_history`` of demand that waited),
:func:`load_philly_demand` (the Philly trace) and :func:`synthetic_demand` (seeded daily/weekly
cycles for tests and demos).
numpy and pandas are imported inside the functions that need them.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gpusched.errors import ForecastError
from gpusched.model import MILLI

__all__ = [
    "DemandSeries",
    "demand_from_history",
    "demand_from_jobs",
    "load_philly_demand",
    "synthetic_demand",
]

WEEK_S = 7 * 86400


@dataclass(frozen=True, slots=True)
class DemandSeries:
    """GPU demand on a regular grid: ``values[i]`` = average GPUs in use in ``[t_i, t_i + step_s)``.

    Attributes:
        start: epoch seconds of the first step.
        step_s: step length in seconds (3600 for hourly).
        values: demand per step, in GPUs (fractions allowed).
        capacity: fleet size in GPUs, when known (the validation upper bound).
    """

    start: float
    step_s: int
    values: tuple[float, ...]
    capacity: float | None = None

    def __len__(self) -> int:
        return len(self.values)

    def timestamps(self) -> tuple[float, ...]:
        """Epoch seconds of each step's start."""
        return tuple(self.start + i * self.step_s for i in range(len(self.values)))

    def window(self, first: int, stop: int) -> DemandSeries:
        """Steps ``first`` .. ``stop - 1`` as a series of their own."""
        first = max(0, first)
        return DemandSeries(
            self.start + first * self.step_s, self.step_s, self.values[first:stop], self.capacity
        )

    def to_frame(self) -> Any:
        """A pandas DataFrame with columns ``timestamp`` (UTC datetime) and ``gpus``."""
        import pandas as pd

        stamps = pd.to_datetime([int(t) for t in self.timestamps()], unit="s", utc=True)
        return pd.DataFrame({"timestamp": stamps, "gpus": list(self.values)})


def demand_from_jobs(
    jobs: Iterable[tuple[float, float, float]],
    *,
    step_s: int = 3600,
    start: float | None = None,
    end: float | None = None,
    capacity: float | None = None,
) -> DemandSeries:
    """Average GPUs busy per step from ``(start_s, duration_s, gpus)`` job records.

    ``start`` defaults to the first job's start floored to the step; ``end`` (exclusive) to the
    last job's end. Each job contributes ``gpus × overlap / step_s`` to every step it overlaps.
    """
    import numpy as np

    rows = np.asarray(list(jobs), dtype=float).reshape(-1, 3)
    if rows.size == 0:
        raise ForecastError("no jobs to build a demand series from; give at least one job record")
    t0, t1, gpus = rows[:, 0], rows[:, 0] + np.maximum(rows[:, 1], 0.0), rows[:, 2]
    first = math.floor((t0.min() if start is None else start) / step_s) * step_s
    stop = t1.max() if end is None else end
    n = max(1, math.ceil((stop - first) / step_s))
    edges = first + np.arange(n + 1) * step_s
    # Integral of the busy-GPU step function, evaluated at the grid edges, differenced.
    times = np.concatenate([t0, t1])
    weights = np.concatenate([gpus, -gpus])
    order = np.argsort(times, kind="stable")
    times, weights = times[order], weights[order]
    level = np.cumsum(weights)
    area = np.concatenate([[0.0], np.cumsum(level[:-1] * np.diff(times))])
    idx = np.clip(np.searchsorted(times, edges, side="right") - 1, 0, len(times) - 1)
    integral = np.where(edges < times[0], 0.0, area[idx] + level[idx] * (edges - times[idx]))
    values = np.maximum(np.diff(integral) / step_s, 0.0)
    return DemandSeries(float(first), step_s, tuple(float(v) for v in values), capacity)


def demand_from_history(
    rows: Sequence[tuple[float, int]],
    *,
    step_s: int = 3600,
    capacity: float | None = None,
    waiting: Sequence[tuple[float, int]] = (),
) -> DemandSeries:
    """A series from ``Ledger.demand_history`` rows ``(step start, milli-GPU in use)``.

    ``waiting``: ``Ledger.waiting_history`` rows on the same steps (milli-GPU that waited for
    devices), added to each step, so the forecast sees the demand the fleet could not serve. With
    a ``capacity`` a step reads at most the whole fleet: no scaling serves more than that.
    """
    if not rows:
        raise ForecastError("the ledger returned no demand history; run the scheduler for a while "
                            "or configure a trace as the demand source")
    waited = dict(waiting)
    ordered = sorted(rows)
    values = [(milli + waited.get(at, 0)) / MILLI for at, milli in ordered]
    if capacity is not None:
        values = [min(value, capacity) for value in values]
    return DemandSeries(float(ordered[0][0]), step_s, tuple(values), capacity)


def load_philly_demand(path: str | Path, *, step_s: int = 3600) -> DemandSeries:
    """Hourly GPUs busy from the Philly trace (``timestamp,duration,num_gpus,…``, UTC times).

    Jobs are counted from their recorded timestamp for their duration. The series ends at the
    last submission: after it the trace only drains, which no live fleet would show.
    """
    jobs: list[tuple[float, float, float]] = []
    try:
        with open(path, newline="", encoding="utf-8") as handle:
            for row in csv.DictReader(handle):
                stamp = datetime.strptime(row["timestamp"], "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC)
                jobs.append((stamp.timestamp(), float(row["duration"]), float(row["num_gpus"])))
    except (OSError, KeyError, ValueError) as exc:
        raise ForecastError(
            f"cannot read Philly trace {path}: {exc}; pass --trace pointing at philly_jobs.csv"
        ) from exc
    last = max(j[0] for j in jobs) if jobs else 0.0
    return demand_from_jobs(jobs, step_s=step_s, end=math.floor(last / step_s) * step_s)


def synthetic_demand(
    hours: int = 24 * 21, *, seed: int = 0, base: float = 40.0, daily: float = 15.0,
    weekly: float = 8.0, noise: float = 3.0, capacity: float = 128.0, start: float = 1_700_000_000.0,
) -> DemandSeries:
    """A reproducible hourly series with daily and weekly cycles (for tests and demos)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    begin = math.floor(start / 3600) * 3600
    t = np.arange(hours) * 3600 + begin
    values = (base + daily * np.sin(2 * np.pi * (t % 86400) / 86400)
              + weekly * np.sin(2 * np.pi * (t % WEEK_S) / WEEK_S) + rng.normal(0, noise, hours))
    values = np.clip(values, 0, capacity)
    return DemandSeries(float(begin), 3600, tuple(float(v) for v in values), capacity)
