"""Fault injection on real Airflow: kill a worker, a task, the scheduler and the ledger's database.

One Airflow 3.3 instance (api-server, dag-processor and scheduler as separate processes, SQLite
metadata) runs the GPU executor on the simulated fleet; the ledger lives on a private PostgreSQL
server when the server binaries are installed (else SQLite, and the database-server scenario
skips). The scenarios run in order on that instance:

1. worker death: SIGKILL the LocalExecutor worker running a GPU task and its task process → the
   devices are free within 10 s and Airflow retries the task (try 2 gets devices);
2. task death: SIGKILL only the task process → released at once, and the release reason names
   the task's real outcome (failed), not the executor's "success";
3. scheduler crash: SIGKILL the scheduler with its workers and tasks, restart it → the old try's
   devices are free within 30 s of the restart, and the retry runs;
4. database server killed (PostgreSQL ledger): SIGKILL the server under a running task, restart it
   10 s later → the scheduler survives, the task finishes, its devices are released, a new task
   gets devices;
5. frozen writer: a process SIGSTOPped inside a ledger write transaction for 20 s → the scheduler
   job keeps heartbeating (its longest gap exceeds the unfrozen one by no more than the executor's
   ledger wait bound plus slack), the GPU task waits, and runs once the writer is gone.

After every scenario: no device is ever over-committed and no try holds two allocations in the
ledger's whole history (replayed in commit order); at the end no allocation is left held.
Measured recovery times are printed (``-s``) and recorded in docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import secrets
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from gpusched.airflow.metadb import enable_wal
from gpusched.deploy.airflow_instance import free_port
from gpusched.ledger import Allocation, Ledger
from gpusched.scheduler.keys import ti_key

pytestmark = [pytest.mark.airflow, pytest.mark.faults, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
DAG_ID = "faults_hold"
DAG_SOURCE = """
from __future__ import annotations

import os
import time
from datetime import datetime, timedelta

from airflow.sdk import dag, task

from gpusched.airflow.authoring import gpu


@dag(dag_id="faults_hold", schedule=None, start_date=datetime(2026, 1, 1), catchup=False,
     params={"seconds": 600, "stop": ""},
     default_args={"retries": 1, "retry_delay": timedelta(seconds=1)})
def faults_hold():
    @task(task_id="hold", **gpu(gpus=1, models=["H100-SXM-80GB"]))
    def hold(params=None) -> None:
        # Holds its GPU for `seconds`, or until the test creates the `stop` file.
        end = time.time() + float(params["seconds"])
        while time.time() < end and not (params["stop"] and os.path.exists(params["stop"])):
            time.sleep(0.5)

    hold()


