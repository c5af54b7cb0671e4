"""``gpusched simulate --trace FILE --fleet FLEET --policy NAME [--quotas FILE [--over-budget finish|stop]]
[--preemption MODE]``.

Replays a trace.

Prints the metrics.

``--trace``: a Gavel job CSV, ``philly_jobs.csv`` or an openb pod list (GPU pods replayed with
their creation/deletion times). ``--fleet``: ``gavel``, ``uniform:NODESxGPUS[:MODEL]``, an openb
node CSV or a fleet YAML. Devices may be shared by fractional requests on any model, as in the
traces.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from gpusched import settings
from gpusched.commands.args import POLICY_PARTS_HELP, finite_float, int_range, policy_help, policy_name
from gpusched.commands.bench import emit
from gpusched.durations import DurationModel
from gpusched.errors import TraceError
from gpusched.placement import Policy
from gpusched.quota.file import read_quota_policy
from gpusched.quota.policy import OVER_BUDGET_ACTIONS
from gpusched.sim.fleets import fleet_from_spec
from gpusched.sim.metrics import summarize
from gpusched.sim.overbudget import SimOverBudget
from gpusched.sim.preempt import SimPreemption

__all__ = ["register"]


def register(subparsers: Any) -> None:
    """Add ``simulate``."""

    parser = subparsers.add_parser(
        "simulate", help="replay a job trace on a fleet with a policy",
        description="Replay a job trace on a fleet through the placement engine and print the metrics.",
    )
    parser.add_argument("--trace", type=Path, required=True,
                        help="a Gavel job CSV, philly_jobs.csv, or an openb pod list with "
                             "creation/deletion times")
    parser.add_argument("--fleet", required=True,
                        help="gavel[:GPUS_PER_SERVER] | uniform:NODESxGPUS[:MODEL] | openb node CSV | "
                             "fleet YAML")
    parser.add_argument("--policy", type=policy_name, default="gpusched", help=policy_help())
    parser.add_argument("--policy-parts", default="", help=POLICY_PARTS_HELP)
    parser.add_argument("--round", type=finite_float(0.0), default=0.0, dest="round_s",
                        help="scheduling round length in seconds (default 0 = after every event)")
    parser.add_argument("--limit", type=int_range(1), default=None,
                        help="replay only the first N jobs by arrival (default all)")
    parser.add_argument("--max-pending", type=int_range(1), default=256,
                        help="waiting jobs offered to one placement call (default 256)")
    parser.add_argument("--seed", type=int_range(0), default=0,
                        help="base seed for the random policy (default 0)")
    parser.add_argument("--quotas", type=Path, default=None,
                        help="a quota file (shares, borrowing, budgets, period_s) to place with, as "
                             "the executor does; the JSON then reports each tenant's budget and use. "
                             "Budget periods start on Mondays 00:00 UTC of the trace's dates (a trace "
                             "without dates starts on a Monday)")
    parser.add_argument("--over-budget", choices=OVER_BUDGET_ACTIONS, default=settings.default("over_budget"),
                        help="with --quotas, running work whose tenant crosses its hard budget, as the "
                             "executor's [gpusched] over_budget: finish (let it run) or stop (stop it at "
                             "the executor's next check, every reconcile_seconds, and requeue it for the "
                             "next period, losing the work since its last checkpoint); default "
                             f"{settings.default('over_budget')}")
    parser.add_argument("--durations", choices=("none", "predicted", "oracle"), default="none",
                        help="run times the scheduler knows: none (default), predicted (the executor's "
                             "predictor, learnt online from the jobs finished so far) or oracle")
    parser.add_argument("--preemption", choices=("off", "priority", "partitions", "service", "migrate"),
                        default="off",
                        help="stop running jobs for more urgent waiting ones with the executor's victim "
                             "selection: priority (strictly lower priority), partitions (also capacity "
                             "borrowed from a reclaiming partition), service (by expected remaining "
                             "service: the Gittins index of attained GPU-time; queue ordered by it); or "
                             "migrate (move running jobs to faster GPU types when that gains more than "
                             "--restart-seconds); default off")
    parser.add_argument("--restart-seconds", type=finite_float(0.0), default=60.0, dest="restart_s",
                        help="with --preemption migrate: seconds one move costs (checkpoint + restore; "
                             "default 60)")
    parser.add_argument("--checkpoint-minutes", type=finite_float(0.0), default=30.0,
                        help="with --preemption: jobs checkpoint every N minutes of run time and a "
                             "preempted job loses the work since its last one (0 = no checkpoints; "
                             "default 30)")
    parser.add_argument("--min-runtime", type=finite_float(0.0), default=300.0, dest="min_runtime_s",
                        help="with --preemption: seconds a job runs before it may be preempted (default 300)")
    parser.add_argument("--grace", type=finite_float(0.0), default=None, dest="grace_s",
                        help="with --preemption: seconds a victim runs after its notice before it is "
                             "stopped (default: [gpusched] preemption_grace_seconds' default, 30)")
    parser.add_argument("--json", action="store_true", help="print the full metrics as JSON")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON to this file")
    parser.add_argument("--quiet", action="store_true", help="no progress bar on stderr")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    # local: the engine reaches the ledger (sqlalchemy) via scheduler.store; not at `gpusched --help`
    from gpusched.sim.engine import simulate, with_expected_durations
    from gpusched.sim.jobs import load_any_trace

    jobs = load_any_trace(args.trace, utc_weeks=args.quotas is not None)
    if not jobs:
        raise TraceError(args.trace, "has no jobs to replay", "give a trace with at least one GPU job")
    if args.limit is not None:
        jobs = sorted(jobs, key=lambda j: j.arrival_s)[: args.limit]
    if args.durations == "oracle":
        jobs = with_expected_durations(jobs)
    policy = Policy.configured(args.policy, args.policy_parts, where="--policy-parts",
                               fractions_need_partitioning=False)
    quota = None
    if args.quotas is not None:
        quota = read_quota_policy(args.quotas)

    preemption = None if args.preemption == "off" else SimPreemption(
        args.preemption, checkpoint_s=args.checkpoint_minutes * 60, min_runtime_s=args.min_runtime_s,
        restart_s=args.restart_s, horizon_s=args.round_s or 360.0,
        **({} if args.grace_s is None else {"grace_s": args.grace_s}))
    result = simulate(
        jobs,
        fleet_from_spec(args.fleet),
        policy,
        policy_name=args.policy,
        round_s=args.round_s,
        seed=args.seed,
        max_pending=args.max_pending,
        progress=not args.quiet,
        quota=quota,
        predict_durations=DurationModel() if args.durations == "predicted" else None,
        preemption=preemption,
        over_budget=SimOverBudget(args.over_budget),
    )
    summary = summarize(result)
    prediction = summary.pop("durations", None)
    summary.update(trace=args.trace.name, fleet=args.fleet, durations=args.durations, prediction=prediction)
    return emit(
        args,
        summary,
        f"{args.policy}: utilisation {summary['utilisation_pct']} %, "
        f"mean delay {summary['queue_delay_mean_s']} s, mean JCT {summary['jct_mean_h']} h",
    )
