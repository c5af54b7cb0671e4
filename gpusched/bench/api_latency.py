"""How fast the main job's REST API answers ``POST /dags/{id}/dagRuns`` on a busy machine.

    nice -n 10 .venv/bin/python scripts/bench_api_latency.py [--duration 150] [--burners 4]
        [--metadb default|sqlite|both] [--out FILE]

Boots the main job exactly as users run it — ``scripts/run.sh`` (``airflow standalone`` with the
GPU executor, the telemetry agent, the simulated default fleet) in a temporary home, with the
example DAGs of the end-to-end test and its settings (6 steps of 0.5 s, ``[core] parallelism``
8) — starts ``--burners`` CPU-bound processes, then for ``--duration`` seconds:

* keeps ``--active-runs`` runs of those DAGs going, as the test does: whenever fewer are queued or
  running it triggers the next one (``POST /api/v2/dags/{id}/dagRuns``, timed: ``trigger_*``) and
  it polls the runs' states every 2 s (``GET``, timed);
* probes in an open loop: every ``--probe-every`` seconds one ``POST …/dagRuns`` of a DAG kept
  paused (its runs are written like any other and never run), each in a thread of its own whether
  or not the earlier ones answered (``probe_*``). This is the latency a request arriving at any
  moment sees: a closed loop that waits for each answer meets a 60 s stall once, a user who
  clicks "Trigger" during it meets it too.

Reported per phase, for both kinds of POST: p50 / p95 / p99 / max, how many took over 5 s (the
target is p95 ≤ 5 s) and over 30 s (the test's client timeout: a test run would have failed), and
how many failed (the benchmark's own client waits 120 s, so a stalled request's whole duration is
seen); the GET latency; the DAG runs finished; the wall time of the window and the CPU time the
main job used in it — run.sh and everything under it plus the PostgreSQL server it started (a
daemon outside run.sh's tree) — with the API server's and PostgreSQL's shares and the CPU seconds
per finished run; the machine's load average. ``--metadb`` picks Airflow's metadata database:
``default`` = what run.sh chooses (PostgreSQL when the server binaries are installed, else SQLite),
``sqlite`` = run.sh forced onto SQLite (``GPUSCHED_METADB=sqlite``, the database before the fix),
``both`` = SQLite first, then the default, in one run on the same loaded machine. Nothing is
mocked; nothing is asserted: it prints JSON (``--out`` writes it too).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpusched.deploy.airflow_instance import (
    free_port,
    login_token,
    scheduler_healthy,
    stop_run_sh,
    wait_until,
)
from gpusched.errors import AirflowBootError

REPO = Path(__file__).resolve().parents[2]  # gpusched/bench/ → the repository
DAGS = ("example_multi_gpu_nvlink_training", "example_fractional_finetune", "example_dev_smoke_test")
TEST_TIMEOUT_S = 30.0  # the end-to-end test's httpx timeout: a slower answer failed the test
CLIENT_TIMEOUT_S = 120.0  # the benchmark waits longer, to see how long a stalled request takes
STALL_S = 5.0  # the target: p95 ≤ 5 s
BURNER = "while True:\n    pass\n"
PROBE_DAG = "bench_api_probe"
PROBE_SOURCE = """
from datetime import datetime

from airflow.sdk import dag, task