faults_hold()
"""
WORKER_BOUND_S = 10.0
RESTART_BOUND_S = 30.0
LEDGER_WAIT_S = 2.0  # [gpusched] ledger_wait_seconds for this instance (default 5)


@dataclass
class Instance:
    home: Path
    env: dict[str, str]
    ledger_url: str
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    postgres: Any = None
    figures: dict[str, float] = field(default_factory=dict)

    def start(self, component: str, *args: str) -> subprocess.Popen[bytes]:
        log = (self.home / f"{component}.log").open("ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "airflow", component, *args], env=self.env, cwd=self.home,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        self.procs[component] = proc
        return proc

    def cli(self, *args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "airflow", *args], env=self.env, cwd=self.home,
                              capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, f"airflow {' '.join(args)}: {done.stdout[-2000:]}{done.stderr[-2000:]}"
        return done.stdout

    def tail(self, component: str = "scheduler") -> str:
        path = self.home / f"{component}.log"
        return path.read_text(errors="replace")[-5000:] if path.exists() else ""

    def ti(self, run_id: str) -> tuple[int, str | None] | None:
        with sqlite3.connect(f"file:{self.home / 'airflow.db'}?mode=ro", uri=True, timeout=30) as db:
            row = db.execute(
                "SELECT try_number, state FROM task_instance WHERE dag_id=? AND run_id=? AND task_id='hold'",
                (DAG_ID, run_id),
            ).fetchone()
        return None if row is None else (int(row[0]), row[1])

    def end_date(self, run_id: str) -> float:
        with sqlite3.connect(f"file:{self.home / 'airflow.db'}?mode=ro", uri=True, timeout=30) as db:
            (text,) = db.execute(
                "SELECT end_date FROM task_instance WHERE dag_id=? AND run_id=? AND task_id='hold'",
                (DAG_ID, run_id),
            ).fetchone()
        return _epoch(text)

    def scheduler_heartbeat(self) -> float | None:
        with sqlite3.connect(f"file:{self.home / 'airflow.db'}?mode=ro", uri=True, timeout=30) as db:
            row = db.execute(
                "SELECT max(latest_heartbeat) FROM job WHERE job_type='SchedulerJob' AND state='running'"
            ).fetchone()
        return None if row is None or row[0] is None else _epoch(row[0])

    def trigger(self, run_id: str, seconds: float) -> None:
        conf = {"seconds": seconds, "stop": str(self.home / "stop")}
        self.cli("dags", "trigger", DAG_ID, "--run-id", run_id, "--conf", json.dumps(conf))


def _epoch(text: str) -> float:
    from datetime import UTC, datetime

    stamp = datetime.fromisoformat(str(text))
    return (stamp if stamp.tzinfo else stamp.replace(tzinfo=UTC)).timestamp()


def _wait(
    what: str, check: Callable[[], Any], timeout: float, instance: Instance, interval: float = 0.5
) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, proc in instance.procs.items():
            if proc.poll() is not None and name != "scheduler-killed":
                pytest.fail(f"airflow {name} exited ({proc.returncode}) waiting for {what}:\n"
                            f"{instance.tail(name)}")
        try:
            result = check()
        except Exception:  # not there yet (or the database is down on purpose)
            result = None
        if result:
            return result
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}:\n{instance.tail()}")


def _kill_tree(pid: int) -> list[int]:
    import psutil

    try:
        root = psutil.Process(pid)
        family = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    for proc in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(signal.SIGKILL)
    psutil.wait_procs(family, timeout=20)
    return [p.pid for p in family]


@pytest.fixture(scope="module")
def instance(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Instance]:
    from _fault_support import PrivatePostgres, postgres_binaries

    home = tmp_path_factory.mktemp("faults_airflow")
    dags = home / "dags"
    dags.mkdir()
    (dags / f"{DAG_ID}.py").write_text(DAG_SOURCE)
    postgres = PrivatePostgres() if postgres_binaries() else None
    if postgres is not None:
        postgres.__enter__()
    ledger_url = postgres.url if postgres is not None else f"sqlite:///{home / 'ledger.db'}"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "GPUSCHED"))}
    env.update({
        "PYTHONPATH": str(REPO),
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
        # As scripts/run.sh: WAL (below) and a 60 s lock wait for Airflow's SQLite database.
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS": "gpusched.airflow.metadb.SQLITE_CONNECT_ARGS",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS_ASYNC": "gpusched.airflow.metadb.SQLITE_CONNECT_ARGS",
        "AIRFLOW__CORE__EXECUTOR": "gpusched.airflow.executor.GPUExecutor",
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
        "AIRFLOW__CORE__PARALLELISM": "4",
        "AIRFLOW__API__HOST": "127.0.0.1",
        "AIRFLOW__API__PORT": str(port),
        "AIRFLOW__API__BASE_URL": f"http://127.0.0.1:{port}",
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{port}/execution/",
        "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_hex(32),
        "AIRFLOW__API__SECRET_KEY": secrets.token_hex(32),
        "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
        # A task whose supervisor died is failed (and retried) after this long without heartbeat.
        "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": "20",
        "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "5",
        # After a scheduler crash Airflow resets the dead job's tasks (a new try) once the job
        # counts as dead and the orphan check runs: defaults 30 s and 300 s, shortened here.
        "AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_THRESHOLD": "15",
        "AIRFLOW__SCHEDULER__ORPHANED_TASKS_CHECK_INTERVAL": "10",
        "AIRFLOW__GPUSCHED__LEDGER_WAIT_SECONDS": str(LEDGER_WAIT_S),
        "GPUSCHED_BACKEND": "simulated",
        "GPUSCHED_DB_URL": ledger_url,
    })
    inst = Instance(home, env, ledger_url, postgres=postgres)
    try:
        inst.cli("db", "migrate")
        enable_wal(home / "airflow.db")
        inst.start("api-server")
        inst.start("dag-processor")
        inst.start("scheduler")
        _wait("the DAG to be parsed", lambda: _dag_parsed(inst), 240, inst, interval=2)
        yield inst
    finally:
        for proc in inst.procs.values():
            if proc.poll() is None:
                _kill_tree(proc.pid)
        if postgres is not None:
            postgres.__exit__(None, None, None)
        if inst.figures:
            print("\nfault recovery figures (s):", json.dumps(inst.figures, indent=1))


def _dag_parsed(inst: Instance) -> bool:
    with sqlite3.connect(f"file:{inst.home / 'airflow.db'}?mode=ro", uri=True, timeout=30) as db:
        return db.execute("SELECT 1 FROM dag WHERE dag_id=?", (DAG_ID,)).fetchone() is not None


def _ledger(inst: Instance) -> Ledger:
    return Ledger(inst.ledger_url, lock_wait_s=5.0)


def _allocation(inst: Instance, run_id: str, try_number: int) -> Allocation | None:
    with _ledger(inst) as ledger:
        return ledger.get(ti_key(DAG_ID, "hold", run_id, try_number))


def _held_with(inst: Instance, run_id: str, try_number: int, *roles: str) -> Allocation | None:
    alloc = _allocation(inst, run_id, try_number)
    if alloc is None or not alloc.active:
        return None
    return alloc if set(roles) <= {p.role for p in alloc.processes} else None


def _pid(alloc: Allocation, role: str) -> int:
    return next(p.pid for p in reversed(alloc.processes) if p.role == role)


def _assert_never_overcommitted(inst: Instance) -> None:
    from gpusched.ledger.audit import audit

    with _ledger(inst) as ledger:
        violations = audit(ledger)
    assert violations == [], violations[:5]


def test_worker_death_frees_the_devices_within_10s_and_airflow_retries(instance: Instance) -> None:
    run = "worker_death"
    instance.trigger(run, 600)
    alloc = _wait("try 1 to run on its devices", lambda: _held_with(instance, run, 1, "worker", "task"),
                  180, instance)
    worker = _pid(alloc, "worker")
    killed_at = time.time()
    _kill_tree(worker)  # the worker and the task process it supervises
    released = _wait("the dead worker's devices to be released",
                     lambda: (a := _allocation(instance, run, 1)) and not a.active and a, 60, instance, 0.2)
    took = released.released_at - killed_at
    instance.figures["worker_death_release_s"] = round(took, 2)
    assert took <= WORKER_BOUND_S, f"released {took:.1f} s after the worker died"
    assert "worker process" in (released.release_reason or "")
    # Airflow retries the failed try; it gets devices again.
    _wait("try 2 to get devices", lambda: _held_with(instance, run, 2), 120, instance)
    _assert_never_overcommitted(instance)


def test_task_death_is_released_with_the_tasks_real_outcome(instance: Instance) -> None:
    run = "worker_death"  # its try 2 (the last one) is running now
    alloc = _wait("try 2 to run", lambda: _held_with(instance, run, 2, "worker", "task"), 120, instance)
    worker = _pid(alloc, "worker")
    os.kill(_pid(alloc, "task"), signal.SIGKILL)
    released = _wait("the killed task's devices to be released",
                     lambda: (a := _allocation(instance, run, 2)) and not a.active and a, 60, instance, 0.2)
    reason = released.release_reason or ""
    assert "success" not in reason and ("failed" in reason or "up_for_retry" in reason), reason
    assert (instance.ti(run) or (0, None))[1] == "failed"
    import psutil

    assert psutil.pid_exists(worker), "only the task was killed; its worker lives on"
    _assert_never_overcommitted(instance)


def test_scheduler_crash_frees_capacity_within_30s_of_the_restart(instance: Instance) -> None:
    run = "scheduler_crash"
    instance.trigger(run, 600)
    _wait("try 1 to run on its devices", lambda: _held_with(instance, run, 1, "worker", "task"),
          180, instance)
    scheduler = instance.procs["scheduler"]
    _kill_tree(scheduler.pid)  # scheduler, its LocalExecutor workers and their tasks
    scheduler.wait(timeout=30)
    instance.procs["scheduler-killed"] = instance.procs.pop("scheduler")
    time.sleep(3)
    assert (alloc := _allocation(instance, run, 1)) is not None and alloc.active  # nobody released it
    restarted_at = time.time()
    instance.start("scheduler")
    released = _wait("the crashed try's devices to be released",
                     lambda: (a := _allocation(instance, run, 1)) and not a.active and a, 120, instance, 0.5)
    took = released.released_at - restarted_at
    instance.figures["scheduler_restart_release_s"] = round(took, 2)
    assert took <= RESTART_BOUND_S, f"capacity back {took:.1f} s after the restart"
    # Airflow fails the orphaned try (no heartbeat) and retries it on devices.
    _wait("try 2 to get devices", lambda: _held_with(instance, run, 2), 180, instance)
    _assert_never_overcommitted(instance)


def test_ledger_database_server_killed_under_a_running_task(instance: Instance) -> None:
    if instance.postgres is None:
        pytest.skip("PostgreSQL server binaries are not installed: the ledger is SQLite (no server)")
    run = "db_server_killed"
    instance.trigger(run, 25)
    _wait("the task to run on its devices", lambda: _held_with(instance, run, 1, "worker", "task"),
          180, instance)
    instance.postgres.kill()
    time.sleep(10)
    assert instance.procs["scheduler"].poll() is None, "the scheduler died with the ledger database"
    instance.postgres.start()
    _wait("the task to succeed", lambda: (instance.ti(run) or (0, None))[1] == "success", 120, instance, 1)
    released = _wait("its devices to be released",
                     lambda: (a := _allocation(instance, run, 1)) and not a.active and a, 60, instance, 0.5)
    ended = instance.end_date(run)
    instance.figures["db_restart_task_end_to_release_s"] = round(released.released_at - ended, 2)
    after = "after_db_restart"
    instance.trigger(after, 1)
    _wait("a new task to get devices and succeed", lambda: (instance.ti(after) or (0, None))[1] == "success",
          120, instance, 1)
    _assert_never_overcommitted(instance)


FREEZER = """
import os, signal, sys
from gpusched.ledger import Ledger
from gpusched.ledger.engine import write_tx
with write_tx(Ledger(sys.argv[1]).engine) as conn:
    # SQLite: BEGIN IMMEDIATE holds the write lock; PostgreSQL: this holds every device row.
    conn.exec_driver_sql("UPDATE gpusched_devices SET updated_at = updated_at")
    print("locked", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
"""


def _heartbeat_gaps(instance: Instance, seconds: float) -> float:
    """The longest time between the scheduler job's heartbeats seen over ``seconds``."""
    started = time.time()
    beats: list[float] = []
    while time.time() - started < seconds:
        beat = instance.scheduler_heartbeat()
        if beat is not None and (not beats or beat != beats[-1]):
            beats.append(beat)
        time.sleep(0.25)
    gaps = [b - a for a, b in itertools.pairwise(beats)]
    return max([*gaps, time.time() - beats[-1]]) if beats else float("inf")


def test_frozen_ledger_writer_does_not_stall_the_scheduler_loop(instance: Instance) -> None:
    """A writer SIGSTOPped inside its ledger transaction for 20 s: the scheduler keeps looping.

    The scheduler job heartbeats every ``scheduler_heartbeat_sec`` (5 s) from its loop; the longest
    gap while the writer is frozen may exceed the longest gap of the same instance unfrozen by at
    most the executor's ledger wait bound (plus slack for a loaded machine). Without the bound a
    heartbeat waited SQLite's 60 s busy timeout (PostgreSQL: for ever).
    """
    baseline = _heartbeat_gaps(instance, 12)
    instance.figures["baseline_worst_scheduler_heartbeat_gap_s"] = round(baseline, 2)
    script = instance.home / "freezer.py"
    script.write_text(FREEZER)
    frozen = subprocess.Popen([sys.executable, str(script), instance.ledger_url], stdout=subprocess.PIPE,
                              text=True, env=instance.env)
    run = "frozen_writer"
    try:
        assert frozen.stdout is not None and frozen.stdout.readline().strip() == "locked"
        instance.trigger(run, 1)
        worst = _heartbeat_gaps(instance, 20)
        assert (instance.ti(run) or (0, None))[1] in (None, "scheduled", "queued"), "ran on a frozen ledger?"
    finally:
        frozen.kill()
        frozen.wait(timeout=30)
    instance.figures["frozen_writer_worst_scheduler_heartbeat_gap_s"] = round(worst, 2)
    assert worst <= baseline + LEDGER_WAIT_S + 4.0, f"worst gap {worst:.1f} s (unfrozen: {baseline:.1f} s)"
    thawed = time.time()
    _wait("the GPU task to run once the writer is gone",
          lambda: (instance.ti(run) or (0, None))[1] == "success", 120, instance, 1)
    instance.figures["frozen_writer_thaw_to_task_success_s"] = round(time.time() - thawed, 2)


def test_nothing_is_left_held(instance: Instance) -> None:
    (instance.home / "stop").touch()  # the retries still holding GPUs finish now

    def settled() -> bool:
        with _ledger(instance) as ledger:
            return not ledger.active()

    _wait("every allocation to be released", settled, 120, instance, 1)
    assert (instance.ti("scheduler_crash") or (0, None))[1] == "success"
    _assert_never_overcommitted(instance)
