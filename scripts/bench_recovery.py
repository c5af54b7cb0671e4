#!/usr/bin/env python
"""Fault-recovery benchmark: time from an injected Xid 79 to the retried task running on a healthy GPU.

    .venv/bin/python scripts/bench_recovery.py [--trials 5] [--agent-interval 2] [--executor-tick 1]
                                              [--retry-delay 0] [--out results/recovery/recovery.json]

Each trial runs in a fresh AIRFLOW_HOME (temporary folder) with the simulated default fleet, a
real SQLite ledger, a real ``gpusched agent`` process and real task processes; the executor's
placement decision (``gpusched.airflow.gpu_cycle.decide``) places both tries. The baseline runs the
same scenario without the agent and the fault chain (Airflow's plain retry). Scenario details:
``gpusched.bench.recovery.py``. Airflow's own scheduler latency is not included (see
docs/benchmarks.md, "Fault recovery").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm


def _trial(with_chain: bool, args: argparse.Namespace) -> dict[str, object]:
    from gpusched.bench.recovery import run_trial

    with tempfile.TemporaryDirectory(prefix="gpusched-bench-") as home:
        os.environ["AIRFLOW_HOME"] = home
        os.environ.pop("GPUSCHED_DB_URL", None)
        trial = run_trial(with_chain=with_chain, agent_interval_s=args.agent_interval,
                          executor_tick_s=args.executor_tick, retry_delay_s=args.retry_delay)
    return trial.to_dict()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--agent-interval", type=float, default=2.0, help="gpusched agent --interval")
    parser.add_argument("--executor-tick", type=float, default=1.0, help="executor heartbeat (s)")
    parser.add_argument("--retry-delay", type=float, default=0.0, help="the DAG's retry_delay (s)")
    parser.add_argument("--out", type=Path, default=None, help="write all trials as JSON here")
    args = parser.parse_args()
    results: dict[str, list[dict[str, object]]] = {"gpusched": [], "baseline": []}
    for _ in tqdm(range(args.trials), desc="fault-recovery trials", file=sys.stderr):
        results["gpusched"].append(_trial(True, args))
        results["baseline"].append(_trial(False, args))
    chain, base = results["gpusched"], results["baseline"]
    recovered = [float(t["recovered_s"]) for t in chain if t["recovered_s"] is not None]  # type: ignore[arg-type]
    cordoned = [float(t["cordoned_s"]) for t in chain if t["cordoned_s"] is not None]  # type: ignore[arg-type]
    base_ok = sum(1 for t in base if t["retry_device_healthy"])
    base_same = sum(1 for t in base if t["retry_device"] == t["faulty_device"])
    summary = {
        "trials": args.trials,
        "agent_interval_s": args.agent_interval, "executor_tick_s": args.executor_tick,
        "retry_delay_s": args.retry_delay,
        "gpusched_recovered": f"{len(recovered)}/{len(chain)}",
        "gpusched_fault_to_running_s": {
            "median": statistics.median(recovered) if recovered else None,
            "max": max(recovered) if recovered else None,
        },
        "gpusched_fault_to_cordon_s_median": statistics.median(cordoned) if cordoned else None,
        "cordoned_by": sorted({str(t["cordoned_by"]) for t in chain}),
        "baseline_retry_on_healthy_gpu": f"{base_ok}/{len(base)}",
        "baseline_retry_on_faulty_gpu": f"{base_same}/{len(base)}",
    }
    print(json.dumps(summary, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"summary": summary, "trials": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
