"""Migration between GPU types through real Airflow (``scripts/run.sh`` on SQLite, GPUExecutor, a
two-device simulated fleet of two models, ``[gpusched] preemption = migrate``).

A blocker holds the A100; a training task of job type ``resnet`` (10x faster on the A100, by the
throughput file) starts on the K80. The blocker ends; at the next migration round the executor
holds the A100 for the trainer's next try, pins that try to the A100 model and gives the trainer a
notice; the trainer checkpoints, is cleared and stopped by Airflow, and its next try — launched on
the held A100 — resumes from the checkpoint and succeeds without using a retry. No device is ever
held by two allocations at once.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
from _ledger_support import assert_whole_devices_never_shared
from _run_sh_support import Airflow, run_sh_airflow
from _run_sh_support import finished_ti as _finished_ti
from _run_sh_support import healthy as _healthy
from _run_sh_support import log_text as _log_text
from _run_sh_support import login as _login
from _run_sh_support import trigger as _trigger
from _run_sh_support import wait_for as _wait

from gpusched.scheduler.keys import ti_key

pytestmark = [pytest.mark.airflow, pytest.mark.slow]

MOVER, BLOCKER = "e2e_migrate_mover", "e2e_migrate_blocker"
FLEET = """
name: two-models
racks:
  - name: r1
    nodes:
      - name: fast
        cpu: 8
        memory: 32GiB
        devices: {model: A100-SXM-80GB, count: 1}
      - name: slow
        cpu: 8
        memory: 32GiB
        devices: {model: K80, count: 1}
