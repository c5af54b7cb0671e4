"""``gpusched bench openb-bound``: the packing bounds of an openb pod list, per seed, no policy run.

    gpusched bench openb-bound [--pods openb/openb_pod_list_default.csv] [--nodes …gpu_node.csv]
                               [--seeds 10] [--seed-offset 0] [--factor 1.3] [--no-host]
                               [--json] [--out results/openb/bounds/<list>.json]

Per seed the same arrivals as ``gpusched bench openb`` (:func:`gpusched.sim.openb.openb_bounds`):
``unallocated_gpu_pct_bound`` (GPU capacity only, any placement; equal to that command's field
of the same name) and ``unallocated_gpu_pct_bound_host`` (host CPU and memory counted too, for the
placements that hold every arrived CPU-only task; :mod:`gpusched.sim.packing_bound`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from gpusched.commands.args import comma_list, finite_float, int_range, policy_name
from gpusched.commands.bench import emit
from gpusched.sim.openb import openb_bounds, run_openb
from gpusched.sim.traces import default_trace_dir, load_openb_nodes, load_openb_pods

__all__ = ["register_bench"]


def register_bench(bench_subparsers: Any) -> None:
    """Add ``openb-bound`` under ``gpusched bench``."""
    traces = default_trace_dir() / "openb"
    parser = bench_subparsers.add_parser(
        "openb-bound", help="the GPU-only and the CPU/memory-aware packing bounds of an openb pod list")
    parser.add_argument("--pods", type=Path, default=traces / "openb_pod_list_default.csv",
                        help="openb pod list (default openb/openb_pod_list_default.csv under the traces)")
    parser.add_argument("--nodes", type=Path, default=traces / "openb_node_list_gpu_node.csv",
                        help="openb node list (default openb/openb_node_list_gpu_node.csv under the traces)")
    parser.add_argument("--seeds", type=int_range(1, 1000), default=10, help="seeds 0..N-1 (default 10)")
    parser.add_argument("--seed-offset", type=int_range(0), default=0, help="first seed (default 0)")
    parser.add_argument("--factor", type=finite_float(0.0, 100.0, strict_min=True), default=1.3,
                        help="workload tuning factor (default 1.3, as bench openb)")
    parser.add_argument("--no-host", action="store_true", help="the GPU-only bound only (fast)")
    parser.add_argument("--check", type=comma_list, default=[], metavar="POLICY,...",
                        help="also run these policies (bench openb's run) and record per seed the "
                             "CPU-only tasks each failed among the bounds' arrivals "
                             "(cpu_tasks_failed; the CPU/mem bound covers the runs where it is 0)")
    parser.add_argument("--json", action="store_true", help="print the full result as JSON")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--quiet", action="store_true", help="no per-seed lines on stderr")
    parser.set_defaults(func=_main)


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def _main(args: argparse.Namespace) -> int:
    pods, nodes = load_openb_pods(args.pods), load_openb_nodes(args.nodes)
    seeds = list(range(args.seed_offset, args.seed_offset + args.seeds))
    checks = sorted(policy_name(p) for p in args.check)
    rows = []
    for seed in seeds:
        start = time.process_time()
        row = openb_bounds(pods, nodes, seed, factor=args.factor, host=not args.no_host)
        row["cpu_seconds"] = round(time.process_time() - start, 2)
        for policy in checks:
            run = run_openb(pods, nodes, policy, seed, factor=args.factor)
            row.setdefault("failed", {})[policy] = run.cpu_tasks_failed
        rows.append(row)
        if not args.quiet:
            print(f"{args.pods.stem} seed {seed}: bound {row['unallocated_bound_pct']} %, "
                  f"host {row.get('unallocated_host_bound_pct')} % ({row['cpu_seconds']} s CPU)",
                  file=sys.stderr)
    gpu = [r["unallocated_bound_pct"] for r in rows]
    host = [r["unallocated_host_bound_pct"] for r in rows if "unallocated_host_bound_pct" in r]
    result: dict[str, Any] = {
        "pods": args.pods.name,
        "seeds": seeds,
        "factor": args.factor,
        "unallocated_gpu_pct_bound_median": _median(gpu),
        "unallocated_gpu_pct_bound_host_median": _median(host),
        "unallocated_gpu_pct_bound": gpu,
        "unallocated_gpu_pct_bound_host": host or None,
        "arrivals": [r["arrivals"] for r in rows],
        "cpu_tasks": [r["cpu_tasks"] for r in rows],
        "cpu_seconds": [r["cpu_seconds"] for r in rows],
        "bound": "GPU capacity per model only: any placement of the arrivals up to the last reading",
        "bound_host": "also host CPU per node and memory per node group: any such placement that "
                      "holds every arrived CPU-only task (gpusched.sim.packing_bound)",
    }
    if checks:  # per policy and seed: CPU-only tasks failed among the bounds' arrivals
        result["cpu_tasks_failed"] = {p: [r["failed"][p] for r in rows] for p in checks}
    return emit(args, result, f"{args.pods.stem}: bound {result['unallocated_gpu_pct_bound_median']} %, "
                              f"host {result['unallocated_gpu_pct_bound_host_median']} % "
                              f"(median of {len(seeds)} seeds)")
