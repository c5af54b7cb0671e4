"""Philly benchmark: queueing delay and utilisation of one busy week on a P100 fleet."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from gpusched.errors import TraceError
from gpusched.placement import Policy
from gpusched.sim.engine import simulate, with_expected_durations
from gpusched.sim.fleets import uniform_fleet
from gpusched.sim.jobs import trace_jobs
from gpusched.sim.metrics import summarize
from gpusched.sim.traces import load_philly_jobs

__all__ = ["PHILLY_WINDOW", "gputime_priority", "run_philly"]

PHILLY_WINDOW = ("2017-10-09", "2017-10-16")
"""Default Philly window: one busy October week (12,3k jobs) — see docs/benchmarks.md."""


def run_philly(
    jobs_csv: Path,
    policy_name: str,
    *,
    nodes: int = 50,
    gpus_per_node: int = 8,
    window: tuple[str, str] = PHILLY_WINDOW,
    clusters: frozenset[str] | None = None,
    oracle: bool = False,
    short_first: bool = False,
    head_of_line: bool = False,
    max_pending: int = 256,
    replan_ms: float = 0.0,
    progress: bool = False,
) -> dict[str, Any]:
    """Replay a Philly window on ``nodes`` × ``gpus_per_node`` identical GPUs; queueing and utilisation.

    ``oracle`` gives the scheduler every job's true run time as its expected duration (for
    reservations/backfill); off by default, as users rarely know it. ``clusters`` keeps only those
    virtual clusters; an empty selection raises :class:`~gpusched.errors.TraceError`.
    ``short_first`` also sets each request's priority from its GPU-time (see
    :func:`gputime_priority`), as a DAG author who knows the size of the job would; it implies
    ``oracle``. ``head_of_line`` makes the queue strict FIFO (nothing starts past the first
    waiting job; see :func:`~gpusched.sim.engine.simulate`). ``replan_ms`` > 0 re-plans every
    pass with the genetic optimiser.
    """
    trace = load_philly_jobs(
        jobs_csv, start=window[0], end=window[1], clusters=clusters, max_gpus=nodes * gpus_per_node
    )
    if not trace:
        among = f" of clusters {','.join(sorted(clusters))}" if clusters else ""
        raise TraceError(
            jobs_csv, f"has no jobs{among} in the window {window[0]} – {window[1]} (end exclusive)",
            "pick --start/--end inside the trace's time span, or other --clusters",
        )
    jobs = trace_jobs(trace, span_over=gpus_per_node)
    if oracle or short_first:
        jobs = with_expected_durations(jobs)
    if short_first:
        jobs = [
            replace(j, request=replace(j.request, priority=gputime_priority(j.duration_s * j.request.count)))
            for j in jobs
        ]
    result = simulate(
        jobs,
        uniform_fleet(nodes, gpus_per_node, "P100"),
        Policy.named(policy_name),
        policy_name=policy_name,
        max_pending=max_pending,
        head_of_line=head_of_line,
        replan_budget_ms=replan_ms,
        progress=progress,
    )
    summary = summarize(result)
    summary.update(
        trace=jobs_csv.name,
        window=list(window),
        clusters=sorted(clusters) if clusters else None,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        jobs=len(jobs),
        oracle_durations=oracle or short_first,
        short_first=short_first,
        head_of_line=head_of_line,
        max_pending=max_pending,
        replan_ms=replan_ms,
    )
    return summary


def gputime_priority(gpu_seconds: float) -> int:
    """Priority 10–90 from a job's GPU-time: 90 under 2 GPU-minutes, 8 points less per doubling.

    Quasi-shortest-service-first (Helios, SC '21) expressed through ``GPURequest.priority``;
    stays below the critical level, so it never triggers reservations.
    """
    doublings = max(0.0, math.log2(max(gpu_seconds, 1.0) / 120.0))
    return max(10, 90 - 8 * math.floor(doublings))
