"""Genetic-optimiser benchmark: the batch optimiser's latency, objective gain and replay gain.

    gpusched bench genetic [--nodes 1000] [--pending 64] [--runs 30] [--budget-ms 100]
                           [--replay-nodes 48] [--replay-jobs 400] [--json] [--out FILE]

Three measurements, all in one run:

1. **Latency**: ``optimise`` on a synthetic fleet of ``--nodes`` hosts with ``--pending`` tasks,
   ``--runs`` times (a new task batch each run); p50/p99 of the optimiser's own wall-clock and
   CPU milliseconds (the greedy plan is passed in, as the scheduler has it already) and of
   greedy ``place``. The budget is wall clock: on a loaded machine the GA runs fewer
   generations; the setup (candidates, first population) is not interruptible.
2. **Objective gain**: (greedy − optimised) / greedy of α·latency + β·fragmentation + γ·energy.
3. **Replay gain**: a synthetic arrival stream replayed on a smaller fleet with a scheduling
   round every ``--round-s`` seconds, once with greedy plans and once with greedy + optimiser;
   mean JCT (wait + runtime on the chosen model), mean/p95 wait and energy, as ratios.
   This synthetic replay is the benchmark's own, built on the same ``place`` / ``optimise``;
   trace replays through the simulator engine use ``gpusched bench gavel|philly --replan-ms``.
"""

from __future__ import annotations

import heapq
import statistics
import sys
import time
from dataclasses import replace
from typing import Any

from gpusched.catalog import default_catalog
from gpusched.extras import lab_module
from gpusched.model import DeviceShare
from gpusched.placement import PendingTask, PlacementRequest, Policy, place
from gpusched.placement.genetic import optimise, optimise_with_report
from gpusched.quota.policy import QuotaState
from gpusched.testing import synthetic_fleet, synthetic_requests

__all__ = ["measure", "replay", "run"]


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    pos = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[pos]


def run(
    nodes: int, pending: int, runs: int, *, budget_ms: float = 100.0, policy_name: str = "gpusched",
    seed: int = 0, progress: bool = True, weights: tuple[float, float, float] = (1.0, 1.0, 0.1),
) -> dict[str, Any]:
    """Latency and objective gain over ``runs`` batches (see the module docstring)."""

    fleet = synthetic_fleet(nodes, seed=seed)
    policy = Policy.named(policy_name)
    now = 100_000.0
    opt_ms: list[float] = []
    opt_cpu_ms: list[float] = []
    greedy_ms: list[float] = []
    gains: list[float] = []
    gens: list[int] = []
    deltas: list[list[float]] = [[], [], []]  # greedy − optimised: latency h, fragmentation GPUs, energy kWh
    improved = 0
    iterator: Any = range(runs)
    if progress:
        iterator = lab_module("tqdm").tqdm(iterator, desc="optimise runs", file=sys.stderr)
    # One warm-up call: imports deap and builds the fleet index, like a long-running scheduler.
    warm = synthetic_requests(pending, seed=10_000, start=now - 3600)
    unlimited = QuotaState.unlimited()
    optimise_with_report(
        PlacementRequest(pending=warm, snapshot=fleet, policy=policy, now=now, quota=unlimited),
        budget_ms=budget_ms,
    )
    for i in iterator:
        batch = synthetic_requests(pending, seed=seed + i, start=now - 3600)
        request = PlacementRequest(pending=batch, snapshot=fleet, policy=policy, now=now, quota=unlimited)
        began = time.perf_counter()
        greedy = place(request)
        greedy_ms.append((time.perf_counter() - began) * 1000)
        cpu = time.thread_time()
        # greedy with seed 0, the search with seed i
        result = optimise_with_report(
            replace(request, seed=i), budget_ms=budget_ms, greedy=greedy, weights=weights
        )
        opt_cpu_ms.append((time.thread_time() - cpu) * 1000)
        opt_ms.append(result.elapsed_ms)
        gains.append(result.gain_pct)
        for k in range(3):
            deltas[k].append(result.greedy_terms[k] - result.terms[k])
        gens.append(result.generations)
        improved += result.improved
    return {
        "nodes": nodes, "pending": pending, "runs": runs, "budget_ms": budget_ms, "policy": policy_name,
        "optimiser_ms_p50": _pct(opt_ms, 50), "optimiser_ms_p99": _pct(opt_ms, 99),
        "optimiser_ms_max": max(opt_ms),
        "optimiser_cpu_ms_p50": _pct(opt_cpu_ms, 50), "optimiser_cpu_ms_p99": _pct(opt_cpu_ms, 99),
        "greedy_ms_p50": _pct(greedy_ms, 50), "greedy_ms_p99": _pct(greedy_ms, 99),
        "objective_gain_pct_mean": statistics.fmean(gains), "objective_gain_pct_median": _pct(gains, 50),
        "objective_gain_pct_max": max(gains), "improved_runs": improved,
        "generations_median": _pct([float(g) for g in gens], 50),
        "mean_saving_per_batch": {
            "latency_h": statistics.fmean(deltas[0]), "fragmentation_gpus": statistics.fmean(deltas[1]),
            "energy_kwh": statistics.fmean(deltas[2]),
        },
    }


