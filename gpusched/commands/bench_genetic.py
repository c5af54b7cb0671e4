"""``gpusched bench genetic``: argument parsing; the benchmark is :mod:`gpusched.bench.genetic`.

    gpusched bench genetic [--nodes 1000] [--pending 64] [--runs 30] [--budget-ms 100]
                           [--replay-nodes 48] [--replay-jobs 400] [--json] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from gpusched.bench.genetic import measure
from gpusched.commands.args import finite_float, int_range, policy_help, policy_name
from gpusched.placement.genetic import parse_weights

__all__ = ["register_bench"]


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int_range(1, 100_000), default=1000,
                        help="synthetic fleet size in nodes for the latency runs (default 1000)")
    parser.add_argument("--pending", type=int_range(1, 10_000), default=64,
                        help="pending tasks in one batch (default 64)")
    parser.add_argument("--runs", type=int_range(1, 10_000), default=30, help="timed batches (default 30)")
    parser.add_argument("--budget-ms", type=finite_float(0.0, 600_000.0, strict_min=True), default=100.0,
                        help="optimiser time budget per batch, ms (default 100)")
    parser.add_argument("--policy", type=policy_name, default="gpusched", help=policy_help("greedy policy"))
    parser.add_argument("--replay-nodes", type=int_range(1, 100_000), default=48,
                        help="fleet size in nodes for the trace replay (default 48)")
    parser.add_argument("--replay-jobs", type=int_range(1, 1_000_000), default=400,
                        help="jobs replayed (default 400)")
    parser.add_argument("--round-s", type=finite_float(0.0, strict_min=True), default=300.0,
                        help="scheduling round of the replay, s (default 300)")
    parser.add_argument("--seed", type=int_range(0), default=0, help="seed (default 0)")
    parser.add_argument("--weights", default="1,1,0.1", help="α,β,γ: latency, fragmentation, energy")
    parser.add_argument("--json", action="store_true", help="print the full result as JSON")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.set_defaults(func=_main)


def register_bench(bench_subparsers: Any) -> None:
    """Add ``genetic`` under ``gpusched bench``."""
    _add_arguments(bench_subparsers.add_parser("genetic", help="DEAP batch optimiser vs greedy"))


def _main(args: argparse.Namespace) -> int:
    w3 = parse_weights(args.weights, where="--weights")
    result = measure(args.nodes, args.pending, args.runs, replay_nodes=args.replay_nodes,
                     replay_jobs=args.replay_jobs, round_s=args.round_s, budget_ms=args.budget_ms,
                     policy_name=args.policy, seed=args.seed, weights=w3, progress=not args.quiet)
    text = json.dumps(result, indent=2)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n", encoding="utf-8")
    print(text if args.json else (
        f"optimiser p50 {result['optimiser_ms_p50']:.1f} ms, p99 {result['optimiser_ms_p99']:.1f} ms; "
        f"objective gain {result['objective_gain_pct_mean']:.2f} %; replay JCT ratio "
        f"{result['replay']['jct_ratio']:.3f}"))
    return 0
