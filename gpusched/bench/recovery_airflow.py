#!/usr/bin/env python
"""Fault recovery through the full Airflow loop: Xid on a running task's GPU → retry running elsewhere.

    .venv/bin/python scripts/bench_recovery_airflow.py [--trials 3] [--agent-interval 2] [--out FILE]

Starts ``airflow standalone`` (SQLite, the GPU executor, the gpusched plugin with the fault
listener) in a temporary AIRFLOW_HOME with the simulated default fleet and a ``gpusched agent``
process, then per trial: triggers a one-task GPU DAG (retries=1, retry_delay=1 s), waits for the
task to run, injects Xid 79 on its device (t0) and waits until try 2 runs (t1). The task reads its
device through the simulated backend and fails like a CUDA program would. Reports t1 − t0 and
whether try 2's device is healthy and differs from the faulty one. Nothing is mocked: the
scheduler, executor, task supervisor, listener, ledger and REST API are Airflow's and gpusched's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gpusched.airflow.rest import AirflowApi
from gpusched.deploy.airflow_instance import free_port, scheduler_healthy, wait_until
from gpusched.errors import AirflowBootError
from gpusched.hardware.simulated import SimulatedBackend
from gpusched.ledger import Ledger
from gpusched.model import Health

REPO = Path(__file__).resolve().parents[2]  # gpusched/bench/ → the repository
DAG_ID = "bench_gpu_fault"
DAG_SOURCE = '''
from __future__ import annotations

import json, os, sys, time
from datetime import datetime, timedelta
from pathlib import Path

from airflow.sdk import dag, task

from gpusched.airflow.authoring import gpu


def _train(**context):
    from gpusched.hardware.simulated import SimulatedBackend

    alloc = json.loads(os.environ["GPUSCHED_ALLOCATION"])
    uuid = alloc["uuids"][0]
    ti = context["ti"]
    out = Path(os.environ["BENCH_DIR"])
    stamp = {"uuid": uuid, "at": time.time(), "try": ti.try_number, "run_id": ti.run_id}
    (out / f"running_{ti.run_id}_{ti.try_number}.json").write_text(json.dumps(stamp))
    backend = SimulatedBackend()
    deadline = time.time() + 120
    while time.time() < deadline and not (out / f"stop_{ti.run_id}").exists():
        sample = next((s for s in backend.sample() if s.uuid == uuid), None)
        if sample is None or sample.xid_errors:
            print(f"NVRM: Xid (PCI:0000:{alloc['devices'][0]:02x}:00): 79, pid={os.getpid()}, "
                  "name=python, GPU has fallen off the bus.", file=sys.stderr, flush=True)
            raise RuntimeError("CUDA error: unspecified launch failure")
        time.sleep(0.1)
    return uuid


@dag(dag_id="bench_gpu_fault", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def bench_gpu_fault():
    task(**gpu(gpus=1, vendor="nvidia", memory="40GiB"), task_id="train", retries=1,
         retry_delay=timedelta(seconds=1))(_train)()


@dag(dag_id="bench_gpu_fault_noretry", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def bench_gpu_fault_noretry():
    task(**gpu(gpus=1, vendor="nvidia", memory="40GiB"), task_id="train", retries=0)(_train)()


def _leak(**context):
    from gpusched.hardware.simulated import SimulatedBackend

    alloc = json.loads(os.environ["GPUSCHED_ALLOCATION"])
    uuid = alloc["uuids"][0]
    ti = context["ti"]
    out = Path(os.environ["BENCH_DIR"])
    (out / f"leak_{ti.run_id}.json").write_text(json.dumps({"uuid": uuid, "at": time.time()}))
    backend = SimulatedBackend()
    used, cap = 2**30, alloc["memory_bytes"][0] * 9 // 10
    try:
        for _ in range(600):  # +100 MB per second (6 GB/min) for at most 5 minutes
            used = min(used + 50_000_000, cap)
            backend.set_load(uuid, 90, used)
            time.sleep(0.5)
    finally:
        backend.set_load(uuid, 0, 0)


@dag(dag_id="bench_gpu_leak", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def bench_gpu_leak():
    task(**gpu(gpus=1, vendor="nvidia", memory="40GiB"), task_id="train", retries=0)(_leak)()


bench_gpu_fault()
bench_gpu_fault_noretry()
bench_gpu_leak()
'''


BASELINE_PLUGIN = '''
from airflow.plugins_manager import AirflowPlugin

from gpusched.airflow import listener as gpusched_listener


class GpuschedBaseline(AirflowPlugin):
    name = "gpusched"
    listeners = [gpusched_listener]
'''


def _wait(what: str, check: Any, timeout: float, proc: subprocess.Popen[bytes], log: Path) -> Any:
    try:
        return wait_until(what, check, timeout, proc=proc, log=log, interval=0.2, tail=4000)
    except AirflowBootError as exc:
        raise SystemExit(str(exc)) from None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--agent-interval", type=float, default=2.0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the temporary AIRFLOW_HOME")
    parser.add_argument("--sweep", action="store_true",
                        help="the task has no retries: the gpusched_fault_recovery DAG (triggered after "
                             "the failure) clears it through the REST API")
    parser.add_argument("--leak", action="store_true",
                        help="instead of Xid trials: a task whose device memory grows 6 GB/min; checks "
                             "that the agent stops it and the chain classifies it")
    parser.add_argument("--baseline", action="store_true",
                        help="without the fault chain: no agent; the plugin registers only the "
                             "device listener")
    args = parser.parse_args()

    home = Path(tempfile.mkdtemp(prefix="gpusched-airflow-bench-"))
    dags, bench = home / "dags", home / "bench"
    dags.mkdir()
    bench.mkdir()
    (dags / "bench_gpu_fault.py").write_text(DAG_SOURCE)
    (dags / "fault_recovery.py").write_text((REPO / "dags" / "fault_recovery.py").read_text())
    dag_id = "bench_gpu_leak" if args.leak else "bench_gpu_fault_noretry" if args.sweep else DAG_ID
    plugins = REPO / "plugins"
    if args.baseline:
        plugins = home / "plugins"
        plugins.mkdir()
        (plugins / "gpusched_baseline.py").write_text(BASELINE_PLUGIN)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "GPUSCHED"))}
    env.update({
        "AIRFLOW_HOME": str(home), "BENCH_DIR": str(bench), "GPUSCHED_BACKEND": "simulated",
        "AIRFLOW__CORE__EXECUTOR": "gpusched.airflow.executor.GPUExecutor",
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags), "AIRFLOW__CORE__PLUGINS_FOLDER": str(plugins),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False", "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
        "AIRFLOW__API__PORT": str(port), "AIRFLOW__API__BASE_URL": f"http://localhost:{port}",
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://localhost:{port}/execution/",
        "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),
        "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port()),
        "GPUSCHED_AIRFLOW_API_URL": f"http://localhost:{port}",
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
    })
    # Airflow's SQLite database as scripts/run.sh sets it up (WAL, the ledger's lock wait): with
    # SQLite's defaults a write waiting behind another component fails ("database is locked", a
    # 500 from POST dagRuns on a loaded machine).
    env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = f"sqlite:///{home / 'airflow.db'}"
    metadb = subprocess.run([sys.executable, "-m", "gpusched.airflow.metadb"], env=env, check=True,
                            capture_output=True, text=True)
    if metadb.stdout.strip() == "sqlite":
        for key in ("SQL_ALCHEMY_CONNECT_ARGS", "SQL_ALCHEMY_CONNECT_ARGS_ASYNC"):
            env[f"AIRFLOW__DATABASE__{key}"] = "gpusched.airflow.metadb.SQLITE_CONNECT_ARGS"
    os.environ.update({"AIRFLOW_HOME": str(home), "GPUSCHED_AIRFLOW_API_URL": f"http://localhost:{port}"})
    log = home / "standalone.log"
    with log.open("wb") as sink:
        airflow = subprocess.Popen([str(Path(sys.executable).parent / "airflow"), "standalone"], env=env,
                                   stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    agent = None if args.baseline else subprocess.Popen(
        [sys.executable, "-m", "gpusched.cli", "agent", "--port", "0",
         "--interval", str(args.agent_interval)],
        env=env, stdout=(home / "agent.log").open("wb"), stderr=subprocess.STDOUT,
    )
    trials: list[dict[str, Any]] = []
    try:
        started = time.monotonic()
        url = f"http://localhost:{port}"
        _wait("Airflow to be healthy", lambda: scheduler_healthy(url), 300, airflow, log)
        api = AirflowApi(f"http://localhost:{port}")
        dag_path = f"/api/v2/dags/{dag_id}"
        _wait("the bench DAG to be parsed", lambda: api.call("GET", dag_path), 180, airflow, log)
        print(f"airflow up after {time.monotonic() - started:.0f} s; home {home}", file=sys.stderr)
        backend = SimulatedBackend()
        if args.leak:
            print(json.dumps(_leak_check(api, dag_path, bench, airflow, log), indent=2))
            return 0
        for n in range(args.trials):
            run_id = api.call("POST", f"{dag_path}/dagRuns", {"logical_date": None})["dag_run_id"]
            first = bench / f"running_{run_id}_1.json"
            _wait(f"trial {n}: try 1 running", first.exists, 180, airflow, log)
            time.sleep(max(2 * args.agent_interval, 1.0))
            device = json.loads(first.read_text())["uuid"]
            t0 = time.time()
            backend.inject_fault(device, "xid", code=79)
            second = bench / f"running_{run_id}_2.json"
            run_path = f"{dag_path}/dagRuns/{run_id}"
            if args.sweep:  # Airflow will not retry: the recovery DAG clears the failed task
                _wait(f"trial {n}: run to fail", lambda p=run_path: api.call("GET", p)["state"] == "failed",
                      120, airflow, log)
                api.call("POST", "/api/v2/dags/gpusched_fault_recovery/dagRuns", {"logical_date": None})
            _wait(f"trial {n}: try 2 running", second.exists, 120, airflow, log)
            retry = json.loads(second.read_text())
            with Ledger() as ledger:
                snapshot = ledger.snapshot()
                handled = [e for e in ledger.events(50, kinds=["failure_handled"]) if run_id in e.subject]
            (bench / f"stop_{run_id}").write_text("")
            trial = {
                "run_id": run_id, "faulty_device": device, "retry_device": retry["uuid"],
                "retry_device_healthy": retry["uuid"] != device
                and snapshot.device(retry["uuid"]).health.value == "healthy",
                "faulty_cordoned": snapshot.device(device).cordoned,
                "fault_to_retry_running_s": retry["at"] - t0,
                "classified_as": handled[0].detail.get("failure_kind") if handled else None,
            }
            print(json.dumps(trial), file=sys.stderr)
            trials.append(trial)
            _wait(f"trial {n}: run to finish",
                  lambda p=run_path: api.call("GET", p)["state"] in ("success", "failed"), 180, airflow, log)
            backend.clear_faults()
            with Ledger() as ledger:
                ledger.uncordon(device)
                ledger.set_health(device, Health.HEALTHY, "bench reset")
    finally:
        if agent is not None:
            agent.terminate()
            agent.wait(timeout=30)
        os.killpg(airflow.pid, signal.SIGINT)
        try:
            airflow.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(airflow.pid, signal.SIGKILL)
            airflow.wait()
    times = [t["fault_to_retry_running_s"] for t in trials if t["retry_device_healthy"]]
    summary = {
        "mode": "baseline (no fault chain)" if args.baseline else
                "gpusched fault chain" + (" via the recovery DAG (no Airflow retries)" if args.sweep else ""),
        "trials": len(trials), "recovered_on_healthy_gpu": f"{len(times)}/{len(trials)}",
        "fault_to_retry_running_s": {"median": statistics.median(times) if times else None,
                                     "max": max(times) if times else None},
        "agent_interval_s": args.agent_interval, "retry_delay_s": None if args.sweep else 1.0,
    }
    print(json.dumps(summary, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"summary": summary, "trials": trials}, indent=2))
    if not args.keep:
        import shutil

        shutil.rmtree(home, ignore_errors=True)
    return 0


def _leak_check(api: Any, dag_path: str, bench: Path, airflow: subprocess.Popen[bytes], log: Path
                ) -> dict[str, Any]:
    run_id = api.call("POST", f"{dag_path}/dagRuns", {"logical_date": None})["dag_run_id"]
    started = bench / f"leak_{run_id}.json"
    _wait("the leaking task to run", started.exists, 180, airflow, log)
    run_path = f"{dag_path}/dagRuns/{run_id}"
    _wait("the leaking task to be stopped", lambda: api.call("GET", run_path)["state"] == "failed",
          240, airflow, log)
    ended = time.time()
    with Ledger() as ledger:
        alerts = [e for e in ledger.events(50, kinds=["alert"]) if run_id in e.subject]
        handled = [e for e in ledger.events(50, kinds=["failure_handled"]) if run_id in e.subject]
    return {
        "mode": "memory leak", "run_state": "failed",
        "leak_start_to_run_failed_s": ended - json.loads(started.read_text())["at"],
        "agent_alert": alerts[0].detail if alerts else None,
        "classified_as": handled[0].detail.get("failure_kind") if handled else None,
        "evidence": handled[0].detail.get("evidence") if handled else None,
    }


if __name__ == "__main__":
    raise SystemExit(main())