def replay(
    nodes: int, jobs: int, *, optimiser: bool, round_s: float = 300.0, budget_ms: float = 100.0,
    policy_name: str = "gpusched", seed: int = 0, load: float = 0.9, progress: bool = True,
    weights: tuple[float, float, float] = (1.0, 1.0, 0.1),
) -> dict[str, Any]:
    """Replay a synthetic stream with greedy (``optimiser=False``) or greedy + optimiser plans."""
    import random

    catalog = default_catalog()
    fleet = synthetic_fleet(nodes, seed=seed, used_fraction=0.0)
    policy = Policy.named(policy_name)
    rng = random.Random(seed)
    raw = synthetic_requests(jobs, seed=seed)
    capacity = fleet.total_devices()
    mean_work = statistics.fmean(
        t.request.count * t.request.milli_per_gpu / 1000 * t.request.expected_duration_s for t in raw
    )
    gap = mean_work / (load * capacity)  # mean inter-arrival for the target load (A100-equivalent)
    clock, stream = 0.0, []
    for task in raw:
        clock += rng.expovariate(1.0 / gap)
        stream.append(PendingTask(task.key, task.request, clock, task.job_type))
    speed = {m.name: m.a100_equiv_milli / 1000 for m in catalog.models}
    tdp = {m.name: m.tdp_milliwatts / 1e6 for m in catalog.models}
    snapshot = fleet
    pending: dict[str, PendingTask] = {}
    ends: list[tuple[float, str, tuple[DeviceShare, ...]]] = []
    waits, jcts, energy = [], [], 0.0
    nxt, now, rounds = 0, 0.0, 0
    bar = None
    if progress:
        label = "optimiser" if optimiser else "greedy"
        bar = lab_module("tqdm").tqdm(total=len(stream), desc=f"replay {label}", file=sys.stderr)
    while nxt < len(stream) or pending or ends:
        now += round_s
        freed: list[DeviceShare] = []
        while ends and ends[0][0] <= now:
            freed.extend(heapq.heappop(ends)[2])
        if freed:
            snapshot = snapshot.with_usage(freed, release=True)
        while nxt < len(stream) and stream[nxt].submitted_at <= now:
            pending[stream[nxt].key] = stream[nxt]
            nxt += 1
            if bar is not None:
                bar.update(1)
        if not pending:
            continue
        batch = list(pending.values())[:64]
        request = PlacementRequest(pending=batch, snapshot=snapshot, policy=policy, now=now,
                                   quota=QuotaState.unlimited(), seed=rounds)
        plan = place(request)
        if optimiser and len(batch) > 1:
            plan = optimise(request, greedy=plan, budget_ms=budget_ms, weights=weights)
        rounds += 1
        taken: list[DeviceShare] = []
        for a in plan.assignments:
            task = pending.pop(a.key)
            models = [snapshot.device(s.uuid).model for s in a.shares]
            run_s = task.request.expected_duration_s / min(speed.get(m, 1.0) for m in models)
            heapq.heappush(ends, (now + run_s, a.key, a.shares))
            taken.extend(a.shares)
            waits.append(now - task.submitted_at)
            jcts.append(now - task.submitted_at + run_s)
            power = sum(tdp.get(m, 0.3) * s.milli / 1000 for m, s in zip(models, a.shares, strict=True))
            energy += power * run_s / 3600
        for r in plan.rejections:
            if r.permanent:
                pending.pop(r.key)
        snapshot = snapshot.with_usage(taken)
    if bar is not None:
        bar.close()
    return {"jobs_started": len(jcts), "rounds": rounds, "mean_jct_s": statistics.fmean(jcts),
            "mean_wait_s": statistics.fmean(waits), "p95_wait_s": _pct(waits, 95), "energy_kwh": energy}


def measure(
    nodes: int, pending: int, runs: int, *, replay_nodes: int, replay_jobs: int, round_s: float,
    budget_ms: float, policy_name: str, seed: int, weights: tuple[float, float, float],
    progress: bool = True,
) -> dict[str, Any]:
    """All three measurements in one dict: :func:`run`, then :func:`replay` greedy vs optimiser."""
    result = run(nodes, pending, runs, budget_ms=budget_ms, policy_name=policy_name,
                 seed=seed, progress=progress, weights=weights)
    result["weights"] = list(weights)
    base, ga = (
        replay(replay_nodes, replay_jobs, optimiser=flag, round_s=round_s,
               budget_ms=budget_ms, policy_name=policy_name, seed=seed, progress=progress,
               weights=weights)
        for flag in (False, True)
    )
    result["replay"] = {
        "nodes": replay_nodes, "jobs": replay_jobs, "round_s": round_s,
        "engine": "bench-local synthetic replay on place/optimise (traces: bench gavel|philly --replan-ms)",
        "greedy": base, "optimiser": ga,
        "jct_ratio": ga["mean_jct_s"] / base["mean_jct_s"],
        "wait_ratio": ga["mean_wait_s"] / base["mean_wait_s"] if base["mean_wait_s"] else None,
        "energy_ratio": ga["energy_kwh"] / base["energy_kwh"],
    }
    return result
