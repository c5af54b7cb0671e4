"""Multi-tenant replay: Philly virtual clusters as tenants under GPU-hour budgets and partitions.

One Philly window is replayed twice on the same fleet, with and without a quota file that this
harness writes (``quota-<tag>.yaml``, the executor's format, read back through
:func:`gpusched.airflow.quota_file.read_quota_policy`). The rules, all from the window's own
submitted demand (A100-equivalent GPU-hours: GPUs × run time × the catalog's speed of the fleet's
model), none picked by hand:

* **tenant** = the job's virtual cluster (``trace_jobs`` does this);
* **partition**: virtual clusters by demand, largest first; a cluster goes to training while the
  demand of the clusters before it is under the training share (70 %), then to burst while under
  training + burst (90 %), the rest to dev — the biggest users train, the smallest develop;
* **budget** per weekly period = ``budget_fraction`` × the cluster's demand (rounded down, at least
  1 A100-h), so every tenant that tries to run its whole demand within the week is constrained.

Measures (:func:`tenant_rows`, :func:`partition_rows`): per tenant and budget period, use against
budget, the worst overshoot in units of that tenant's largest single task (its A100-h); per
partition, over the week and per day, its GPU-hours as a share of the fleet, the *shortfall*
(points of fleet capacity by which it held less than ``min(its share, its demand)``: arrived,
unfinished work), and the GPU-hours borrowed beyond its share (idle capacity lent).
The simulator's clock is the trace's shifted by whole weeks, so budget periods start on Mondays
00:00 UTC as in the executor.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from gpusched.catalog import default_catalog
from gpusched.errors import TraceError
from gpusched.model import FleetSnapshot
from gpusched.quota.policy import DEFAULT_SHARES, QuotaPolicy, physical_milli
from gpusched.request import Partition
from gpusched.sim.engine import SimJob, SimResult

__all__ = ["WEEK_S", "Replay", "assign_partitions", "budgets_for", "demand_hours", "measure_tenants",
           "partition_rows", "replay_tenants", "run_tenants", "tenant_rows"]

WEEK_S = 7 * 86400
_MONDAY = 4 * 86400  # 1970-01-05 00:00 UTC; the sim clock's Monday (as in gpusched.quota.usage)


def _equiv(fleet: FleetSnapshot) -> float:
    """A100-equivalent GPUs of one whole device of the (uniform) fleet."""
    model = default_catalog().find(next(iter(fleet.devices())).model)
    return (model.a100_equiv_milli if model is not None else 1000) / 1000


def demand_hours(jobs: Sequence[SimJob], equiv: float) -> tuple[dict[str, float], dict[str, float]]:
    """Per tenant: submitted A100-h, and its largest single task's A100-h."""
    total: dict[str, float] = {}
    largest: dict[str, float] = {}
    for j in jobs:
        hours = j.request.count * j.duration_s * equiv / 3600
        total[j.request.tenant] = total.get(j.request.tenant, 0.0) + hours
        largest[j.request.tenant] = max(largest.get(j.request.tenant, 0.0), hours)
    return total, largest


def assign_partitions(demand: Mapping[str, float],
                      shares: Mapping[Partition, int] = DEFAULT_SHARES) -> dict[str, Partition]:
    """The module's partition rule: largest demand first, by the cumulative demand before each."""
    whole = sum(demand.values()) or 1.0
    out: dict[str, Partition] = {}
    before = 0.0
    for tenant in sorted(demand, key=lambda t: (-demand[t], t)):
        pct = 100 * before / whole
        if pct < shares[Partition.TRAINING]:
            out[tenant] = Partition.TRAINING
        elif pct < shares[Partition.TRAINING] + shares[Partition.BURST]:
            out[tenant] = Partition.BURST
        else:
            out[tenant] = Partition.DEV
        before += demand[tenant]
    return out


