"""Gavel benchmark: continuous-single job completion time on 36 V100 + 36 P100 + 36 K80.

Returns a JSON-safe dict; :mod:`gpusched.commands.bench` prints it and :mod:`gpusched.bench.report`
turns it into tables and plots.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from gpusched.bench.gavel_rounds import RESET_S, RoundJob, gavel_fifo_replay
from gpusched.bench.gavel_stream import gavel_stream
from gpusched.durations import DurationModel
from gpusched.errors import ConfigurationError, TraceError
from gpusched.placement import Policy
from gpusched.placement.migration import DEFAULT_RESTART_S, MIGRATE
from gpusched.sim.engine import simulate, with_expected_durations
from gpusched.sim.fleets import gavel_fleet
from gpusched.sim.jobs import trace_jobs
from gpusched.sim.metrics import summarize
from gpusched.sim.preempt import SimPreemption
from gpusched.sim.traces import GAVEL_MODELS, TraceJob, load_gavel_jobs, load_gavel_throughputs
from gpusched.throughputs import load_throughputs

__all__ = ["DURATIONS", "FIFO_ABLATIONS", "GAVEL_FIFO", "PREEMPTION", "gavel_policy", "run_gavel"]

GAVEL_FIFO = "gavel-fifo"
"""Calibration replay of Gavel's own FIFO baseline (:mod:`gpusched.bench.gavel_rounds`), not a policy."""

DURATIONS = ("none", "predicted", "oracle")
"""What the scheduler is told of run times (``--durations``), as ``bench philly``."""

PREEMPTION = ("off", "service", MIGRATE)
"""``--preemption``: non-preemptive, the executors' mode ``service``, or migration between types."""

FIFO_ABLATIONS = ("none", "no-oversubscription", "update-every-round", "both")
"""Which of the replay's mechanics to switch off, to show what each contributes."""


def gavel_policy(name: str, throughputs: Path | None, parts: str = "") -> Policy:
    """The preset changed by ``parts`` (``--policy-parts``, the ``[gpusched] policy_parts`` syntax);
    ``gpusched`` also gets Gavel's measured throughput table (job type → model → steps/s), read by
    the executor's reader of ``[gpusched] throughput_file`` (:mod:`gpusched.throughputs`)."""
    if name != "gpusched" or throughputs is None:
        return Policy.configured(name, parts, where="--policy-parts")
    return Policy.configured(name, parts, where="--policy-parts", throughput=load_throughputs(throughputs))


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
    per_type: int = 36,
    preemption: str = "off",
    restart_s: float = DEFAULT_RESTART_S,
    stream: tuple[float, int] | None = None,
    horizon: str = "round",
    fifo_ablation: str = "none",
    policy_parts: str = "",
    durations: str = "none",
) -> dict[str, Any]:
    """Gavel's continuous-single experiment on ``per_type`` GPUs of each type.

    Returns the metrics with JCT averaged over job ids ``measure[0]`` … ``measure[1] - 1``,
    ``jct_bound_h`` (the mean JCT if each of them ran alone on its fastest type from its arrival:
    a floor for every policy) and ``cpu_s`` (process CPU time of the replay). ``replan_ms`` > 0
    re-plans every pass with the genetic optimiser (see :func:`~gpusched.sim.engine.simulate`).
    ``preemption="migrate"`` runs the migration rule (:mod:`gpusched.placement.migration`) after
    every pass with restart cost ``restart_s`` and one round as its horizon (``horizon="age"``: at
    least each job's attained run time); ``preemption="service"`` runs the executors' mode
    ``service`` (queue and victims by the Gittins index of attained service, its run-time
    distributions learnt from the jobs finished so far by job type;
    :class:`~gpusched.sim.preempt.SimPreemption`); ``"off"``: non-preemptive.
    ``durations`` (one of :data:`DURATIONS`) is what the scheduler knows of run times: nothing,
    the executors' predictor learning online from the jobs finished so far by job type, or the
    true ones (oracle).
    ``policy_name="gavel-fifo"`` replays Gavel's own FIFO baseline instead
    (:mod:`gpusched.bench.gavel_rounds`; ``fifo_ablation`` switches off one of its mechanics:
    one of :data:`FIFO_ABLATIONS`). ``stream=(rate, seed)`` replays Gavel's generator for that
    seed (15,000 jobs, :mod:`gpusched.bench.gavel_stream`, run times from ``throughputs``)
    instead of ``jobs_csv``.
    """
    if preemption not in PREEMPTION:
        raise ConfigurationError(f"gavel preemption {preemption!r} is not one of {', '.join(PREEMPTION)}; "
                                 "trace jobs share one priority, so mode priority never applies")
    if durations not in DURATIONS:
        raise ConfigurationError(f"durations {durations!r} is not one of {', '.join(DURATIONS)}; "
                                 "e.g. --durations predicted")
    if stream is not None:
        if throughputs is None:
            raise ConfigurationError("a generated Gavel stream needs the throughput table; "
                                     "pass --throughputs")
        trace = gavel_stream(stream[0], stream[1], 15_000, throughputs)
    else:
        trace = load_gavel_jobs(jobs_csv)
    keys = {str(k) for k in range(*measure)} & {j.key for j in trace}
    if not keys:
        raise TraceError(
            jobs_csv, f"has no job ids {measure[0]}–{measure[1] - 1} to measure",
            "pick a --measure range of job ids inside the trace",
        )
    bound = _jct_bound_h(trace, keys)
    if policy_name == GAVEL_FIFO:
        if throughputs is None:
            raise ConfigurationError("gavel-fifo needs the throughput table; pass --throughputs")
        if fifo_ablation not in FIFO_ABLATIONS:
            raise ConfigurationError(f"gavel-fifo ablation {fifo_ablation!r} is not one of "
                                     f"{', '.join(FIFO_ABLATIONS)}")
        summary = _gavel_fifo(trace, keys, throughputs, per_type, round_s or 360.0,
                              0 if stream is None else stream[1], progress, fifo_ablation)
        name = jobs_csv.name if stream is None else f"gavel stream rate {stream[0]} seed {stream[1]}"
        summary.update(trace=name, measured_jobs=f"{measure[0]}-{measure[1] - 1}", round_s=round_s or 360.0,
                       gpus_per_type=per_type, jct_bound_h=bound)
        return summary
    plain = trace_jobs(trace)
    jobs = with_expected_durations(plain) if durations == "oracle" else plain
    fleet = gavel_fleet(per_type=per_type, gpus_per_server=gpus_per_server)
    moves = None
    if preemption == MIGRATE:
        moves = SimPreemption(MIGRATE, restart_s=restart_s, horizon_s=round_s or 360.0, min_runtime_s=0.0,
                              by_age=horizon == "age")
    elif preemption == "service":
        moves = SimPreemption("service")
    cpu = time.process_time()
    result = simulate(
        jobs,
        fleet,
        gavel_policy(policy_name, throughputs, policy_parts),
        policy_name=policy_name,
        round_s=round_s,
        max_pending=fleet.total_devices(),
        stop_after=keys,
        replan_budget_ms=replan_ms,
        progress=progress,
        preemption=moves,
        predict_durations=DurationModel() if durations == "predicted" else None,
    )
    cpu = time.process_time() - cpu
    summary = summarize(result, measure=keys)
    prediction = summary.pop("durations", None)
    by_model: dict[str, int] = {}
    for rec in result.records:
        if rec.key in keys:
            by_model[rec.models[0]] = by_model.get(rec.models[0], 0) + 1
    summary.update(
        trace=jobs_csv.name if stream is None else f"gavel stream rate {stream[0]} seed {stream[1]}",
        measured_jobs=f"{measure[0]}-{measure[1] - 1}",
        round_s=round_s,
        gpus_per_server=gpus_per_server,
        gpus_per_type=per_type,
        measured_by_model=by_model,
        replan_ms=replan_ms,
        durations=durations,
        prediction=prediction,
        jct_bound_h=bound,
        cpu_s=round(cpu, 1),
    )
    return summary


