"""Decision-latency benchmark: wall-clock and CPU time of one greedy placement per fleet size."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from gpusched.model import FleetSnapshot
from gpusched.placement import PendingTask, PlacementRequest, Placer, Policy, place
from gpusched.quota.policy import QuotaState
from gpusched.sim.metrics import percentile
from gpusched.testing import synthetic_fleet, synthetic_requests

__all__ = ["run_latency"]


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
    aggregates are recomputed), so every request sees the same fleet. The stream is decided
    twice on the same engine: the first pass fills the engine's per-node caches as request
    shapes first appear (``cold_cpu_p50_ms``, ``cold_cpu_p99_ms``, ``cold_cpu_max_ms``), the
    second is the steady state of a scheduler that has seen these shapes before and gives the
    main figures (``p50_ms``…). The release is timed beside the decision
    (``release_p50_ms``/``release_p99_ms``, second pass).

    The fleet is :func:`gpusched.testing.synthetic_fleet` (mixed models and
    topology) with about ``busy`` of the devices taken; the requests are
    :func:`~gpusched.testing.synthetic_requests` (fractions, 1–8 GPUs, some
    16-GPU rack gangs), one per call. Returns wall-clock p50/p99 in ms per size (the first size's
    figures also at the top level) and the same in CPU time of this process (``cpu_p50_ms``,
    ``cpu_p99_ms``), which a busy shared machine does not inflate.
    """

    policy = Policy.named(policy_name)
    requests = synthetic_requests(samples, seed=seed)
    sweep = []
    for n in nodes:
        fleet = synthetic_fleet(n, gpus_per_node, seed, used_fraction=busy)
        place(_request(requests[:1], fleet, policy, 0.0))  # warm the per-fleet index cache
        placer = Placer(fleet, policy) if resident else None
        if placer is not None:
            # build the aggregates once
            placer.place(_request(requests[:1], fleet, policy, 0.0), commit=False)
        cold: list[float] = []
        if placer is not None:
            cold = _decide(placer, fleet, policy, requests)[1]
        times, cpu, release = _decide(placer, fleet, policy, requests)
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
        if cold:
            row["cold_cpu_p50_ms"] = round(statistics.median(cold), 4)
            row["cold_cpu_p99_ms"] = round(percentile(cold, 99), 4)
            row["cold_cpu_max_ms"] = round(max(cold), 4)
        if release:
            row["release_p50_ms"] = round(statistics.median(release), 4)
            row["release_p99_ms"] = round(percentile(release, 99), 4)
        sweep.append(row)
        if progress:  # progress only: the caller prints the figures once
            print(f"latency: {n} nodes measured ({samples} samples)", file=sys.stderr)
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


def _decide(
    placer: Placer | None, fleet: FleetSnapshot, policy: Policy, requests: Sequence[PendingTask]
) -> tuple[list[float], list[float], list[float]]:
    """One decision per request: (wall ms, CPU ms, release wall ms) each. On a resident
    ``placer`` each assignment is committed, then released again after the timing."""
    times: list[float] = []
    cpu: list[float] = []
    release: list[float] = []
    for i, task in enumerate(requests):
        decision = _request((task,), fleet, policy, task.submitted_at, i)
        start = time.perf_counter()
        cpu_start = time.process_time()
        if placer is None:
            place(decision)
        else:
            plan = placer.place(decision)
        cpu.append((time.process_time() - cpu_start) * 1000)
        times.append((time.perf_counter() - start) * 1000)
        if placer is not None:
            start = time.perf_counter()
            for a in plan.assignments:
                placer.release(a.shares)
            release.append((time.perf_counter() - start) * 1000)
    return times, cpu, release


def _request(
    tasks: Sequence[PendingTask], fleet: FleetSnapshot, policy: Policy, now: float, seed: int = 0
) -> PlacementRequest:
    """One decision's input: ``tasks`` on ``fleet``, no quota (the benchmark times placement)."""
    return PlacementRequest(
        pending=tasks, snapshot=fleet, policy=policy, now=now, quota=QuotaState.unlimited(), seed=seed
    )
