#!/usr/bin/env python
"""Multi-host benchmark: GPU Celery executor vs plain CeleryExecutor, and recovery from a host death.

    nice -n 10 python scripts/bench_multihost.py [--tasks 200] [--deaths 3] [--out results/multihost.json]

One local deployment (``gpusched.deploy.multihost_cluster.LocalCluster``: Redis, PostgreSQL, scheduler,
api-server, dag-processor, two GPU hosts with a Celery worker and an agent each) runs, in the same
scheduler, ``[core] executor = GPUCeleryExecutor,CeleryExecutor``:

After a warm-up run (worker pools forked, DAGs serialised), the two batches alternate
plain, GPU, GPU, plain (N/2 tasks per run) so that neither gains from running later:

1. ``bench_plain``: N short tasks on the plain CeleryExecutor, hand-routed (``queue="gpusched@host-a"``
   / ``host-b``), no GPU placement: the baseline.
2. ``bench_gpu``: the same N tasks as GPU tasks (a quarter of an A100 or of an L40S each) through the
   GPU Celery executor: placement, ledger allocation, routing to the owning host, device export.

For each: queued -> running per task (Airflow's ``queued_when`` -> ``start_date``), p50/p95, wall
time of the batch, the scheduler's CPU seconds per task, and how long each try held its Celery
worker slot (p50, and the share that ran into Airflow's supervisor stall, :data:`STALL_S`).
Then ``--deaths`` times: a long GPU task starts, its host dies as a machine does (worker, agent
and the task processes SIGKILLed), and the time until the task's retry runs on the other host is
measured; the dead host is restarted (its agent confirms the old try is gone, ending its
quarantine; re-admitted) before the next round. Then ``--deaths`` times the same with the host's
Celery worker alone killed: its agent reports the worker gone and kills the orphaned try itself.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import re
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path

from gpusched.deploy.multihost_cluster import LocalCluster
from gpusched.extras import pyplot
from gpusched.ledger import Ledger

REPO = Path(__file__).resolve().parents[2]  # gpusched/bench/ → the repository

DAGS = '''
from __future__ import annotations

import os
import time
from datetime import datetime, timedelta

from airflow.sdk import dag, get_current_context, task

from gpusched.airflow.authoring import gpu

N = int(os.environ["GPUSCHED_BENCH_TASKS"])  # per DAG run; each benchmark DAG runs twice
HALF = N // 2


@dag(dag_id="bench_plain", schedule=None, start_date=datetime(2026, 1, 1), catchup=False,
     max_active_tasks=64)
def bench_plain():
    @task(executor="CeleryExecutor", queue="gpusched@host-a")
    def on_a(i: int) -> None:
        pass

    @task(executor="CeleryExecutor", queue="gpusched@host-b")
    def on_b(i: int) -> None:
        pass

    on_a.expand(i=list(range(HALF)))
    on_b.expand(i=list(range(N - HALF)))


@dag(dag_id="bench_gpu", schedule=None, start_date=datetime(2026, 1, 1), catchup=False,
     max_active_tasks=64)
def bench_gpu():
    @task(**gpu(gpus=0.25, memory="8GiB", models=["A100-SXM-80GB"]))
    def on_a(i: int) -> None:
        pass

    @task(**gpu(gpus=0.25, memory="8GiB", models=["L40S"]))
    def on_b(i: int) -> None:
        pass

    on_a.expand(i=list(range(HALF)))
    on_b.expand(i=list(range(N - HALF)))


@dag(dag_id="bench_death", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def bench_death():
    @task(retries=3, retry_delay=timedelta(seconds=1), **gpu(gpus=1, vendor="nvidia"))
    def victim() -> None:
        ti = get_current_context()["ti"]
        name = f"{ti.run_id}-{ti.try_number}.host".replace(":", "_")
        with open(os.path.join(os.environ["GPUSCHED_TEST_OUT"], name), "w") as marker:
            marker.write(f"{os.environ.get('GPUSCHED_HOST')} {time.time()}")
        if ti.try_number == 1:
            time.sleep(300)

    victim()


@dag(dag_id="bench_warm", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def bench_warm():
    @task(executor="CeleryExecutor", queue="gpusched@host-a")
    def plain_a(i: int) -> None:
        pass

    @task(executor="CeleryExecutor", queue="gpusched@host-b")
    def plain_b(i: int) -> None:
        pass

    @task(**gpu(gpus=0.25, memory="8GiB", vendor="nvidia"))
    def gpu_any(i: int) -> None:
        pass

    plain_a.expand(i=list(range(4)))
    plain_b.expand(i=list(range(4)))
    gpu_any.expand(i=list(range(8)))


bench_plain()
bench_gpu()
bench_death()
bench_warm()
'''


def _ts(value: str | None) -> float:
    assert value, "missing timestamp"
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _scheduler_cpu(cluster: LocalCluster) -> float:
    import psutil

    root = psutil.Process(cluster.procs["scheduler"].pid)
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


STALL_S = 4.0
"""A Celery try that held its worker slot this long ran into Airflow's supervisor stall: a task
here runs 0.1–0.5 s, and the supervisor that misses its process's exit notices it only at its
next heartbeat (``[workers] min_heartbeat_interval``, 5 s)."""

_SUCCEEDED = re.compile(r"^(\S+) .*Task \S+\[[^\]]+\] succeeded in ([\d.]+)s")


def slot_holds(lines: Iterable[str], since: float, until: float) -> list[float]:
    """Seconds each Celery try that succeeded between ``since`` and ``until`` held its worker
    slot, from a worker's log ``lines`` (Celery's ``Task … succeeded in X s``)."""
    held = []
    for line in lines:
        found = _SUCCEEDED.match(line)
        if found and since <= _ts(found.group(1)) <= until:
            held.append(float(found.group(2)))
    return held


Batch = tuple[list[float], float, float, list[float]]
"""One batch: queued -> running waits, wall s, scheduler CPU s, each try's hold of its slot (s)."""