@dag(dag_id="bench_api_probe", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def bench_api_probe():
    # Kept paused by the benchmark: its runs are created (the same writes as any trigger) and
    # never run, so probing adds no work to the machine.
    @task
    def nothing() -> None:
        pass

    nothing()


bench_api_probe()
"""

__all__ = ["main", "measure"]


@dataclass
class Phase:
    """What one phase measured."""

    metadb: str
    probe_s: list[float] = field(default_factory=list)
    probe_errors: list[str] = field(default_factory=list)
    post_s: list[float] = field(default_factory=list)
    get_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    runs_finished: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    api_cpu_s: float = 0.0
    postgres_cpu_s: float = 0.0
    load: tuple[float, float, float] = (0.0, 0.0, 0.0)
    database: str = ""
    lock_timeouts: int = 0
    api_db_errors: int = 0
    scheduler_alive: bool = True


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return round(ordered[index], 3)


def _request(url: str, method: str, token: str, body: Any = None, *, timeout: float = CLIENT_TIMEOUT_S
             ) -> tuple[int, Any, float]:
    """(status, JSON or text, seconds); a timeout is status 0."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={
        "Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            payload = json.loads(response.read() or b"null")
            return response.status, payload, time.perf_counter() - started
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")[:300], time.perf_counter() - started
    except (OSError, ValueError) as exc:  # timeouts, refused or dropped connections, bad answers
        return 0, f"{type(exc).__name__}: {exc}", time.perf_counter() - started


def _cpu(root: int, pgdata: Path) -> tuple[float, float, float]:
    """CPU seconds (user + system, with reaped children) of the main job: ``root`` (run.sh) and
    everything under it, its API server's processes among them, and the PostgreSQL server in
    ``pgdata`` (a daemon of its own, outside run.sh's tree) with its backends. A process that
    ended in the window counts through its parent (reaped: the parent's children times) or itself
    (a zombie)."""
    import psutil

    total = api = postgres = 0.0
    try:
        procs = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0, 0.0, 0.0
    server = f"-D {pgdata / 'data'}"
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            if server in " ".join(proc.cmdline()):
                procs += [proc, *proc.children(recursive=True)]
    for proc in procs:
        try:  # a zombie (a component that died, not yet reaped) still has its times
            times = proc.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        spent = times.user + times.system + times.children_user + times.children_system
        try:
            name = " ".join(proc.cmdline()[:3])
            is_postgres = proc.name() == "postgres"
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            name, is_postgres = "", False
        total += spent
        if "api-server" in name or "api_server" in name:
            api += spent
        if is_postgres:
            postgres += spent
    return total, api, postgres


@contextlib.contextmanager
def _main_job(home: Path, metadb: str, pgdata: Path) -> Iterator[tuple[subprocess.Popen[bytes], str, Path]]:
    """``scripts/run.sh`` in ``home`` with the end-to-end test's DAGs and settings; its PostgreSQL
    (if it starts one) keeps its data in ``pgdata`` (a folder the server's user can reach)."""
    dags = home / "dags"
    dags.mkdir(parents=True)
    for dag_id in DAGS:
        shutil.copy(REPO / "dags" / f"{dag_id}.py", dags)
    (dags / f"{PROBE_DAG}.py").write_text(PROBE_SOURCE)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "GPUSCHED"))}
    env.update({
        "GPUSCHED_AIRFLOW_HOME": str(home / "airflow"), "GPUSCHED_DAGS_FOLDER": str(dags),
        "GPUSCHED_PORT": str(port), "GPUSCHED_BACKEND": "simulated",
        "GPUSCHED_METRICS_PORT": str(free_port()), "GPUSCHED_PGDATA": str(pgdata),
        "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),
        "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port()),
        "GPUSCHED_EXAMPLE_STEPS": "6", "GPUSCHED_EXAMPLE_STEP_SECONDS": "0.5",
        "AIRFLOW__CORE__PARALLELISM": "8",
    })
    if metadb == "sqlite":
        env["GPUSCHED_METADB"] = "sqlite"
    log = home / "run.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen([str(REPO / "scripts" / "run.sh")], cwd=REPO, env=env, stdout=sink,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc, f"http://127.0.0.1:{port}", log
    finally:
        stop_run_sh(proc)


class _Prober:
    """Open loop: every ``interval`` s one ``POST /dags/bench_api_probe/dagRuns`` in a thread of its
    own, whether or not the earlier ones have answered, so a stall is seen by every request that
    arrives during it (a closed loop sees it once)."""

    def __init__(self, url: str, token: str, phase: Phase, interval: float) -> None:
        self.url, self.token, self.phase, self.interval = url, token, phase, interval
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []
        self.loop = threading.Thread(target=self._run, daemon=True)

    def _one(self) -> None:
        status, body, took = _request(self.url, "POST", self.token, {"logical_date": None})
        with self.lock:
            self.phase.probe_s.append(took)
            if status != 200:
                self.phase.probe_errors.append(f"POST {PROBE_DAG}: {status} {body}"[:300])

    def _run(self) -> None:
        due = time.monotonic()
        while not self.stop.is_set():
            thread = threading.Thread(target=self._one, daemon=True)
            thread.start()
            self.threads.append(thread)
            due += self.interval
            self.stop.wait(max(0.0, due - time.monotonic()))

    def __enter__(self) -> _Prober:
        self.loop.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.loop.join()
        deadline = time.monotonic() + CLIENT_TIMEOUT_S + 5
        for thread in self.threads:  # the ones still waiting for an answer (they time out by then)
            thread.join(max(0.0, deadline - time.monotonic()))


