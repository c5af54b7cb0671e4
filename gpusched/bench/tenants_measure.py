"""Measures of the multi-tenant replay (:mod:`gpusched.bench.tenants`), over the simulator's result.

Per tenant and budget period: use against budget and the worst overshoot in units of that
tenant's largest single task (:func:`tenant_rows`). Per partition, over the week and per day: its
GPU-hours as a share of the fleet, the *shortfall* against ``min(share, eligible demand)`` and the
GPU-hours borrowed beyond its share (:func:`partition_rows`). Use is counted over a job's runs
(``JobRecord.segments``), never over the time a preempted or stopped job waited.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from gpusched.catalog import default_catalog
from gpusched.model import FleetSnapshot
from gpusched.quota.policy import UNITS_PER_A100_HOUR, QuotaPolicy, physical_milli
from gpusched.quota.usage import UsageSpan, period_start, tenant_usage
from gpusched.request import Partition
from gpusched.sim.engine import SimJob, SimResult
from gpusched.sim.metrics import summarize

__all__ = ["a100_equiv_per_device", "measure_run", "partition_rows", "tenant_rows"]


def a100_equiv_per_device(fleet: FleetSnapshot) -> float:
    """A100-equivalent speed of the (uniform) fleet's model, 1.0 when the catalog lacks it."""
    model = default_catalog().find(next(iter(fleet.devices())).model)
    return (model.a100_equiv_milli if model is not None else 1000) / 1000


def _integral(events: Sequence[tuple[float, int, int]], lo: float, hi: float, fn: Any) -> float:
    """∫ fn(use, demand) dt over [lo, hi) of the step functions of sorted (t, Δuse, Δdemand) events."""
    use = demand = 0
    total, prev = 0.0, lo
    for t, du, dd in events:
        if t >= hi:
            break
        if t > prev:
            total += fn(use, demand) * (t - prev)
            prev = t
        use += du
        demand += dd
    return total + fn(use, demand) * (hi - prev)


def _events(result: SimResult, jobs: Mapping[str, SimJob]) -> dict[Partition, list[tuple[float, int, int]]]:
    """Per partition, sorted step events of milli-GPU held (use) and arrived but unfinished (demand)."""
    out: dict[Partition, list[tuple[float, int, int]]] = {p: [] for p in Partition}
    for r in result.records:
        part = jobs[r.key].request.partition
        milli = jobs[r.key].request.total_milli
        out[part] += [(r.arrival_s, 0, milli), (r.end_s, 0, -milli)]
        for start, end, shares in r.segments:  # held only while running, not while requeued
            held = physical_milli(shares, result.fleet)
            out[part] += [(start, held, 0), (end, -held, 0)]
    for key in result.unstarted:  # waiting until the run stopped
        job = jobs[key]
        milli = job.request.total_milli
        out[job.request.partition] += [(job.arrival_s, 0, milli), (result.end_time, 0, -milli)]
    for events in out.values():
        events.sort(key=lambda e: e[0])
    return out


