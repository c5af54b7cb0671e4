"""Trace jobs as simulator jobs: one place for each trace's conventions.

:func:`trace_jobs` turns Gavel/Philly rows into :class:`~gpusched.sim.engine.SimJob` (whole-GPU
requests, gangs above one node); :func:`load_any_trace` detects a trace file's kind by its header.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from gpusched.errors import TraceError
from gpusched.request import GPURequest, Interconnect
from gpusched.sim.engine import SimJob
from gpusched.sim.openb import pod_request
from gpusched.sim.tracefile import header
from gpusched.sim.traces import (
    TraceJob,
    load_gavel_jobs,
    load_openb_lifetimes,
    load_openb_pods,
    load_philly_jobs,
)

__all__ = ["WEEK_S", "load_any_trace", "trace_jobs"]

WEEK_S = 7 * 86400
_MONDAY = 4 * 86400  # 1970-01-05 00:00 UTC: the sim clock's first Monday (as gpusched.quota.usage)


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


def load_any_trace(path: Path, *, utc_weeks: bool = False) -> list[SimJob]:
    """A trace file of any supported kind, detected by its header.

    Gavel job lists (``arrival_time_s``), Philly (``timestamp,duration,num_gpus``) and openb pod
    lists with ``creation_time``/``deletion_time`` (GPU pods replayed with their lifetimes).
    Arrivals count from the first job; with ``utc_weeks`` they are on a clock a whole number of
    weeks from UTC instead, so the simulator's Mondays 00:00 UTC (where budget periods start, as
    in the executor) are the trace's: Philly's from its dates; a trace without dates (Gavel,
    openb) starts on a Monday 00:00 UTC.

    Raises:
        TraceError: a missing, unreadable, empty or unknown file, or a bad row (file, line, field).
    """
    columns = header(path)
    if not columns:
        raise TraceError(path, "is empty", "give a trace file with a header line and jobs")
    if "arrival_time_s" in columns:
        return _shifted(trace_jobs(load_gavel_jobs(path)), _MONDAY if utc_weeks else 0.0)
    if {"timestamp", "duration", "num_gpus"} <= set(columns):
        if not utc_weeks:
            return trace_jobs(load_philly_jobs(path))
        dated = trace_jobs(load_philly_jobs(path, origin="1970-01-05"))  # seconds from a Monday
        first = min((j.arrival_s for j in dated), default=0.0)
        return _shifted(dated, _MONDAY - (first // WEEK_S) * WEEK_S)
    if {"num_gpu", "gpu_milli", "creation_time", "deletion_time"} <= set(columns):
        times = load_openb_lifetimes(path)
        return _shifted([
            SimJob(p.name, pod_request(p), times[p.name][0], max(1.0, times[p.name][1] - times[p.name][0]))
            for p in load_openb_pods(path)
            if p.num_gpu > 0
        ], _MONDAY if utc_weeks else 0.0)
    raise TraceError(
        path, f"has an unknown trace layout (header {[c[:30] for c in columns[:6]]})",
        "give a Gavel job CSV, philly_jobs.csv or an openb pod list with creation/deletion times",
    )


def _shifted(jobs: list[SimJob], by: float) -> list[SimJob]:
    from dataclasses import replace

    return [replace(j, arrival_s=j.arrival_s + by) for j in jobs] if by else jobs
