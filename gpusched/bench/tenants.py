"""Multi-tenant replay: Philly virtual clusters as tenants under GPU-hour budgets and partitions.

One Philly window is replayed twice on the same fleet, with and without a quota file that this
harness writes (``quota-<tag>.yaml``, the executor's format, read back through
:func:`gpusched.quota.file.read_quota_policy`). The rules, all from the window's own
submitted demand (A100-equivalent GPU-hours: GPUs × run time × the catalog's speed of the fleet's
model), none picked by hand:

* **tenant** = the job's virtual cluster (``trace_jobs`` does this);
* **partition**: virtual clusters by demand, largest first; a cluster goes to training while the
  demand of the clusters before it is under the training share (70 %), then to burst while under
  training + burst (90 %), the rest to dev — the biggest users train, the smallest develop;
* **budget** per weekly period = ``budget_fraction`` × the cluster's demand (rounded down, at least
  1 A100-h), so every tenant that tries to run its whole demand within the week is constrained.

Measures (:mod:`gpusched.bench.tenants_measure`): per tenant and budget period, use against
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

from gpusched.bench.tenants_measure import a100_equiv_per_device, measure_run
from gpusched.durations import DurationModel
from gpusched.errors import TraceError
from gpusched.placement import Policy
from gpusched.quota.file import read_quota_policy
from gpusched.quota.policy import DEFAULT_SHARES, QuotaPolicy
from gpusched.request import Partition
from gpusched.sim.engine import SimJob, SimResult, simulate, with_expected_durations
from gpusched.sim.fleets import uniform_fleet
from gpusched.sim.jobs import trace_jobs
from gpusched.sim.overbudget import SimOverBudget
from gpusched.sim.preempt import SimPreemption
from gpusched.sim.traces import load_philly_jobs

__all__ = ["WEEK_S", "Replay", "assign_partitions", "budgets_for", "demand_hours", "measure_tenants",
           "replay_tenants", "run_tenants"]

WEEK_S = 7 * 86400
_MONDAY = 4 * 86400  # 1970-01-05 00:00 UTC; the sim clock's Monday (as in gpusched.quota.usage)


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
    policy_parts: str = "",
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
    demand, largest = demand_hours(raw, a100_equiv_per_device(fleet))
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
        **({"policy_parts": policy_parts} if policy_parts else {}),
    }
    replay = Replay(config, {j.key: j for j in jobs}, policy, demand, largest, parts,
                    (lo, lo + (end - start).total_seconds()))
    for name, quota in (("quota", policy), ("baseline", None)):
        predictor = DurationModel() if durations == "predicted" else None
        placement = Policy.configured(policy_name, policy_parts, where="--policy-parts")
        replay.results[name] = simulate(jobs, fleet, placement, policy_name=policy_name,
                                        max_pending=max_pending, progress=progress, quota=quota,
                                        preemption=SimPreemption(preemption), predict_durations=predictor,
                                        over_budget=SimOverBudget(over_budget))
    return replay


def measure_tenants(replay: Replay) -> dict[str, Any]:
    """The JSON-safe figures of a :class:`Replay`: both runs, and the checks on the quota run."""
    lo, hi = replay.week
    runs = {name: measure_run(result, replay.jobs, replay.policy, replay.largest, replay.demand, lo, hi,
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
