"""``gpusched bench openb|gavel|philly|latency|report``: the trace benchmarks (docs/benchmarks.md).

Modules ``gpusched/commands/bench_<name>.py`` that define ``register_bench(subparsers)`` are
added as further ``gpusched bench <name>`` sub-commands.

Every sub-command prints a JSON object with ``--json`` (a one-line summary otherwise) and can
write it to ``--out``. Traces default to ``../shared/traces`` beside the repository (or
``$GPUSCHED_TRACES``). Progress bars go to stderr.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import pkgutil
import sys
from pathlib import Path
from typing import Any

import gpusched.commands as commands_pkg
from gpusched.bench import report
from gpusched.bench.latency import run_latency
from gpusched.commands.args import (
    POLICY_PARTS_HELP,
    comma_list,
    finite_float,
    int_range,
    policy_help,
    policy_name,
)
from gpusched.errors import ConfigurationError
from gpusched.sim.openb import run_openb_seeds
from gpusched.sim.traces import default_trace_dir, load_openb_nodes, load_openb_pods

__all__ = ["emit", "register"]


def register(subparsers: Any) -> None:
    """Add ``bench`` and its sub-commands."""

    traces = default_trace_dir()
    parser = subparsers.add_parser("bench", help="run a trace benchmark of the placement policies")
    sub = parser.add_subparsers(dest="bench", required=True, metavar="BENCH")

    op = sub.add_parser("openb", help="FGD packing experiment on an openb pod list")
    op.add_argument("--pods", type=Path, default=traces / "openb" / "openb_pod_list_default.csv",
                    help="openb pod list (default openb/openb_pod_list_default.csv under the traces)")
    op.add_argument("--nodes", type=Path, default=traces / "openb" / "openb_node_list_gpu_node.csv",
                    help="openb node list (default openb/openb_node_list_gpu_node.csv under the traces)")
    op.add_argument("--policy", type=policy_name, default="gpusched", help=policy_help())
    op.add_argument("--seeds", type=int_range(1, 1000), default=10,
                    help="run seeds 0..N-1 (default 10, as published)")
    op.add_argument("--seed-offset", type=int_range(0), default=0, help="first seed (default 0)")
    op.add_argument("--factor", type=finite_float(0.0, 100.0, strict_min=True), default=1.3,
                    help="workload tuning factor (default 1.3, as published)")
    _common(op)
    op.set_defaults(func=_openb)

    gv = sub.add_parser("gavel", help="Gavel continuous-single JCT on 36 V100 + 36 P100 + 36 K80")
    gv.add_argument("--rate", type=finite_float(0.0, strict_min=True), default=2.0,
                    help="jobs/hour, picks the stream file (files exist for 2.0 and 4.0; default 2.0)")
    gv.add_argument("--jobs", type=Path, default=None, help="job CSV (default: the rate's n15000 stream)")
    gv.add_argument("--throughputs", type=Path, default=traces / "gavel" / "simulation_throughputs.json",
                    help="Gavel's measured throughput table (default gavel/simulation_throughputs.json)")
    gv.add_argument("--policy", type=_gavel_policy, default="gpusched",
                    help=policy_help() + "; or gavel-fifo: a replay of Gavel's own FIFO baseline's "
                         "round mechanics, to calibrate against its published figures (not a policy)")
    gv.add_argument("--policy-parts", default="", help=POLICY_PARTS_HELP)
    gv.add_argument("--gpus-per-server", type=int_range(1, 36), default=4,
                    help="GPUs per server, a divisor of 36 (default 4)")
    gv.add_argument("--round", type=finite_float(0.0), default=360.0, dest="round_s",
                    help="scheduling round in seconds (default 360, Gavel's)")
    gv.add_argument("--measure", type=_id_range, default=(4000, 4999),
                    help="job-id range LO-HI whose JCT is averaged (default 4000-4999)")
    gv.add_argument("--replan-ms", type=finite_float(0.0), default=0.0,
                    help="re-plan each scheduling pass with the genetic optimiser within this "
                         "budget in ms, as the executor's [gpusched] replan_budget_ms (default 0 = greedy)")
    gv.add_argument("--horizon", choices=("round", "age"), default="round",
                    help="with --preemption migrate: over what time a move must pay its restart: one "
                         "round (default), or at least the job's attained run time (age)")
    gv.add_argument("--stream-seed", type=int_range(0), default=None,
                    help="replay Gavel's generator for this seed at --rate instead of a file "
                         "(seed 0 = the shared streams; others: data nothing was tuned on)")
    gv.add_argument("--fifo-ablation", choices=("none", "no-oversubscription", "update-every-round", "both"),
                    default="none",
                    help="with --policy gavel-fifo: switch off one of the replayed mechanics of Gavel's "
                         "FIFO (over-subscription of the last type; allocation updates at most every "
                         "1,920 s) to see what it contributes (default none)")
    gv.add_argument("--per-type", type=int_range(1, 1000), default=36,
                    help="GPUs of each type, a multiple of --gpus-per-server (default 36, Gavel's)")
    gv.add_argument("--preemption", choices=("off", "service", "migrate"), default="off",
                    help="migrate: at each round a running job may be checkpointed and restarted on "
                         "another GPU type when that gains more than the restart cost "
                         "(gpusched.placement.migration); service: the executors' mode service (queue "
                         "and victims by the Gittins index of attained service); default off "
                         "(non-preemptive)")
    gv.add_argument("--durations", choices=("none", "predicted", "oracle"), default="none",
                    help="what the scheduler knows of run times: none (default), predicted (learnt "
                         "online from the jobs finished so far, by job type, as the executor does) "
                         "or oracle (the true ones)")
    gv.add_argument("--restart-seconds", type=finite_float(0.0), default=60.0, dest="restart_s",
                    help="with --preemption migrate: seconds one move costs (checkpoint + restore; "
                         "default 60; Gavel's simulator charges 0)")
    _common(gv)
    gv.set_defaults(func=_gavel, traces=traces)

    ph = sub.add_parser("philly", help="Philly queueing delay and utilisation")
    ph.add_argument("--jobs", type=Path, default=traces / "philly" / "philly_jobs.csv",
                    help="philly_jobs.csv (default philly/philly_jobs.csv under the traces)")
    ph.add_argument("--policy", type=policy_name, default="gpusched", help=policy_help())
    ph.add_argument("--policy-parts", default="", help=POLICY_PARTS_HELP)
    ph.add_argument("--nodes", type=int_range(1, 100_000), default=50, help="P100 nodes (default 50)")
    ph.add_argument("--gpus-per-node", type=int_range(1, 128), default=8, help="GPUs per node (default 8)")
    ph.add_argument("--clusters", type=comma_list, default=None, metavar="VC,...",
                    help="keep only these virtual clusters (the trace's cluster column; default all)")
    ph.add_argument("--start", default=None, help="window start YYYY-MM-DD (default 2017-10-09)")
    ph.add_argument("--end", default=None, help="window end, exclusive (default 2017-10-16)")
    ph.add_argument("--durations", choices=("none", "predicted", "oracle"), default=None,
                    help="what the scheduler knows of run times: none (default), predicted (learnt "
                         "online from the jobs finished so far, as the executor does) or oracle "
                         "(the true ones)")
    ph.add_argument("--oracle", action="store_true", help="same as --durations oracle")
    ph.add_argument("--history-days", type=finite_float(0.0, 3650.0), default=30.0,
                    help="with --durations predicted: learn first from the jobs of this many days "
                         "before the window that ended by its start (default 30, as the executor's "
                         "[gpusched] duration_history_days; 0 = start cold)")
    ph.add_argument("--preemption", choices=("on", "off", "service", "priority"), default="off",
                    help="let the simulator preempt running jobs: on = service (by expected remaining "
                         "service: Gittins index of attained GPU-time, queue ordered by it), priority "
                         "(strictly higher priority only), off (default)")
    ph.add_argument("--no-baseline", action="store_true",
                    help="skip the FIFO first-fit replay (and the ratios against it)")
    ph.add_argument(
        "--short-first",
        action="store_true",
        help="priorities from true GPU-time (shortest first, implies --oracle)",
    )
    ph.add_argument(
        "--head-of-line",
        action="store_true",
        help="strict FIFO queue: nothing starts past the first job left waiting",
    )
    ph.add_argument("--max-pending", type=int_range(1), default=256,
                    help="waiting jobs offered to one placement call (default 256)")
    ph.add_argument("--replan-ms", type=finite_float(0.0), default=0.0,
                    help="re-plan each scheduling pass with the genetic optimiser within this "
                         "budget in ms, as the executor's [gpusched] replan_budget_ms (default 0 = greedy)")
    _common(ph)
    ph.set_defaults(func=_philly)

    lt = sub.add_parser("latency", help="decision latency of one greedy placement")
    lt.add_argument("--nodes", type=int_range(1, 100_000), default=1000,
                    help="fleet size in nodes (default 1000)")
    lt.add_argument("--gpus-per-node", type=int_range(1, 128), default=8, help="GPUs per node (default 8)")
    lt.add_argument("--policy", type=policy_name, default="gpusched", help=policy_help())
    lt.add_argument("--samples", type=int_range(1, 100_000), default=200,
                    help="placements timed per fleet size (default 200)")
    lt.add_argument("--busy", type=finite_float(0.0, 1.0), default=0.4,
                    help="fraction of devices already taken, 0–1 (default 0.4)")
    lt.add_argument("--sweep", action="store_true", help="also 100, 2000, 5000 and 10000 nodes")
    lt.add_argument("--resident", action="store_true",
                    help="keep one placement engine per fleet alive between decisions and update it "
                         "incrementally (as a scheduler loop does) instead of building it per call")
    _common(lt)
    lt.set_defaults(func=_latency)

    rp = sub.add_parser("report", help="markdown tables and PNG plots from results/*/ JSON files")
    rp.add_argument("--results", type=Path, default=Path("results"),
                    help="folder with openb/, gavel/, philly/, latency/ JSON (default results)")
    rp.add_argument("--traces", type=Path, default=traces, help="trace folder for the published figures")
    rp.set_defaults(func=_report)

    # Other areas add their benchmarks as gpusched/commands/bench_<name>.py with register_bench(sub).

    for info in pkgutil.iter_modules(commands_pkg.__path__):
        if info.name.startswith("bench_"):
            try:
                module = importlib.import_module(f"gpusched.commands.{info.name}")
            except ImportError as exc:  # one broken add-on must not take the trace benchmarks down
                print(f"gpusched bench: skipping {info.name} ({exc})", file=sys.stderr)
                continue
            hook = getattr(module, "register_bench", None)
            if hook is not None:
                hook(sub)


def _id_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    if not (lo.strip().isdigit() and hi.strip().isdigit()) or int(lo) > int(hi) or len(text) > 40:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a job-id range LO-HI such as 4000-4999")
    return int(lo), int(hi)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the full result as JSON")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def emit(args: argparse.Namespace, result: dict[str, Any], headline: str) -> int:
    """Print ``result`` (JSON with ``--json``, else ``headline``) and write ``--out``."""
    data = _clean(result)
    text = json.dumps(data, indent=2, sort_keys=False)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n", encoding="utf-8")
    print(text if args.json else headline)
    return 0


def _openb(args: argparse.Namespace) -> int:
    seeds = list(range(args.seed_offset, args.seed_offset + args.seeds))
    result = run_openb_seeds(
        load_openb_pods(args.pods),
        load_openb_nodes(args.nodes),
        args.policy,
        seeds,
        factor=args.factor,
        progress=not args.quiet,
    )
    result["pods"] = args.pods.name
    return emit(
        args,
        result,
        f"{args.pods.stem} {args.policy}: unallocated GPU "
        f"{result['unallocated_gpu_pct_median']} % (median of {len(seeds)} seeds)",
    )


def _gavel_policy(text: str) -> str:
    """A policy preset, or ``gavel-fifo`` (the calibration replay of Gavel's FIFO)."""

    return "gavel-fifo" if text.strip().lower() == "gavel-fifo" else policy_name(text)


def _gavel(args: argparse.Namespace) -> int:
    # local: the harness reaches the ledger (sqlalchemy) via the simulator; not at `gpusched --help`
    from gpusched.bench.gavel import run_gavel

    jobs = (
        args.jobs or args.traces / "gavel" / f"gavel_continuous_single_rate{args.rate:.1f}_seed0_n15000.csv"
    )
    lo, hi = args.measure
    result = run_gavel(
        jobs,
        args.policy,
        throughputs=args.throughputs,
        measure=(lo, hi + 1),
        gpus_per_server=args.gpus_per_server,
        round_s=args.round_s,
        replan_ms=args.replan_ms,
        policy_parts=args.policy_parts,
        progress=not args.quiet,
        per_type=args.per_type,
        preemption=args.preemption,
        restart_s=args.restart_s,
        horizon=args.horizon,
        fifo_ablation=args.fifo_ablation,
        durations=args.durations,
        stream=None if args.stream_seed is None else (args.rate, args.stream_seed),
    )
    result["rate_jobs_per_h"] = args.rate
    return emit(args, result, f"gavel {args.rate} jobs/h {args.policy}: mean JCT {result['jct_mean_h']} h")


def _philly(args: argparse.Namespace) -> int:
    # local: the harness reaches the ledger (sqlalchemy) via the simulator; not at `gpusched --help`
    from gpusched.bench.philly import PHILLY_WINDOW, run_philly

    window = (args.start or PHILLY_WINDOW[0], args.end or PHILLY_WINDOW[1])
    if args.oracle and args.durations not in (None, "oracle"):
        raise ConfigurationError(f"--oracle contradicts --durations {args.durations}; give one of them")
    result = run_philly(
        args.jobs,
        args.policy,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        window=window,
        clusters=args.clusters,
        durations=args.durations or ("oracle" if args.oracle else "none"),
        history_days=args.history_days,
        preemption=args.preemption,
        baseline=not args.no_baseline,
        short_first=args.short_first,
        head_of_line=args.head_of_line,
        max_pending=args.max_pending,
        replan_ms=args.replan_ms,
        progress=not args.quiet,
        policy_parts=args.policy_parts,
    )
    return emit(
        args,
        result,
        f"philly {args.policy} (durations {result['durations']}): mean delay "
        f"{result['queue_delay_mean_s']} s ({result.get('delay_ratio_vs_fifo', 'n/a')}× FIFO), "
        f"utilisation {result['utilisation_pct']} %",
    )


def _latency(args: argparse.Namespace) -> int:
    sizes = [args.nodes]
    if args.sweep:
        sizes += [n for n in (100, 2000, 5000, 10000) if n != args.nodes]
    result = run_latency(
        sizes,
        policy_name=args.policy,
        gpus_per_node=args.gpus_per_node,
        samples=args.samples,
        busy=args.busy,
        resident=args.resident,
        progress=not args.quiet,
    )
    if not args.json and len(result["sweep"]) > 1:  # a sweep: one row per size, the first as headline
        for row in result["sweep"][1:]:
            print(f"latency {row['nodes']} nodes: p50 {row['p50_ms']} ms, p99 {row['p99_ms']} ms "
                  f"(CPU {row['cpu_p50_ms']} / {row['cpu_p99_ms']} ms)", file=sys.stderr)
    first = result["sweep"][0]
    return emit(
        args, result, f"latency {args.nodes} nodes: p50 {result['p50_ms']} ms, p99 {result['p99_ms']} ms "
                      f"(CPU {first['cpu_p50_ms']} / {first['cpu_p99_ms']} ms)"
    )


def _report(args: argparse.Namespace) -> int:
    root: Path = args.results
    made = []
    if (root / "openb").is_dir():
        made.append(
            report.openb_report(root / "openb", args.traces / "openb" / "fgd_published_unallocated_pct.tsv")
        )
    if (root / "gavel").is_dir():
        made.append(report.gavel_report(root / "gavel", args.traces / "gavel" / "continuous_jobs_seed0.tsv"))
    if (root / "philly").is_dir():
        made.append(report.philly_report(root / "philly"))
    if (root / "latency").is_dir():
        made.append(report.latency_report(root / "latency"))
    if not made:
        raise ConfigurationError(
            f"no benchmark results under {root} (expected openb/, gavel/, philly/ or latency/ folders of "
            "JSON); run scripts/sim_benchmarks.sh first or pass --results"
        )
    print("\n".join(made))
    return 0