def measure(metadb: str, *, duration: float, burners: int, active_runs: int, probe_every: float = 2.0,
            keep: bool = False) -> Phase:
    """One phase: boot the main job, load the machine, trigger and time (see the module docs)."""
    home = Path(tempfile.mkdtemp(prefix="gpusched-api-bench-"))
    pgdata = Path(tempfile.mkdtemp(prefix="gpusched-pg-"))  # in /tmp: reachable by the server user
    phase = Phase(metadb)
    burning: list[subprocess.Popen[bytes]] = []
    try:
        with _main_job(home, metadb, pgdata) as (proc, url, log):
            def wait(what: str, check: Any, timeout: float) -> Any:
                try:
                    return wait_until(what, check, timeout, proc=proc, log=log, interval=1.0, tail=4000)
                except AirflowBootError as exc:
                    raise SystemExit(str(exc)) from None

            airflow_home = home / "airflow"
            wait("the main job to be healthy", lambda: scheduler_healthy(url), 300)
            token = wait("a login token", lambda: login_token(airflow_home, url), 60)
            api = f"{url}/api/v2"

            def parsed() -> bool:
                status, body, _ = _request(f"{api}/dags?limit=100", "GET", token)
                return status == 200 and {*DAGS, PROBE_DAG} <= {d["dag_id"] for d in body["dags"]}

            wait("the example DAGs to be parsed", parsed, 180)
            phase.database = _database_kind(log)
            for dag_id in DAGS:
                _request(f"{api}/dags/{dag_id}", "PATCH", token, {"is_paused": False})
            _request(f"{api}/dags/{PROBE_DAG}", "PATCH", token, {"is_paused": True})
            burning = [subprocess.Popen([sys.executable, "-c", BURNER]) for _ in range(burners)]
            time.sleep(5)  # let the burners take the CPUs
            cpu0, api0, pg0 = _cpu(proc.pid, pgdata)
            load0 = os.getloadavg()
            started = time.monotonic()
            with _Prober(f"{api}/dags/{PROBE_DAG}/dagRuns", token, phase, probe_every):
                _keep_runs_going(api, token, phase, proc, log, duration=duration, active_runs=active_runs)
            phase.wall_s = time.monotonic() - started
            cpu1, api1, pg1 = _cpu(proc.pid, pgdata)
            phase.scheduler_alive = _scheduler_alive(proc.pid)
            text = log.read_text(errors="replace")
            # Each failed write of a component (scheduler, dag-processor, triggerer) ends in one
            # such line; the API server logs its database errors as "Error with id …" (a 500).
            phase.lock_timeouts = text.count("sqlalchemy.exc.OperationalError: (sqlite3.OperationalError) "
                                             "database is locked")
            phase.api_db_errors = text.count("] Error with id ")
            phase.cpu_s, phase.api_cpu_s, phase.postgres_cpu_s = cpu1 - cpu0, api1 - api0, pg1 - pg0
            load1 = os.getloadavg()
            phase.load = (load1[0], max(load0[0], load1[0]), load1[1])
    finally:
        for burner in burning:
            burner.kill()
            burner.wait()
        if (pgdata / "data" / "postmaster.pid").exists():  # run.sh did not get to stop it
            subprocess.run(["bash", str(REPO / "scripts" / "start_postgres.sh"), "--halt", str(pgdata)],
                           check=False, timeout=120)
        if keep:
            print(f"kept {home} and {pgdata}", file=sys.stderr)
        else:
            shutil.rmtree(home, ignore_errors=True)
            shutil.rmtree(pgdata, ignore_errors=True)
    return phase


def _scheduler_alive(root: int) -> bool:
    """Whether run.sh's tree still has its ``airflow scheduler`` (a scheduler whose database write
    failed exits, and standalone then stops every component)."""
    import psutil

    with contextlib.suppress(psutil.NoSuchProcess):
        for child in psutil.Process(root).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                if "scheduler" in " ".join(child.cmdline()[:4]) and child.status() != psutil.STATUS_ZOMBIE:
                    return True
    return False


def _keep_runs_going(api: str, token: str, phase: Phase, proc: subprocess.Popen[bytes], log: Path, *,
                     duration: float, active_runs: int) -> None:
    """Closed loop, as the end-to-end test does: trigger the example DAGs in turn whenever fewer
    than ``active_runs`` runs are queued or running, and poll their states every 2 s."""
    started = time.monotonic()
    active: dict[tuple[str, str], None] = {}
    n = 0
    last_poll = 0.0

    def running() -> bool:
        return time.monotonic() - started < duration

    while running():
        if proc.poll() is not None:
            raise SystemExit(f"run.sh exited ({proc.returncode}):\n{log.read_text()[-4000:]}")
        if time.monotonic() - last_poll >= 2.0:
            last_poll = time.monotonic()
            for dag_id, run_id in list(active):
                if not running():
                    return
                status, body, took = _request(f"{api}/dags/{dag_id}/dagRuns/{run_id}", "GET", token,
                                              timeout=TEST_TIMEOUT_S)
                phase.get_s.append(took)
                if status == 200 and body["state"] in ("success", "failed"):
                    del active[(dag_id, run_id)]
                    phase.runs_finished += 1
        if len(active) < active_runs and running():
            dag_id = DAGS[n % len(DAGS)]
            n += 1
            status, body, took = _request(f"{api}/dags/{dag_id}/dagRuns", "POST", token,
                                          {"logical_date": None})
            phase.post_s.append(took)
            if status == 200:
                active[(dag_id, body["dag_run_id"])] = None
            else:
                phase.errors.append(f"POST {dag_id}: {status} {body}"[:300])
            continue
        time.sleep(0.2)