def _shortfall_grid(result: SimResult, jobs: Mapping[str, SimJob], policy: QuotaPolicy,
                    enforced: bool, grid: Sequence[float]) -> dict[Partition, Any]:
    """Per partition, at each instant of ``grid``: milli-GPU by which it held less than
    ``min(its share, its eligible demand)``; eligible = running + waiting work that its tenant's
    budget would let start then (the executor's ``check_budget`` over use + committed + cost)."""
    import numpy as np

    equiv = a100_equiv_per_device(result.fleet) * 1000  # normalised milli per whole device
    tenants = sorted({j.request.tenant for j in jobs.values()})
    tid = {t: i for i, t in enumerate(tenants)}
    parts = list(Partition)
    inf = float("inf")
    budget = np.array([inf if policy.budget(t) is None or not enforced else float(policy.budget(t) or 0)
                       for t in tenants])
    recs = result.records
    default = policy.default_duration_s

    def hint(key: str) -> float:
        return float(jobs[key].request.expected_duration_s or default)

    # One row per run (a restarted job's runs are separate; it held nothing in between), its
    # expected end = run start + the estimate less the run time before it; one waiting row per
    # stretch in the queue (arrival to first start, and between runs).
    runs: list[tuple[str, float, float, Any, float]] = []
    waits: list[tuple[SimJob, float, float, float]] = []
    for r in recs:
        job, ran, since = jobs[r.key], 0.0, r.arrival_s
        for start, end, held in r.segments:
            # the engine charges a restart what is left of a given estimate, a default afresh
            left = max(0.0, hint(r.key) - ran) if job.request.expected_duration_s else hint(r.key)
            waits.append((job, since, start, left))
            runs.append((r.key, start, end, held, left))
            ran += end - start
            since = end
    waits += [(jobs[k], jobs[k].arrival_s, inf, hint(k)) for k in result.unstarted]
    r_start = np.array([run[1] for run in runs])
    r_end = np.array([run[2] for run in runs])
    r_exp = r_start + np.array([run[4] for run in runs])
    r_milli = np.array([physical_milli(run[3], result.fleet) for run in runs], dtype=float)
    r_rate = r_milli * equiv / 1000
    r_tid = np.array([tid[jobs[run[0]].request.tenant] for run in runs], dtype=int)
    r_part = np.array([parts.index(jobs[run[0]].request.partition) for run in runs], dtype=int)
    w_arr = np.array([since for _, since, _, _ in waits])
    w_start = np.array([until for _, _, until, _ in waits])
    w_milli = np.array([j.request.total_milli for j, _, _, _ in waits], dtype=float)
    w_cost = w_milli * equiv / 1000 * np.array([left for _, _, _, left in waits])
    w_tid = np.array([tid[j.request.tenant] for j, _, _, _ in waits], dtype=int)
    w_part = np.array([parts.index(j.request.partition) for j, _, _, _ in waits], dtype=int)
    shares = np.array([result.capacity_milli * policy.shares_pct[p] / 100 for p in parts])
    out = np.zeros((len(grid), len(parts)))
    n_t, n_p = len(tenants), len(parts)
    for i, t in enumerate(grid):
        since = period_start(t, policy.period_s)
        held_s = np.clip(np.minimum(r_end, t) - np.maximum(r_start, since), 0, None)
        used = np.bincount(r_tid, r_rate * held_s, minlength=n_t)
        run = (r_start <= t) & (r_end > t)
        committed = np.bincount(r_tid, r_rate * np.clip(r_exp - t, 0, None) * run, minlength=n_t)
        use = np.bincount(r_part, r_milli * run, minlength=n_p)
        wait = (w_arr <= t) & (w_start > t)
        held = used[w_tid] + committed[w_tid] + w_cost > budget[w_tid]
        eligible = use + np.bincount(w_part, w_milli * (wait & ~held), minlength=n_p)
        out[i] = np.clip(np.minimum(shares, eligible) - use, 0, None)
    return {p: out[:, k] for k, p in enumerate(parts)}


def partition_rows(result: SimResult, jobs: Mapping[str, SimJob], policy: QuotaPolicy,
                   lo: float, hi: float, *, enforced: bool = True, step_s: float = 900.0) -> dict[str, Any]:
    """Per partition over [lo, hi) and per day: share of the fleet's GPU-hours, shortfall, borrowing."""
    cap = result.capacity_milli
    per = _events(result, jobs)
    days = [(lo + d * 86400, min(hi, lo + (d + 1) * 86400)) for d in range(math.ceil((hi - lo) / 86400))]
    grid = [lo + step_s * (k + 0.5) for k in range(math.ceil((hi - lo) / step_s))]
    short_at = _shortfall_grid(result, jobs, policy, enforced, grid)
    rows: dict[str, Any] = {}
    for p in Partition:
        share = cap * policy.shares_pct[p] / 100
        events = per[p]

        def pct(a: float, b: float, fn: Any, events: list = events) -> float:
            """``fn``'s time-average over [a, b) in % of the fleet."""
            return 100 * _integral(events, a, b, fn) / (cap * (b - a))

        def held(u: int, d: int) -> float:
            return u

        def short(a: float, b: float, p: Partition = p) -> float:
            """Mean shortfall over the grid instants in [a, b), in % of the fleet."""
            vals = [v for t, v in zip(grid, short_at[p], strict=True) if a <= t < b]
            return float(100 * sum(vals) / (len(vals) * cap)) if vals else 0.0

        def lent(u: int, d: int, share: float = share) -> float:
            return max(0.0, u - share)

        fleet_h = cap * (hi - lo) / 3.6e6
        rows[p.value] = {
            "target_pct": policy.shares_pct[p],
            "gpu_hours": round(pct(lo, hi, held) * fleet_h / 100, 1),
            "share_of_fleet_pct": round(pct(lo, hi, held), 2),
            "demand_pct": round(pct(lo, hi, lambda u, d: min(d, cap)), 2),
            "shortfall_pts": round(short(lo, hi), 2),
            "borrowed_gpu_hours": round(pct(lo, hi, lent) * fleet_h / 100, 1),
            "daily_share_of_fleet_pct": [round(pct(a, b, held), 2) for a, b in days],
            "daily_shortfall_pts": [round(short(a, b), 2) for a, b in days],
        }
    used = sum(r["gpu_hours"] for r in rows.values()) or 1.0
    for r in rows.values():
        r["share_of_used_pct"] = round(100 * r["gpu_hours"] / used, 2)
    return rows


