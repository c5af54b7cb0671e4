"""``gpusched bench cycle``: argument parsing; the benchmark is :mod:`gpusched.bench.cycle`.

    gpusched bench cycle [--nodes 1000] [--sweep] [--cycles 20] [--pending 8]
                         [--json] [--out FILE] [--png FILE]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from gpusched.commands.args import finite_float, int_range
from gpusched.commands.bench import emit

__all__ = ["register_bench"]


def register_bench(bench_subparsers: Any) -> None:
    """Add ``cycle`` under ``gpusched bench``."""

    parser = bench_subparsers.add_parser(
        "cycle", help="one executor scheduling cycle (ledger read + decision): fresh vs kept engine")
    parser.add_argument("--nodes", type=int_range(1, 100_000), default=1000,
                        help="fleet size in nodes (default 1000)")
    parser.add_argument("--sweep", action="store_true", help="also 100 and 10000 nodes")
    parser.add_argument("--gpus-per-node", type=int_range(1, 128), default=8,
                        help="GPUs per node (default 8)")
    parser.add_argument("--cycles", type=int_range(1, 10_000), default=20,
                        help="cycles timed per fleet size and way (default 20)")
    parser.add_argument("--pending", type=int_range(1, 10_000), default=8,
                        help="tasks waiting in each cycle (default 8)")
    parser.add_argument("--busy", type=finite_float(0.0, 1.0), default=0.4,
                        help="fraction of each node's devices allocated, 0–1 (default 0.4)")
    parser.add_argument("--png", type=Path, default=None, help="also plot CPU time per cycle against nodes")
    parser.add_argument("--json", action="store_true", help="print the full result as JSON")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    # local: the harness loads the ledger (sqlalchemy); not at `gpusched --help`
    from gpusched.bench.cycle import cycle_png, cycle_table, run_cycle_latency

    sizes = [args.nodes] + ([n for n in (100, 10000) if n != args.nodes] if args.sweep else [])
    result = run_cycle_latency(sorted(sizes), gpus_per_node=args.gpus_per_node, cycles=args.cycles,
                               pending=args.pending, busy=args.busy, progress=not args.quiet)
    if args.png is not None:
        result["png"] = cycle_png(result, args.png).name
    return emit(args, result, cycle_table(result))
