"""Benchmark runners on the real traces: Gavel JCT, Philly queueing, decision latency, generic replay.

Each runner returns a JSON-safe dict; :mod:`gpusched.commands.bench` prints it and
:mod:`gpusched.sim.report` turns it into tables and plots. Trace conversion into
:class:`~gpusched.sim.engine.SimJob` lives here too (one place for each trace's conventions).
"""

from __future__ import annotations

import ast
import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from gpusched.errors import TraceError
from gpusched.placement import Policy, place
from gpusched.request import GPURequest, Interconnect
from gpusched.sim.engine import SimJob, simulate, with_expected_durations
from gpusched.sim.fleets import gavel_fleet, uniform_fleet
from gpusched.sim.metrics import percentile, summarize
from gpusched.sim.tracefile import header
from gpusched.sim.traces import (
    GAVEL_MODELS,
    TraceJob,
    load_gavel_jobs,
    load_gavel_throughputs,
    load_openb_lifetimes,
    load_openb_pods,
    load_philly_jobs,
)

__all__ = [
    "PHILLY_WINDOW",
    "gavel_policy",
    "gputime_priority",
    "load_any_trace",
    "run_gavel",
    "run_latency",
    "run_philly",
    "trace_jobs",
]

PHILLY_WINDOW = ("2017-10-09", "2017-10-16")
"""Default Philly window: one busy October week (12,3k jobs) — see docs/benchmarks.md."""


def trace_jobs(jobs: Sequence[TraceJob], *, span_over: int = 8) -> list[SimJob]:
    """Whole-GPU requests for trace jobs: one node up to ``span_over`` GPUs, a gang across nodes above."""
    out = []
    for j in jobs:
        wide = j.num_gpus > span_over
        request = GPURequest(
            count=j.num_gpus,
            gang=j.num_gpus > 1,
            interconnect=Interconnect.ANY if wide else Interconnect.SAME_NODE,
            tenant=_tenant(j.group),
        )
        out.append(SimJob(j.key, request, j.arrival_s, j.duration_s, dict(j.durations), j.job_type or None))
    return out


def _tenant(group: str) -> str:
    text = "".join(ch for ch in group.lower() if ch.isalnum() or ch in "_.-")[:63]
    return text or "default"


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


def run_latency(
    nodes: Sequence[int],
    *,
    policy_name: str = "gpusched",
    gpus_per_node: int = 8,
    samples: int = 200,
    busy: float = 0.4,
    seed: int = 0,
    resident: bool = False,
    progress: bool = False,
) -> dict[str, Any]:
    """Wall-clock latency of one :func:`place` call for one pending request, per fleet size.

    With ``resident`` the index and free-capacity state live in one
    :class:`~gpusched.placement.Placer` per fleet, kept between decisions: each decision commits
    its assignment, which is then released again (both incremental: only the touched nodes'
    aggregates are recomputed), so every request sees the same fleet. The decision is timed
    (``p50_ms``…); the release beside it (``release_p50_ms``/``release_p99_ms``).

    The fleet is :func:`gpusched.placement.synthetic.synthetic_fleet` (mixed models and
    topology) with about ``busy`` of the devices taken; the requests are
    :func:`~gpusched.placement.synthetic.synthetic_requests` (fractions, 1–8 GPUs, some
    16-GPU rack gangs), one per call. Returns wall-clock p50/p99 in ms per size (the first size's
    figures also at the top level) and the same in CPU time of this process (``cpu_p50_ms``,
    ``cpu_p99_ms``), which a busy shared machine does not inflate.
    """
    from gpusched.placement import Placer
    from gpusched.placement.synthetic import synthetic_fleet, synthetic_requests

    policy = Policy.named(policy_name)
    requests = synthetic_requests(samples, seed=seed)
    sweep = []
    for n in nodes:
        fleet = synthetic_fleet(n, gpus_per_node, seed, used_fraction=busy)
        place(requests[:1], fleet, policy, now=0.0)  # warm the per-fleet index cache
        placer = Placer(fleet, policy) if resident else None
        if placer is not None:
            placer.place(requests[:1], now=0.0, commit=False)  # build the aggregates once
        times = []
        cpu = []
        release: list[float] = []
        for i, task in enumerate(requests):
            start = time.perf_counter()
            cpu_start = time.process_time()
            if placer is None:
                place([task], fleet, policy, now=task.submitted_at, seed=i)
            else:
                plan = placer.place([task], now=task.submitted_at, seed=i)
            cpu.append((time.process_time() - cpu_start) * 1000)
            times.append((time.perf_counter() - start) * 1000)
            if placer is not None:
                start = time.perf_counter()
                for a in plan.assignments:
                    placer.release(a.shares)
                release.append((time.perf_counter() - start) * 1000)
        row = {
            "nodes": n,
            "gpus": n * gpus_per_node,
            "samples": samples,
            "p50_ms": round(statistics.median(times), 4),
            "p99_ms": round(percentile(times, 99), 4),
            "mean_ms": round(statistics.fmean(times), 4),
            "max_ms": round(max(times), 4),
            "cpu_p50_ms": round(statistics.median(cpu), 4),
            "cpu_p99_ms": round(percentile(cpu, 99), 4),
        }
        if release:
            row["release_p50_ms"] = round(statistics.median(release), 4)
            row["release_p99_ms"] = round(percentile(release, 99), 4)
        sweep.append(row)
        if progress:
            print(f"latency {n} nodes: p50 {row['p50_ms']} ms, p99 {row['p99_ms']} ms", file=sys.stderr)
    first = sweep[0]
    return {
        "policy": policy_name,
        "resident": resident,
        "busy_fraction": busy,
        "gpus_per_node": gpus_per_node,
        "nodes": first["nodes"],
        "p50_ms": first["p50_ms"],
        "p99_ms": first["p99_ms"],
        "sweep": sweep,
    }


def load_any_trace(path: Path) -> list[SimJob]:
    """A trace file of any supported kind, detected by its header.

    Gavel job lists (``arrival_time_s``), Philly (``timestamp,duration,num_gpus``) and openb pod
    lists with ``creation_time``/``deletion_time`` (GPU pods replayed with their lifetimes).

    Raises:
        TraceError: a missing, unreadable, empty or unknown file, or a bad row (file, line, field).
    """
    columns = header(path)
    if not columns:
        raise TraceError(path, "is empty", "give a trace file with a header line and jobs")
    if "arrival_time_s" in columns:
        return trace_jobs(load_gavel_jobs(path))
    if {"timestamp", "duration", "num_gpus"} <= set(columns):
        return trace_jobs(load_philly_jobs(path))
    if {"num_gpu", "gpu_milli", "creation_time", "deletion_time"} <= set(columns):
        from gpusched.sim.openb import pod_request

        times = load_openb_lifetimes(path)
        return [
            SimJob(p.name, pod_request(p), times[p.name][0], max(1.0, times[p.name][1] - times[p.name][0]))
            for p in load_openb_pods(path)
            if p.num_gpu > 0
        ]
    raise TraceError(
        path, f"has an unknown trace layout (header {[c[:30] for c in columns[:6]]})",
        "give a Gavel job CSV, philly_jobs.csv or an openb pod list with creation/deletion times",
    )
