"""Philly benchmark: queueing delay and utilisation of one busy week on a P100 fleet, beside FIFO.

Every run also replays the same jobs under the FIFO first-fit baseline (count-based, no run-time
estimates) in the same process, and reports the ratios against it with the wall and CPU time of
both replays. ``durations`` says what the scheduler knows of run times: ``none`` (nothing: the
queue stays FIFO), ``oracle`` (every job's true run time) or ``predicted`` (the executor's
predictor, :mod:`gpusched.durations`, learning online from the jobs finished so far in the replay,
warmed up with the jobs of the ``history_days`` before the window that had ended by its start).
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from gpusched.durations import DurationModel, FinishedRun
from gpusched.errors import ConfigurationError, TraceError
from gpusched.model import MILLI
from gpusched.placement import Policy
from gpusched.sim.engine import SimJob, simulate, with_expected_durations
from gpusched.sim.fleets import uniform_fleet
from gpusched.sim.jobs import trace_jobs
from gpusched.sim.metrics import summarize
from gpusched.sim.preempt import SimPreemption
from gpusched.sim.traces import load_philly_jobs

__all__ = ["DURATIONS", "PHILLY_WINDOW", "gputime_priority", "run_philly"]

PHILLY_WINDOW = ("2017-10-09", "2017-10-16")
"""Default Philly window: one busy October week (12,3k jobs) — see docs/benchmarks.md."""

DURATIONS = ("none", "predicted", "oracle")
"""What the scheduler is told of run times (``--durations``)."""

BASELINE_POLICY = "first-fit"


def run_philly(
    jobs_csv: Path,
    policy_name: str,
    *,
    nodes: int = 50,
    gpus_per_node: int = 8,
    window: tuple[str, str] = PHILLY_WINDOW,
    clusters: frozenset[str] | None = None,
    durations: str = "none",
    oracle: bool = False,
    history_days: float = 30.0,
    preemption: bool | str = False,
    short_first: bool = False,
    head_of_line: bool = False,
    max_pending: int = 256,
    replan_ms: float = 0.0,
    baseline: bool = True,
    progress: bool = False,
    policy_parts: str = "",
) -> dict[str, Any]:
    """Replay a Philly window on ``nodes`` × ``gpus_per_node`` identical GPUs; queueing and utilisation.

    ``durations`` is one of :data:`DURATIONS` (``oracle=True`` is the older spelling of
    ``durations="oracle"``). ``clusters`` keeps only those virtual clusters; an empty selection
    raises :class:`~gpusched.errors.TraceError`. ``short_first`` also sets each request's priority
    from its GPU-time (see :func:`gputime_priority`), as a DAG author who knows the size of the job
    would; it implies oracle durations. ``head_of_line`` makes the queue strict FIFO (nothing
    starts past the first waiting job; see :func:`~gpusched.sim.engine.simulate`). ``replan_ms``
    > 0 re-plans every pass with the genetic optimiser. ``preemption`` lets the replay stop running
    jobs with the executor's victim selection (:class:`~gpusched.sim.preempt.SimPreemption`,
    checkpoints every 30 minutes, 5 minutes' minimum run time): ``True`` / ``"on"`` /
    ``"service"`` = by expected remaining service (Gittins index of each job's attained GPU-time
    under its prediction group's run-time distribution, learnt online like the predictions, with
    the same warm-up; the queue is ordered by the same index); ``"priority"`` = only for strictly
    higher priority (Philly jobs all have one priority unless ``short_first`` sets them, so then
    nothing is preempted). ``baseline`` (default)
    also replays FIFO first-fit without estimates and adds ``fifo_*`` figures and the ratios
    ``delay_ratio_vs_fifo`` / ``utilisation_ratio_vs_fifo``.
    """
    if oracle or short_first:
        durations = "oracle"
    if durations not in DURATIONS:
        raise ConfigurationError(f"durations {durations!r} is not one of {', '.join(DURATIONS)}; "
                                 "e.g. --durations predicted")
    trace = load_philly_jobs(
        jobs_csv, start=window[0], end=window[1], clusters=clusters, max_gpus=nodes * gpus_per_node
    )
    if not trace:
        among = f" of clusters {','.join(sorted(clusters))}" if clusters else ""
        raise TraceError(
            jobs_csv, f"has no jobs{among} in the window {window[0]} – {window[1]} (end exclusive)",
            "pick --start/--end inside the trace's time span, or other --clusters",
        )
    fleet = uniform_fleet(nodes, gpus_per_node, "P100")
    plain = trace_jobs(trace, span_over=gpus_per_node)
    jobs = with_expected_durations(plain) if durations == "oracle" else plain
    if short_first:
        jobs = [
            replace(j, request=replace(j.request, priority=gputime_priority(j.duration_s * j.request.count)))
            for j in jobs
        ]
    mode = _preemption_mode(preemption)
    history: list[FinishedRun] = []
    if durations == "predicted" or mode == "service":
        history = _history(jobs_csv, window[0], history_days, clusters, nodes * gpus_per_node, gpus_per_node)
    wall, cpu = time.perf_counter(), time.process_time()
    result = simulate(
        jobs,
        fleet,
        Policy.configured(policy_name, policy_parts, where="--policy-parts"),
        policy_name=policy_name,
        max_pending=max_pending,
        head_of_line=head_of_line,
        replan_budget_ms=replan_ms,
        progress=progress,
        predict_durations=DurationModel() if durations == "predicted" else None,
        duration_history=history,
        preemption=SimPreemption(mode) if mode != "off" else None,
    )
    summary = summarize(result)
    summary["wait_mean_s"] = _wait_mean(result, plain)
    prediction = summary.pop("durations", None)
    preempted = summary.pop("preemption", None)
    if preempted is not None:
        preempted = {**preempted, **_lost_share(preempted, plain)}
    summary.update(
        wall_s=round(time.perf_counter() - wall, 1),
        cpu_s=round(time.process_time() - cpu, 1),
        trace=jobs_csv.name,
        window=list(window),
        clusters=sorted(clusters) if clusters else None,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        jobs=len(jobs),
        durations=durations,
        prediction=prediction,
        history_days=history_days if history else None,
        oracle_durations=durations == "oracle",
        preemption="off" if mode == "off" else "on",
        preemption_mode=mode,
        preemption_report=preempted,
        short_first=short_first,
        head_of_line=head_of_line,
        max_pending=max_pending,
        replan_ms=replan_ms,
        **({"policy_parts": policy_parts} if policy_parts else {}),
    )
    summary["mean_delay_s"] = summary["queue_delay_mean_s"]
    if baseline:
        same = policy_name == BASELINE_POLICY and durations == "none" and not (head_of_line or replan_ms
                                                                                or mode != "off")
        summary.update(_fifo_of(summary) if same else _fifo(plain, fleet, max_pending, progress))
        fifo_delay, fifo_util = summary["fifo_mean_delay_s"], summary["fifo_utilisation_pct"]
        summary["delay_ratio_vs_fifo"] = _ratio(summary["mean_delay_s"], fifo_delay)
        summary["utilisation_ratio_vs_fifo"] = _ratio(summary["utilisation_pct"], fifo_util)
        summary["wait_ratio_vs_fifo"] = _ratio(summary["wait_mean_s"], summary["fifo_wait_mean_s"])
    return summary


def _preemption_mode(value: bool | str) -> str:
    """``--preemption``: on / True = ``service``; off / False = ``off``; or a mode's name."""
    if isinstance(value, bool):
        return "service" if value else "off"
    mode = {"on": "service"}.get(str(value).strip().lower(), str(value).strip().lower())
    if mode not in ("off", "priority", "service"):
        raise ConfigurationError(f"--preemption {value!r} is not one of on, off, priority, service; "
                                 "e.g. --preemption on")
    return mode


