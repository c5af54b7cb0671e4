"""Metrics of a simulation run: utilisation, queueing delay, JCT, fragmentation, energy.

Definitions (all pure functions of a :class:`~gpusched.sim.engine.SimResult`):

* **utilisation %** — time-average of allocated milli-GPU / fleet capacity over a window
  (default: first arrival → last arrival, the period with offered load; ``makespan`` variant:
  first arrival → last completion).
* **unallocated GPU %** — 100 − utilisation.
* **fragmentation %** — time-average, over the same window, of the capacity that is free *while
  at least one job is waiting*: idle GPUs that the queue could not use (shape, topology or
  ordering), in % of capacity.
* **queueing delay** — start − arrival of every started job (mean, p50, p95); jobs that never
  started are counted separately.
* **JCT** — end − arrival of finished jobs (mean, optionally of a key subset such as Gavel's jobs
  4000–4999).
* **energy** — Σ over jobs, their runs and shares of (share / 1000) × catalog TDP × run time: the
  energy of allocated accelerator time at full board power (kWh; a preempted job counts only its
  runs, work it lost included); idle power is not modelled.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Any

from gpusched.catalog import default_catalog
from gpusched.sim.results import JobRecord, SimResult, TimelinePoint

__all__ = ["energy_kwh", "percentile", "summarize", "time_average"]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0–100) by linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    data = sorted(values)
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def time_average(
    timeline: Sequence[TimelinePoint],
    start: float,
    end: float,
    *,
    waiting_only: bool = False,
    capacity: int = 0,
) -> float:
    """Time-average of used milli-GPU over [start, end] (piecewise constant).

    With ``waiting_only``, the average of *free* milli-GPU counted only while jobs wait
    (``capacity`` must be given), still divided by the whole window.
    """
    if end <= start or not timeline:
        return 0.0
    total = 0.0
    for i, point in enumerate(timeline):
        seg_start = max(point.t, start)
        seg_end = min(timeline[i + 1].t if i + 1 < len(timeline) else end, end)
        if seg_end <= seg_start:
            continue
        if waiting_only:
            value = (capacity - point.used_milli) if point.waiting > 0 else 0
        else:
            value = point.used_milli
        total += value * (seg_end - seg_start)
    return total / (end - start)


def energy_kwh(records: Sequence[JobRecord], result: SimResult, until: float | None = None) -> float:
    """Energy of allocated device time at catalog TDP, in kWh (clipped at ``until`` if given)."""
    cat = default_catalog()
    joules = 0.0
    for rec in records:
        for start, stop, shares in rec.segments:  # a preempted job holds devices only in its runs
            end = stop if until is None else min(stop, until)
            if end <= start:
                continue
            for share in shares:
                model = cat.get(result.fleet.device(share.uuid).model)
                joules += share.milli / 1000 * model.tdp_milliwatts / 1000 * (end - start)
    return joules / 3.6e6


def summarize(result: SimResult, *, measure: Collection[str] | None = None) -> dict[str, Any]:
    """All metrics as a JSON-safe dict; ``measure`` restricts delay/JCT to those job keys."""
    recs = result.records
    if measure is not None:
        wanted = set(measure)
        recs = [r for r in recs if r.key in wanted]
    finished = [r for r in recs if r.end_s <= result.end_time]
    arrivals = [r.arrival_s for r in result.records]
    t0 = min(arrivals, default=0.0)
    last_arrival = max(arrivals, default=0.0)
    last_end = max((r.end_s for r in result.records), default=0.0)
    cap = result.capacity_milli
    window_end = last_arrival if last_arrival > t0 else last_end
    util = 100.0 * time_average(result.timeline, t0, window_end) / cap if cap else 0.0
    util_span = (
        100.0 * time_average(result.timeline, t0, min(last_end, result.end_time)) / cap if cap else 0.0
    )
    frag = (
        100.0 * time_average(result.timeline, t0, window_end, waiting_only=True, capacity=cap) / cap
        if cap
        else 0.0
    )
    delays = [r.queue_delay_s for r in recs]
    jcts = [r.jct_s for r in finished]
    summary = {
        "policy": result.policy,
        "jobs_started": len(recs),
        "jobs_finished": len(finished),
        "jobs_rejected": len(result.rejected),
        "jobs_unstarted": len(result.unstarted),
        "capacity_gpus": cap / 1000,
        "utilisation_pct": round(util, 3),
        "utilisation_makespan_pct": round(util_span, 3),
        "unallocated_gpu_pct": round(100.0 - util, 3),
        "fragmentation_pct": round(frag, 3),
        "queue_delay_mean_s": round(_mean(delays), 3),
        "queue_delay_p50_s": round(percentile(delays, 50), 3),
        "queue_delay_p95_s": round(percentile(delays, 95), 3),
        "jct_mean_s": round(_mean(jcts), 3),
        "jct_mean_h": round(_mean(jcts) / 3600, 4),
        "makespan_s": round(last_end - t0, 3),
        "energy_kwh": round(energy_kwh(recs, result, until=result.end_time), 6),
        "place_calls": result.place_calls,
        "replans": result.replans,
        "replans_improved": result.replans_improved,
        "place_ms_mean": round(1000 * result.place_seconds / result.place_calls, 3)
        if result.place_calls
        else 0.0,
    }
    if result.quota is not None:
        summary["quota"] = result.quota
    if result.durations is not None:
        summary["durations"] = result.durations
    if result.preemption is not None:
        summary["preemption"] = result.preemption
    return summary