def _run(cluster: LocalCluster, dag_id: str, tasks: int) -> Batch:
    """One run of ``dag_id``: the queued -> running waits, wall seconds, scheduler CPU seconds and
    how long each try held its worker slot."""
    cpu0, wall0 = _scheduler_cpu(cluster), time.time()
    run_id = cluster.trigger(dag_id)
    last = -1
    while True:
        state = cluster.run_state(dag_id, run_id)
        tis = cluster.task_instances(dag_id, run_id)
        done = sum(1 for t in tis if t["state"] in ("success", "failed"))
        if done != last:
            print(f"  {dag_id}: {done}/{tasks} done", flush=True)
            last = done
        if state in ("success", "failed"):
            break
        time.sleep(3)
    wall, cpu = time.time() - wall0, _scheduler_cpu(cluster) - cpu0
    failed = [t for t in tis if t["state"] != "success"]
    if failed:
        raise SystemExit(f"{dag_id}: {len(failed)} task(s) did not succeed: {failed[:3]}")
    held = [s for log in sorted(cluster.logs.glob("*-worker.log"))
            for s in slot_holds(log.read_text(errors="replace").splitlines(), wall0, wall0 + wall)]
    return [_ts(t["start_date"]) - _ts(t["queued_when"]) for t in tis], wall, cpu, held


def _summary(runs: list[Batch]) -> dict[str, float]:
    waits = [w for run in runs for w in run[0]]
    held = [h for run in runs for h in run[3]]
    wall, cpu = sum(r[1] for r in runs), sum(r[2] for r in runs)
    return {"tasks": len(waits), "p50_s": _pct(waits, 0.5), "p95_s": _pct(waits, 0.95),
            "mean_s": statistics.fmean(waits), "wall_s": wall, "scheduler_cpu_s_per_task": cpu / len(waits),
            "slot_held_p50_s": _pct(held, 0.5) if held else math.nan,
            "stalled_share": sum(1 for h in held if h >= STALL_S) / len(held) if held else math.nan}


def _death(cluster: LocalCluster, round_no: int, *, worker_only: bool = False) -> dict[str, float | str]:
    """One death mid-task: the whole host (worker, agent and task processes SIGKILLed, as a
    machine dying) or, with ``worker_only``, its Celery worker alone (agent and task live on);
    timed from the kill to the retry running on the other host."""
    run_id = cluster.trigger("bench_death")
    safe = run_id.replace(":", "_")
    first = cluster.out / f"{safe}-1.host"
    cluster.wait("the victim to start", first.exists, 300, 0.5)
    doomed = first.read_text().split()[0]
    killed = time.time()
    if worker_only:
        cluster.kill_worker(doomed)
    else:
        cluster.kill_host(doomed)
    second = cluster.out / f"{safe}-2.host"
    cluster.wait("the retry to run on the other host", second.exists, 300, 0.2)
    host, started = second.read_text().split()
    cluster.wait("bench_death to finish", lambda: cluster.run_state("bench_death", run_id) == "success", 120)
    seconds = float(started) - killed
    what = "its worker" if worker_only else "it"
    print(f"  round {round_no}: killed {what} on {doomed}; task running on {host} after {seconds:.1f} s",
          flush=True)
    if worker_only:
        cluster.start_worker(doomed)
    else:
        cluster.start_host(doomed)  # the host comes back; its agent confirms the old try and is re-admitted
    with Ledger(cluster.db_url) as ledger:
        cluster.wait("the host to be re-admitted, nothing quarantined", lambda: (h := ledger.host(doomed))
                     is not None and h.state == "live" and not ledger.quarantined(doomed), 120)
    return {"killed": doomed, "ran_on": host, "seconds": seconds}