def tenant_rows(result: SimResult, jobs: Mapping[str, SimJob], policy: QuotaPolicy,
                largest: Mapping[str, float], demand: Mapping[str, float],
                week_start: float) -> dict[str, Any]:
    """Per tenant: budget, use in the replay week's period and in the worst period, overshoot."""

    spans = [UsageSpan(jobs[r.key].request.tenant, jobs[r.key].request.partition, shares, start, end)
             for r in result.records for start, end, shares in r.segments]
    first = period_start(week_start, policy.period_s)
    periods = range(max(1, math.ceil((result.end_time - first) / policy.period_s)))
    by_period = [tenant_usage(spans, result.fleet, first + k * policy.period_s,
                              min(result.end_time, first + (k + 1) * policy.period_s)) for k in periods]
    rows: dict[str, Any] = {}
    for tenant in sorted(demand):
        budget = policy.budgets_hours.get(tenant)
        used = [u.get(tenant, 0) / UNITS_PER_A100_HOUR for u in by_period]
        worst = max(used, default=0.0)
        over = max(0.0, worst - budget) if budget is not None else 0.0
        mine = [j for j in jobs.values() if j.request.tenant == tenant]
        rows[tenant] = {
            "partition": mine[0].request.partition.value if mine else None,
            "demand_gpu_hours": round(demand[tenant], 1),
            "budget_gpu_hours": budget,
            "used_gpu_hours": round(used[0] if used else 0.0, 1),
            "worst_period_gpu_hours": round(worst, 1),
            "largest_task_gpu_hours": round(largest[tenant], 2),
            "overshoot_gpu_hours": round(over, 2),
            "overshoot_tasks": round(over / largest[tenant], 3) if largest[tenant] else 0.0,
            "jobs": len(mine),
            "jobs_waiting_at_end": sum(1 for k in result.unstarted if jobs[k].request.tenant == tenant),
            "jobs_rejected": sum(1 for k in result.rejected if jobs[k].request.tenant == tenant),
        }
    return rows


def measure_run(result: SimResult, jobs: Mapping[str, SimJob], policy: QuotaPolicy,
             largest: Mapping[str, float], demand: Mapping[str, float],
             lo: float, hi: float, enforced: bool) -> dict[str, Any]:
    tenants = tenant_rows(result, jobs, policy, largest, demand, lo)
    parts = partition_rows(result, jobs, policy, lo, hi, enforced=enforced)
    summary = summarize(result)
    return {
        "tenants": tenants,
        "partitions": parts,
        "max_overshoot_tasks": max((t["overshoot_tasks"] for t in tenants.values()), default=0.0),
        "tenants_at_budget": sum(1 for t in tenants.values()
                                 if t["worst_period_gpu_hours"] >= 0.9 * (t["budget_gpu_hours"] or math.inf)),
        "max_shortfall_pts": max(p["shortfall_pts"] for p in parts.values()),
        "borrowed_gpu_hours": round(sum(p["borrowed_gpu_hours"] for p in parts.values()), 1),
        "utilisation_pct": summary["utilisation_pct"],
        "queue_delay_mean_s": summary["queue_delay_mean_s"],
        "jobs_finished": summary["jobs_finished"],
        "jobs_waiting_at_end": len(result.unstarted),
        "jobs_rejected": len(result.rejected),
        "preempted": result.preemption,
        "over_budget": (result.quota or {}).get("over_budget"),  # stops at the budget (quota run)
    }