def _fifo(jobs: list[SimJob], fleet: Any, max_pending: int, progress: bool) -> dict[str, Any]:
    """The FIFO first-fit baseline (no run-time estimates) on the same jobs and fleet."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = simulate(jobs, fleet, Policy.named(BASELINE_POLICY), policy_name=BASELINE_POLICY,
                      max_pending=max_pending, progress=progress)
    base = summarize(result)
    base["wait_mean_s"] = _wait_mean(result, jobs)
    base.update(wall_s=round(time.perf_counter() - wall, 1), cpu_s=round(time.process_time() - cpu, 1))
    return _fifo_of(base)


def _fifo_of(run: dict[str, Any]) -> dict[str, Any]:
    """The baseline figures of a run that is itself FIFO first-fit without estimates."""
    return {
        "fifo_policy": BASELINE_POLICY,
        "fifo_mean_delay_s": run["queue_delay_mean_s"],
        "fifo_wait_mean_s": run["wait_mean_s"],
        "fifo_queue_delay_p50_s": run["queue_delay_p50_s"],
        "fifo_queue_delay_p95_s": run["queue_delay_p95_s"],
        "fifo_jct_mean_h": run["jct_mean_h"],
        "fifo_utilisation_pct": run["utilisation_pct"],
        "fifo_wall_s": run["wall_s"],
        "fifo_cpu_s": run["cpu_s"],
    }


def _wait_mean(result: Any, jobs: list[SimJob]) -> float:
    """Mean over finished jobs of JCT − trace run time: all the time a job did not make progress
    (its first wait, the waits after each preemption and the work it lost and ran again). Without
    preemption it equals the queueing delay; with it, the queueing delay (to the FIRST start)
    hides the later waits, so this is the figure to compare a preemptive schedule by."""
    run = {j.key: j.duration_s for j in jobs}
    waits = [r.end_s - r.arrival_s - run[r.key] for r in result.records if math.isfinite(r.end_s)]
    return round(sum(waits) / len(waits), 3) if waits else math.nan


def _lost_share(report: dict[str, Any], jobs: list[SimJob]) -> dict[str, float]:
    """``submitted_gpu_hours`` (run time × GPUs of every job of the window, its whole run) and
    ``lost_gpu_pct_of_submitted``: the work preemption threw away (``lost_gpu_hours``, since each
    victim's last checkpoint) as a percentage of it."""
    submitted = sum(j.duration_s * j.request.count * j.request.milli_per_gpu / MILLI for j in jobs) / 3600
    lost = float(report.get("lost_gpu_hours", 0.0))
    return {"submitted_gpu_hours": round(submitted, 1),
            "lost_gpu_pct_of_submitted": round(100 * lost / submitted, 3) if submitted > 0 else math.nan}


def _ratio(value: float, base: float) -> float:
    if not (math.isfinite(value) and math.isfinite(base)) or base <= 0:
        return math.nan
    return round(value / base, 3)


def _history(
    jobs_csv: Path, start: str, days: float, clusters: frozenset[str] | None, max_gpus: int, span_over: int
) -> list[FinishedRun]:
    """The runs of the ``days`` before ``start`` that had ended by then (oldest end first)."""
    if days <= 0:
        return []
    text = start.strip()
    begin = datetime.strptime(text, "%Y-%m-%d %H:%M:%S" if " " in text else "%Y-%m-%d") - timedelta(days=days)
    before = load_philly_jobs(jobs_csv, start=begin.strftime("%Y-%m-%d %H:%M:%S"), end=start,
                              clusters=clusters, max_gpus=max_gpus, origin=start)
    ended = [j for j in trace_jobs(before, span_over=span_over) if j.arrival_s + j.duration_s <= 0]
    ended.sort(key=lambda j: j.arrival_s + j.duration_s)
    return [FinishedRun.of(j.request, j.job_type or "", j.duration_s) for j in ended]


def gputime_priority(gpu_seconds: float) -> int:
    """Priority 10–90 from a job's GPU-time: 90 under 2 GPU-minutes, 8 points less per doubling.

    Quasi-shortest-service-first (Helios, SC '21) expressed through ``GPURequest.priority``;
    stays below the critical level, so it never triggers reservations.
    """
    doublings = max(0.0, math.log2(max(gpu_seconds, 1.0) / 120.0))
    return max(10, 90 - 8 * math.floor(doublings))