def plot(result: dict[str, object], path: Path) -> None:
    """Two panels: queued -> running p50/p95 per executor; host death -> running per round."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    names = [("plain_celery", "CeleryExecutor\nhand-routed queues"),
             ("gpu_celery", "GPU Celery executor\n(placed + allocated)")]
    xs = range(len(names))
    for offset, (stat, colour) in enumerate((("p50_s", "#4c72b0"), ("p95_s", "#dd8452"))):
        values = [float(result[key][stat]) for key, _ in names]  # type: ignore[index]
        bars = left.bar([x + offset * 0.38 for x in xs], values, 0.36, color=colour, label=stat[:3])
        left.bar_label(bars, fmt="%.1f s", fontsize=8)
    left.set_xticks([x + 0.19 for x in xs], [label for _, label in names], fontsize=8)
    left.set_ylabel("queued -> running (s)")
    left.set_title(f"{result['tasks']} short tasks per executor, same run", fontsize=9)
    left.legend(fontsize=8)
    deaths = result["host_death_to_running_s"]
    seconds = [float(d["seconds"]) for d in deaths]  # type: ignore[attr-defined]
    bars = right.bar(range(1, len(seconds) + 1), seconds, color="#55a868")
    right.bar_label(bars, fmt="%.1f s", fontsize=8)
    right.set_xticks(range(1, len(seconds) + 1))
    right.axhline(60, color="#c44e52", linestyle="--", linewidth=1, label="goal: 60 s")
    right.set_xlabel("host death (SIGKILL of worker + agent), round")
    right.set_ylabel("death -> task running elsewhere (s)")
    right.set_title(f"host timeout {result['host_timeout_s']} s (seed's production figure: 15 min)",
                    fontsize=9)
    right.set_ylim(0, 70)
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=200, help="short tasks per executor (default 200)")
    parser.add_argument("--deaths", type=int, default=3,
                        help="host deaths, then worker deaths, to time (default 3 each)")
    parser.add_argument("--concurrency", type=int, default=4, help="Celery worker slots per host (default 4)")
    parser.add_argument("--out", type=Path, default=REPO / "results" / "multihost.json")
    parser.add_argument("--plot-only", action="store_true", help="redraw the PNG from --out and exit")
    args = parser.parse_args()
    if args.plot_only:
        plot(json.loads(args.out.read_text()), args.out.with_suffix(".png"))
        return 0
    base = Path(tempfile.mkdtemp(prefix="gpusched-bench-multihost-"))
    executors = "gpusched.airflow.celery_executor.GPUCeleryExecutor,CeleryExecutor"
    env = {"GPUSCHED_BENCH_TASKS": str(args.tasks // 2), "AIRFLOW__CORE__MAX_ACTIVE_TASKS_PER_DAG": "64",
           "AIRFLOW__SCHEDULER__TASK_QUEUED_TIMEOUT": "1200"}
    cluster = LocalCluster(base, {"bench_dags.py": DAGS}, executor=executors,
                           worker_concurrency=args.concurrency, env=env)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the deployment on SIGTERM too
    print(f"gpusched bench multihost: starting the deployment in {base}", flush=True)
    try:
        cluster.start()
        cluster.wait("scheduler and dag-processor", cluster.healthy, 300, 2)
        for dag_id in ("bench_plain", "bench_gpu", "bench_death", "bench_warm"):
            parsed = functools.partial(cluster.api, "GET", f"/dags/{dag_id}")
            cluster.wait(f"{dag_id} to be parsed", parsed, 240, 2)
        print("warm-up:", flush=True)
        _run(cluster, "bench_warm", 16)
        runs: dict[str, list[Batch]] = {"bench_plain": [], "bench_gpu": []}
        for dag_id in ("bench_plain", "bench_gpu", "bench_gpu", "bench_plain"):
            label = "plain CeleryExecutor, hand-routed" if dag_id == "bench_plain" else "GPU Celery executor"
            print(f"{label}:", flush=True)
            runs[dag_id].append(_run(cluster, dag_id, args.tasks // 2))
        plain, gpu = _summary(runs["bench_plain"]), _summary(runs["bench_gpu"])
        print(f"host deaths ({args.deaths}):", flush=True)
        deaths = [_death(cluster, i + 1) for i in range(args.deaths)]
        print(f"worker deaths, agent alive ({args.deaths}):", flush=True)
        worker_deaths = [_death(cluster, i + 1, worker_only=True) for i in range(args.deaths)]
    finally:
        cluster.stop()
    recovery = sorted(float(d["seconds"]) for d in deaths)
    worker_recovery = sorted(float(d["seconds"]) for d in worker_deaths)
    result = {
        "tasks": args.tasks, "worker_concurrency_per_host": args.concurrency, "hosts": 2,
        "plain_celery": plain, "gpu_celery": gpu,
        "p50_ratio_gpu_over_plain": gpu["p50_s"] / plain["p50_s"] if plain["p50_s"] else None,
        "p95_ratio_gpu_over_plain": gpu["p95_s"] / plain["p95_s"] if plain["p95_s"] else None,
        "host_death_to_running_s": deaths,
        "host_death_to_running_median_s": statistics.median(recovery) if recovery else None,
        "worker_death_to_running_s": worker_deaths,
        "worker_death_to_running_median_s": statistics.median(worker_recovery) if worker_recovery else None,
        "host_timeout_s": 10,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    plot(result, args.out.with_suffix(".png"))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