def budgets_for(demand: Mapping[str, float], fraction: float) -> dict[str, int]:
    """The module's budget rule: ``fraction`` × demand per period, whole A100-h, at least 1."""
    return {t: max(1, math.floor(fraction * h)) for t, h in sorted(demand.items())}


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

    from gpusched.quota.usage import period_start

    equiv = _equiv(result.fleet) * 1000  # normalised milli per whole device
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
    from gpusched.quota.policy import UNITS_PER_A100_HOUR
    from gpusched.quota.usage import UsageSpan, period_start, tenant_usage

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


def _measure(result: SimResult, jobs: Mapping[str, SimJob], policy: QuotaPolicy,
             largest: Mapping[str, float], demand: Mapping[str, float],
             lo: float, hi: float, enforced: bool) -> dict[str, Any]:
    from gpusched.sim.metrics import summarize

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


@dataclass
class Replay:
    """One window replayed with the quota file (``results["quota"]``) and without (``"baseline"``)."""

    config: dict[str, Any]
    jobs: dict[str, SimJob]
    policy: QuotaPolicy
    demand: dict[str, float]
    largest: dict[str, float]
    partition_of: dict[str, Partition]
    week: tuple[float, float]
    results: dict[str, SimResult] = field(default_factory=dict)


def replay_tenants(
    jobs_csv: Path,
    *,
    window: tuple[str, str],
    nodes: int = 50,
    gpus_per_node: int = 8,
    budget_fraction: float = 0.5,
    durations: str = "oracle",
    policy_name: str = "gpusched",
    max_pending: int = 256,
    preemption: str = "off",
    over_budget: str = "finish",
    out_dir: Path | None = None,
    progress: bool = False,
) -> Replay:
    """Replay ``window`` of ``jobs_csv`` with and without the derived quota file (written to ``out_dir``).

    ``durations``: ``oracle`` gives each request its true run time (budgets are charged what the
    task will use), ``predicted`` lets the executor's duration predictor (:mod:`gpusched.durations`)
    estimate it from the jobs finished so far in the replay, ``none`` leaves it unset (a task is
    charged the quota's 1 h default).
    ``preemption`` (``off``, ``priority``, ``partitions``) is the executor's victim selection in both
    runs (:class:`~gpusched.sim.preempt.SimPreemption`); a preempted job's use is counted over its
    runs only (``JobRecord.segments``), not while it waited to restart.
    ``over_budget`` (``finish`` or ``stop``, the executor's ``[gpusched] over_budget``) is what the
    quota run does with running work whose tenant crosses its budget
    (:class:`~gpusched.sim.overbudget.SimOverBudget`).
    """
    from gpusched.airflow.quota_file import read_quota_policy
    from gpusched.durations import DurationModel
    from gpusched.placement import Policy
    from gpusched.sim.engine import simulate, with_expected_durations
    from gpusched.sim.fleets import uniform_fleet
    from gpusched.sim.jobs import trace_jobs
    from gpusched.sim.overbudget import SimOverBudget
    from gpusched.sim.preempt import SimPreemption
    from gpusched.sim.traces import load_philly_jobs

    start = datetime.strptime(window[0], "%Y-%m-%d").replace(tzinfo=UTC)
    end = datetime.strptime(window[1], "%Y-%m-%d").replace(tzinfo=UTC)
    monday = start - timedelta(days=start.weekday())
    trace = load_philly_jobs(jobs_csv, start=window[0], end=window[1], max_gpus=nodes * gpus_per_node,
                             origin=monday.strftime("%Y-%m-%d"))
    if not trace:
        raise TraceError(jobs_csv, f"has no jobs in the window {window[0]} – {window[1]} (end exclusive)",
                         "pick --start/--end inside the trace's time span (2017-10 to 2017-12)")
    fleet = uniform_fleet(nodes, gpus_per_node, "P100")
    raw = trace_jobs(trace, span_over=gpus_per_node)
    demand, largest = demand_hours(raw, _equiv(fleet))
    parts = assign_partitions(demand)
    budgets = budgets_for(demand, budget_fraction)
    # Whole weeks between the trace's clock and the sim's keep budget periods on Mondays.
    jobs = [replace(j, arrival_s=j.arrival_s + _MONDAY,
                    request=replace(j.request, partition=parts[j.request.tenant])) for j in raw]
    if durations == "oracle":
        jobs = with_expected_durations(jobs)
    tag = f"{window[0]}_{nodes}x{gpus_per_node}_{durations}" + (
        f"_budget{budget_fraction:g}" if budget_fraction != 0.5 else "") + (
        f"_preempt-{preemption}" if preemption != "off" else "") + (
        f"_{over_budget}" if over_budget != "finish" else "")
    folder = out_dir or Path("results/tenants")
    folder.mkdir(parents=True, exist_ok=True)
    quota_path = folder / f"quota-{tag}.yaml"
    quota_path.write_text(_quota_yaml(budgets), encoding="utf-8")
    policy = read_quota_policy(quota_path)
    lo = _MONDAY + (start - monday).total_seconds()
    config = {
        "trace": jobs_csv.name, "window": list(window), "nodes": nodes, "gpus_per_node": gpus_per_node,
        "model": "P100", "jobs": len(jobs), "policy": policy_name, "durations": durations,
        "budget_fraction": budget_fraction, "preemption": preemption, "over_budget": over_budget,
        "quota_file": quota_path.name,
        "tag": tag,
    }
    replay = Replay(config, {j.key: j for j in jobs}, policy, demand, largest, parts,
                    (lo, lo + (end - start).total_seconds()))
    for name, quota in (("quota", policy), ("baseline", None)):
        predictor = DurationModel() if durations == "predicted" else None
        replay.results[name] = simulate(jobs, fleet, Policy.named(policy_name), policy_name=policy_name,
                                        max_pending=max_pending, progress=progress, quota=quota,
                                        preemption=SimPreemption(preemption), predict_durations=predictor,
                                        over_budget=SimOverBudget(over_budget))
    return replay


