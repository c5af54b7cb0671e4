"""``gpusched bench tenants``: argument parsing; the benchmark is :mod:`gpusched.bench.tenants`.

    gpusched bench tenants [--start 2017-10-09 --end 2017-10-16] [--nodes 50] [--budget-fraction 0.5]
                           [--durations oracle|predicted|none] [--preemption off|priority|partitions]
                           [--over-budget finish|stop]
                           [--json] [--out FILE] [--out-dir results/tenants]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from gpusched import settings
from gpusched.bench.tenants_report import tenants_png, tenants_table
from gpusched.commands.args import POLICY_PARTS_HELP, finite_float, int_range, policy_help, policy_name
from gpusched.commands.bench import emit
from gpusched.quota.policy import OVER_BUDGET_ACTIONS
from gpusched.sim.traces import default_trace_dir

__all__ = ["register_bench"]


def register_bench(bench_subparsers: Any) -> None:
    """Add ``tenants`` under ``gpusched bench``."""

    parser = bench_subparsers.add_parser(
        "tenants", help="multi-tenant Philly replay: VC budgets and 70/20/10 partitions vs no quota")
    parser.add_argument("--jobs", type=Path, default=default_trace_dir() / "philly" / "philly_jobs.csv",
                        help="philly_jobs.csv (default philly/philly_jobs.csv under the traces)")
    parser.add_argument("--start", default="2017-10-09", help="window start YYYY-MM-DD (default 2017-10-09)")
    parser.add_argument("--end", default="2017-10-16", help="window end, exclusive (default 2017-10-16)")
    parser.add_argument("--nodes", type=int_range(1, 100_000), default=50, help="P100 nodes (default 50)")
    parser.add_argument("--gpus-per-node", type=int_range(1, 128), default=8,
                        help="GPUs per node (default 8)")
    parser.add_argument("--budget-fraction", type=finite_float(0.0, 10.0, strict_min=True), default=0.5,
                        help="each VC's weekly budget = this × its submitted A100-h (default 0.5)")
    parser.add_argument("--durations", choices=("oracle", "predicted", "none"), default="oracle",
                        help="oracle: requests carry their true run time; predicted: the executor's "
                             "predictor learns them from the jobs finished so far; none: budgets charge the "
                             "quota's 1 h default per task (default oracle)")
    parser.add_argument("--preemption", choices=("off", "priority", "partitions"), default="off",
                        help="the executor's preemption in both runs; partitions = reclaim lent "
                             "capacity (default off)")
    parser.add_argument("--over-budget", choices=OVER_BUDGET_ACTIONS, default=settings.default("over_budget"),
                        help="running work of a tenant that crosses its budget, as the executor's "
                             "[gpusched] over_budget: finish (runs on) or stop (stopped at the next check "
                             f"and requeued); default {settings.default('over_budget')}")
    parser.add_argument("--policy", type=policy_name, default="gpusched", help=policy_help())
    parser.add_argument("--policy-parts", default="", help=POLICY_PARTS_HELP)
    parser.add_argument("--max-pending", type=int_range(1), default=256,
                        help="waiting jobs offered to one placement call (default 256)")
    parser.add_argument("--out-dir", type=Path, default=Path("results/tenants"),
                        help="where the quota file and the PNG go (default results/tenants)")
    parser.add_argument("--json", action="store_true", help="print the full result as JSON")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    # local: the harness reaches the ledger (sqlalchemy) via the simulator; not at `gpusched --help`
    from gpusched.bench.tenants import run_tenants

    result = run_tenants(args.jobs, window=(args.start, args.end), nodes=args.nodes,
                         gpus_per_node=args.gpus_per_node, budget_fraction=args.budget_fraction,
                         durations=args.durations, preemption=args.preemption, policy_name=args.policy,
                         policy_parts=args.policy_parts,
                         over_budget=args.over_budget,
                         max_pending=args.max_pending,
                         out_dir=args.out_dir, progress=not args.quiet)
    result["png"] = tenants_png(result, args.out_dir / f"tenants-{result['tag']}.png").name
    checks = result["checks"]
    summary = (f"{tenants_table(result)}\nbudgets hold: {checks['budgets_hold']} (worst overshoot "
               f"{checks['max_overshoot_tasks']} tasks); shares hold: {checks['shares_hold']} (worst "
               f"shortfall {checks['max_shortfall_pts']} pts); borrowed {checks['borrowed_gpu_hours']} GPU-h")
    return emit(args, result, summary)
