"""Gavel benchmark: continuous-single job completion time on 36 V100 + 36 P100 + 36 K80.

Returns a JSON-safe dict; :mod:`gpusched.commands.bench` prints it and :mod:`gpusched.bench.report`
turns it into tables and plots.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

from gpusched.errors import TraceError
from gpusched.placement import Policy
from gpusched.sim.engine import simulate
from gpusched.sim.fleets import gavel_fleet
from gpusched.sim.jobs import trace_jobs
from gpusched.sim.metrics import summarize
from gpusched.sim.traces import GAVEL_MODELS, load_gavel_jobs, load_gavel_throughputs

__all__ = ["gavel_policy", "run_gavel"]


def gavel_policy(name: str, throughputs: Path | None) -> Policy:
    """The preset; ``gpusched`` also gets Gavel's measured throughput table (job type → model → steps/s)."""
    if name != "gpusched" or throughputs is None:
        return Policy.named(name)
    table: dict[str, dict[str, float]] = {}
    for short, jobs in load_gavel_throughputs(throughputs).items():
        model = GAVEL_MODELS.get(short)
        if model is None:
            continue
        for key, speed in jobs.items():
            try:
                job_type, scale = ast.literal_eval(key)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                raise TraceError(throughputs, f"job key {key[:60]!r} is not a (job type, scale) pair",
                                 "use Gavel's simulation_throughputs.json") from None
            if scale == 1:
                table.setdefault(job_type, {})[model] = speed
    return Policy.named(name, throughput=table)


def run_gavel(
    jobs_csv: Path,
    policy_name: str,
    *,
    throughputs: Path | None = None,
    measure: tuple[int, int] = (4000, 5000),
    gpus_per_server: int = 4,
    round_s: float = 360.0,
    replan_ms: float = 0.0,
    progress: bool = False,
) -> dict[str, Any]:
    """Gavel's continuous-single experiment, non-preemptive.

    Returns the metrics with JCT averaged over job ids ``measure[0]`` … ``measure[1] - 1``.
    ``replan_ms`` > 0 re-plans every pass with the genetic optimiser (see
    :func:`~gpusched.sim.engine.simulate`).
    """
    trace = load_gavel_jobs(jobs_csv)
    jobs = trace_jobs(trace)
    keys = {str(k) for k in range(*measure)} & {j.key for j in jobs}
    if not keys:
        raise TraceError(
            jobs_csv, f"has no job ids {measure[0]}–{measure[1] - 1} to measure",
            "pick a --measure range of job ids inside the trace",
        )
    result = simulate(
        jobs,
        gavel_fleet(gpus_per_server=gpus_per_server),
        gavel_policy(policy_name, throughputs),
        policy_name=policy_name,
        round_s=round_s,
        max_pending=gavel_fleet().total_devices(),
        stop_after=keys,
        replan_budget_ms=replan_ms,
        progress=progress,
    )
    summary = summarize(result, measure=keys)
    by_model: dict[str, int] = {}
    for rec in result.records:
        if rec.key in keys:
            by_model[rec.models[0]] = by_model.get(rec.models[0], 0) + 1
    summary.update(
        trace=jobs_csv.name,
        measured_jobs=f"{measure[0]}-{measure[1] - 1}",
        round_s=round_s,
        gpus_per_server=gpus_per_server,
        measured_by_model=by_model,
        replan_ms=replan_ms,
    )
    return summary