def measure_tenants(replay: Replay) -> dict[str, Any]:
    """The JSON-safe figures of a :class:`Replay`: both runs, and the checks on the quota run."""
    lo, hi = replay.week
    runs = {name: _measure(result, replay.jobs, replay.policy, replay.largest, replay.demand, lo, hi,
                           enforced=name == "quota")
            for name, result in replay.results.items()}
    quota_run = runs["quota"]
    return {
        **replay.config,
        "partition_of": {t: p.value for t, p in sorted(replay.partition_of.items())},
        "checks": {
            "max_overshoot_tasks": quota_run["max_overshoot_tasks"],
            "budgets_hold": quota_run["max_overshoot_tasks"] <= 1.0,
            "max_shortfall_pts": quota_run["max_shortfall_pts"],
            "shares_hold": quota_run["max_shortfall_pts"] <= 5.0,
            "borrowed_gpu_hours": quota_run["borrowed_gpu_hours"],
            "idle_capacity_lent": quota_run["borrowed_gpu_hours"] > 0,
        },
        **runs,
    }


def run_tenants(jobs_csv: Path, **options: Any) -> dict[str, Any]:
    """:func:`replay_tenants` then :func:`measure_tenants` (same options)."""
    return measure_tenants(replay_tenants(jobs_csv, **options))


def _quota_yaml(budgets: Mapping[str, int]) -> str:
    lines = ["# written by gpusched bench tenants: budgets = fraction x each VC's demand (A100-h/week)",
             "shares: {training: 70, burst: 20, dev: 10}", "borrowing: true", f"period_s: {WEEK_S}",
             "default_duration_s: 3600", "budgets:"]
    return "\n".join(lines + [f"  '{t}': {b}" for t, b in budgets.items()]) + "\n"