def _database_kind(log: Path) -> str:
    """What run.sh said it runs Airflow's database on (its ``gpusched: Airflow database …`` line)."""
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("gpusched: Airflow database"):
            return line.removeprefix("gpusched: ").strip()
    return "unknown"


def _latency(prefix: str, values: list[float], failed: list[str]) -> dict[str, Any]:
    return {
        f"{prefix}": len(values),
        f"{prefix}_p50_s": _quantile(values, 0.5), f"{prefix}_p95_s": _quantile(values, 0.95),
        f"{prefix}_p99_s": _quantile(values, 0.99),
        f"{prefix}_max_s": round(max(values), 3) if values else None,
        f"{prefix}_mean_s": round(statistics.fmean(values), 3) if values else None,
        f"{prefix}_over_5s": sum(t > STALL_S for t in values),
        f"{prefix}_over_30s": sum(t > TEST_TIMEOUT_S for t in values),
        f"{prefix}_failed": len(failed),
        f"{prefix}_errors": failed[:3],
    }


def summary(phase: Phase) -> dict[str, Any]:
    """The JSON-safe figures of one phase: ``probe_*`` the open-loop POSTs (the latency a request
    arriving at any moment sees), ``trigger_*`` the closed-loop POSTs of the example DAGs."""
    return {
        "metadb": phase.metadb, "database": phase.database,
        **_latency("probe", phase.probe_s, phase.probe_errors),
        **_latency("trigger", phase.post_s, phase.errors),
        "gets": len(phase.get_s),
        "get_p50_s": _quantile(phase.get_s, 0.5), "get_p95_s": _quantile(phase.get_s, 0.95),
        "get_max_s": round(max(phase.get_s), 3) if phase.get_s else None,
        "runs_finished": phase.runs_finished,
        "component_writes_locked_out": phase.lock_timeouts, "api_database_errors": phase.api_db_errors,
        "scheduler_alive_at_end": phase.scheduler_alive,
        "wall_s": round(phase.wall_s, 1), "main_job_cpu_s": round(phase.cpu_s, 1),
        "api_server_cpu_s": round(phase.api_cpu_s, 1), "postgres_cpu_s": round(phase.postgres_cpu_s, 1),
        "main_job_cpu_s_per_run": round(phase.cpu_s / phase.runs_finished, 2)
        if phase.runs_finished else None,
        "load_avg_1m_end": round(phase.load[0], 2), "load_avg_5m_end": round(phase.load[2], 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=150.0, help="seconds of triggering per phase (150)")
    parser.add_argument("--burners", type=int, default=4, help="CPU-bound processes beside the main job (4)")
    parser.add_argument("--active-runs", type=int, default=6,
                        help="DAG runs kept queued or running at once (6; the e2e test starts 5)")
    parser.add_argument("--probe-every", type=float, default=2.0,
                        help="seconds between the open-loop probe POSTs (2)")
    parser.add_argument("--metadb", choices=("default", "sqlite", "both"), default="both",
                        help="Airflow's database: run.sh's choice, SQLite, or SQLite then the default (both)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--keep", action="store_true", help="keep the temporary homes (logs)")
    args = parser.parse_args(argv)
    phases = ("sqlite", "default") if args.metadb == "both" else (args.metadb,)
    results = []
    for metadb in phases:
        print(f"{time.strftime('%H:%M:%S')} phase {metadb}: booting scripts/run.sh", file=sys.stderr)
        figures = summary(measure(metadb, duration=args.duration, burners=args.burners,
                                  active_runs=args.active_runs, probe_every=args.probe_every,
                                  keep=args.keep))
        print(json.dumps(figures), file=sys.stderr)
        results.append(figures)
    report = {"burners": args.burners, "duration_s": args.duration, "active_runs": args.active_runs,
              "probe_every_s": args.probe_every, "cpus": os.cpu_count(), "phases": results}
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0