def _jct_bound_h(trace: list[TraceJob], keys: set[str]) -> float:
    """Mean JCT, in hours, if every measured job ran alone on its fastest GPU type at arrival: no
    schedule of whole GPUs does better."""
    fastest = [min(j.durations.values(), default=j.duration_s) for j in trace if j.key in keys]
    return round(sum(fastest) / len(fastest) / 3600.0, 4)


def _gavel_fifo(trace: list[TraceJob], keys: set[str], throughputs: Path, per_type: int, round_s: float,
                seed: int, progress: bool, ablation: str) -> dict[str, Any]:
    """Gavel's base-mode FIFO on ``trace`` (its RNG seeded with the stream seed, as Gavel's sweeps do)."""
    table = load_gavel_throughputs(throughputs)
    jobs = []
    for j in trace:
        name = str((j.job_type, j.num_gpus))
        try:
            speed = {short: table[short][name] for short in GAVEL_MODELS}
        except KeyError:
            raise TraceError(throughputs, f"has no single-GPU throughput of {j.job_type!r} on every type",
                             "use Gavel's simulation_throughputs.json") from None
        if j.num_gpus != 1:
            raise ConfigurationError(f"gavel-fifo replays single-GPU streams; job {j.key} asks for "
                                     f"{j.num_gpus} GPUs")
        steps = j.durations[GAVEL_MODELS["v100"]] * speed["v100"]
        jobs.append(RoundJob(j.key, j.arrival_s, steps, speed))

    def show(now: float, left: int) -> None:
        print(f"  gavel-fifo t={now / 3600:.0f} h, {left} measured jobs left", flush=True)

    cpu = time.process_time()
    out = gavel_fifo_replay(jobs, dict.fromkeys(GAVEL_MODELS, per_type), stop_after=keys, round_s=round_s,
                            seed=seed, progress=show if progress else None,
                            oversubscribe=ablation not in ("no-oversubscription", "both"),
                            reset_s=0.0 if ablation in ("update-every-round", "both") else RESET_S)
    cpu = time.process_time() - cpu
    arrival = {j.key: j.arrival_s for j in jobs}
    jct = [out.finished[k] - arrival[k] for k in keys]
    by_type: dict[str, int] = {}
    for k in keys:
        model = GAVEL_MODELS[out.bound_type[k]]
        by_type[model] = by_type.get(model, 0) + 1
    mean = sum(jct) / len(jct)
    return {
        "policy": GAVEL_FIFO,
        "jobs_finished": len(jct),
        "jct_mean_s": round(mean, 3),
        "jct_mean_h": round(mean / 3600.0, 4),
        "measured_by_model": by_type,
        "fifo_seed": seed,
        "fifo_ablation": ablation,
        "rounds": out.rounds,
        "allocation_updates": out.updates,
        "oversubscribed_updates": out.oversubscribed_updates,
        "idle_gpu_rounds_while_waiting": out.idle_worker_rounds,
        "makespan_s": round(out.end_s, 1),
        "cpu_s": round(cpu, 1),
    }