"""
DAGS_SOURCE = '''
from __future__ import annotations

import json
import os
import time
from datetime import datetime
from pathlib import Path

from airflow.sdk import dag, task

from gpusched.airflow.authoring import gpu


@dag(dag_id="e2e_migrate_mover", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def e2e_migrate_mover():
    @task(task_id="train", retries=0, **gpu(gpus=1, job_type="resnet"))
    def train() -> int:
        from gpusched.airflow import checkpoint

        out = Path(os.environ["E2E_MIGRATE_DIR"])
        attempt = checkpoint.allocation_key().split("/")[4]
        models = json.loads(os.environ["GPUSCHED_ALLOCATION"])["models"]
        (out / f"models-try{attempt}").write_text(json.dumps(models))
        earlier = checkpoint.resume()
        first = earlier.step + 1 if earlier is not None else 0
        (out / f"start-try{attempt}").write_text(str(first))
        for step in range(first, 120):
            time.sleep(0.5)
            if step % 4 == 3 or checkpoint.preempted():
                checkpoint.report(step=step, path=str(out / "state"))
                if checkpoint.preempted():
                    (out / f"moved-try{attempt}").write_text(str(step))
                    checkpoint.wait_for_stop()
        return first

    train()


@dag(dag_id="e2e_migrate_blocker", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def e2e_migrate_blocker():
    @task(task_id="hold", **gpu(gpus=1, models=["A100-SXM-80GB"]))
    def hold() -> None:
        out = Path(os.environ["E2E_MIGRATE_DIR"])
        (out / "blocker-running").write_text("1")
        while not (out / "release-blocker").exists():
            time.sleep(0.5)

    hold()


e2e_migrate_mover()
e2e_migrate_blocker()
'''


@pytest.fixture(scope="module")
def airflow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Airflow]:
    home = tmp_path_factory.mktemp("airflow_home")
    dags = tmp_path_factory.mktemp("dags")
    (dags / "e2e_migrate.py").write_text(DAGS_SOURCE)
    (home / "fleet.yaml").write_text(FLEET)
    (home / "throughputs.json").write_text(json.dumps({"resnet": {"A100-SXM-80GB": 10.0, "K80": 1.0}}))
    out = home / "task-files"
    out.mkdir()
    yield from run_sh_airflow(home, dags, {
        "GPUSCHED_FLEET": str(home / "fleet.yaml"), "GPUSCHED_AGENT": "0", "E2E_MIGRATE_DIR": str(out),
        "AIRFLOW__GPUSCHED__PREEMPTION": "migrate",
        "AIRFLOW__GPUSCHED__THROUGHPUT_FILE": str(home / "throughputs.json"),
        # a short round so the test is quick: a move must pay back 1 s of restart within 5 s
        "AIRFLOW__GPUSCHED__MIGRATION_INTERVAL_SECONDS": "5",
        "AIRFLOW__GPUSCHED__MIGRATION_RESTART_SECONDS": "1",
        "AIRFLOW__GPUSCHED__PREEMPTION_GRACE_SECONDS": "30",
        "AIRFLOW__GPUSCHED__PREEMPTION_MIN_RUNTIME_SECONDS": "2",
        "AIRFLOW__GPUSCHED__REPLAN_BUDGET_MS": "0",
    })


def test_a_task_on_the_slow_model_moves_to_the_freed_fast_one_without_a_failed_try(airflow: Airflow) -> None:
    from gpusched.ledger import Ledger

    out = airflow.home / "task-files"
    _wait("the api-server, scheduler and dag-processor", lambda: _healthy(airflow), 300, airflow)
    airflow.token = _wait("a login token", lambda: _login(airflow), 60, airflow)
    _wait("the DAGs to be parsed", lambda: {MOVER, BLOCKER} <= {
        d["dag_id"] for d in airflow.api("GET", "/dags")["dags"]}, 180, airflow)

    def trigger(dag_id: str) -> str:
        return _trigger(airflow, dag_id)

    def finished(dag_id: str, run_id: str, task_id: str) -> dict[str, object] | None:
        return _finished_ti(airflow, dag_id, run_id, task_id)

    blocker_run = trigger(BLOCKER)
    _wait("the blocker on the A100", lambda: (out / "blocker-running").exists(), 180, airflow)
    mover_run = trigger(MOVER)
    _wait("the trainer on the K80", lambda: (out / "start-try1").exists(), 180, airflow)
    assert json.loads((out / "models-try1").read_text()) == ["K80"]
    time.sleep(12)  # two migration rounds with the A100 busy: nothing moves
    assert not (out / "moved-try1").exists()
    (out / "release-blocker").write_text("1")
    assert _wait("the blocker to finish", lambda: finished(BLOCKER, blocker_run, "hold"), 120, airflow,
                 interval=2)["state"] == "success"
    final = _wait("the trainer to finish", lambda: finished(MOVER, mover_run, "train"), 300, airflow,
                  interval=2)
    assert final["state"] == "success", final
    assert final["try_number"] == 2 and final["max_tries"] == 1, final  # moved, not a failed try
    assert (out / "moved-try1").exists()
    assert json.loads((out / "models-try2").read_text()) == ["A100-SXM-80GB"]
    assert int((out / "start-try2").read_text()) >= 1  # resumed from try 1's checkpoint

    ledger = Ledger(f"sqlite:///{airflow.home / 'gpusched' / 'ledger.db'}")
    try:
        first, second = ti_key(MOVER, "train", mover_run, 1), ti_key(MOVER, "train", mover_run, 2)
        (event,) = ledger.events(50, kinds=["migrated"])
        assert event.subject == first and event.detail["next_try"] == second
        assert (event.detail["from_model"], event.detail["to_model"]) == ("K80", "A100-SXM-80GB")
        history = ledger.history(0, time.time() + 1)
        old = next(a for a in history if a.key == first)
        assert str(old.release_reason).startswith("moving to A100-SXM-80GB"), old.release_reason
        new = next(a for a in history if a.key == second)
        assert [s.node for s in new.shares] == ["fast"]
        assert_whole_devices_never_shared(history)
        started = (out / "start-try2").stat().st_mtime
        print(f"\nmigration: notice -> old try released {old.released_at - event.at:.1f} s, "
              f"-> try 2 running on the A100 {started - event.at:.1f} s")
    finally:
        ledger.close()
    rows = airflow.api("GET", "/eventLogs", params={"event": "gpusched.migrated", "dag_id": MOVER})
    assert rows["total_entries"] == 1 and "moving to A100-SXM-80GB" in rows["event_logs"][0]["extra"]
    log = _log_text(airflow, MOVER, mover_run, "train", 1)
    assert "gpusched: moving to A100-SXM-80GB" in log and "does not use a retry" in log
