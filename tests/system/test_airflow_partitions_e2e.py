"""The 70/20/10 partitions and hard GPU-hour budgets through real Airflow on the local executor
(``scripts/run.sh``, GPUExecutor, a simulated fleet of one K80 and one A100, a quota file in
force; the tasks ask for the A100, and the partitions' shares count both GPUs):

- ``[gpusched] preemption = partitions``: a ``dev`` task borrowed the A100 beyond its partition's
  share; a ``training`` task reclaims it. The dev task gets the notice, checkpoints, is stopped
  and requeued without using a retry, and its next try resumes from the checkpoint.
- ``[gpusched] over_budget = stop``: a task of tenant ``vision`` runs past the tenant's budget
  (0.01 A100-hour); the executor fails it with the reason in its log and Airflow's supervisor
  stops its process before its work is done.

``test_celery_preemption_modes.py`` covers the same partitions rule on the Celery executor.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
from _ledger_support import assert_whole_devices_never_shared, budget_period_around
from _run_sh_support import Airflow, finished_ti, run_sh_airflow, trigger
from _run_sh_support import healthy as _healthy
from _run_sh_support import log_text as _log_text
from _run_sh_support import login as _login
from _run_sh_support import wait_for as _wait

from gpusched.scheduler.keys import ti_key

pytestmark = [pytest.mark.airflow, pytest.mark.slow]

FLEET = """
name: k80-and-a100
racks:
  - name: r1
    nodes:
      - name: slow
        cpu: 8
        memory: 32GiB
        devices: {model: K80, count: 1}
      - name: fast
        cpu: 8
        memory: 32GiB
        devices: {model: A100-SXM-80GB, count: 1}
"""
DAGS_SOURCE = '''
from __future__ import annotations

import json
import os
import time
from datetime import datetime
from pathlib import Path

from airflow.sdk import dag, get_current_context, task

from gpusched.airflow.authoring import gpu

OUT = Path(os.environ["E2E_OUT"])
A100 = ["A100-SXM-80GB"]


@dag(dag_id="pt_dev", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def pt_dev():
    @task(task_id="borrow", retries=0, **gpu(gpus=1, models=A100, partition="dev"))
    def borrow() -> None:
        """Steps of 0.5 s, a checkpoint every 4; the first try runs until it is preempted, a later
        one resumes from the checkpoint and ends 4 steps later."""
        from gpusched.airflow import checkpoint

        attempt = get_current_context()["ti"].try_number
        earlier = checkpoint.resume()
        first = earlier.step + 1 if earlier is not None else 0
        (OUT / f"borrow-try{attempt}").write_text(str(first))
        for step in range(first, 1200 if attempt == 1 else first + 4):
            time.sleep(0.5)
            if step % 4 == 3 or checkpoint.preempted():
                checkpoint.report(step=step, path=str(OUT / "borrow.state"))
                (OUT / f"borrow-checkpoint-try{attempt}").write_text(str(step))
                if checkpoint.preempted():
                    (OUT / f"borrow-preempted-try{attempt}").write_text(os.environ["GPUSCHED_PREEMPTED"])
                    checkpoint.wait_for_stop()

    borrow()


@dag(dag_id="pt_training", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def pt_training():
    @task(task_id="reclaim", **gpu(gpus=1, models=A100, partition="training"))
    def reclaim() -> None:
        time.sleep(1)

    reclaim()


@dag(dag_id="pt_vision", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def pt_vision():
    @task(task_id="spend", retries=0, **gpu(gpus=1, models=A100, tenant="vision", partition="training"))
    def spend() -> None:
        (OUT / "spend.json").write_text(json.dumps({"pid": os.getpid(), "at": time.time()}))
        time.sleep(300)
        (OUT / "spend-done").write_text("never: the budget runs out first")

    spend()


pt_dev()
pt_training()
pt_vision()
'''
DAG_IDS = {"pt_dev", "pt_training", "pt_vision"}
BUDGET_S = 36.0
"""vision's budget, 0.01 A100-hour: the spender crosses it 36 s into its run."""


@pytest.fixture(scope="module")
def airflow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Airflow]:
    home = tmp_path_factory.mktemp("airflow_home")
    dags = tmp_path_factory.mktemp("dags")
    (dags / "e2e_partitions.py").write_text(DAGS_SOURCE)
    (home / "fleet.yaml").write_text(FLEET)
    out = home / "task-files"
    out.mkdir()
    period_s, _ = budget_period_around(time.time(), 0, 1800)
    # A task is charged 10 s up front (so the spender is admitted); its use is counted as it runs.
    (home / "quota.yaml").write_text(
        "shares: {training: 70, burst: 20, dev: 10}\nborrowing: true\n"
        f"budgets: {{vision: {BUDGET_S / 3600}}}\nperiod_s: {period_s}\ndefault_duration_s: 10\n")
    yield from run_sh_airflow(home, dags, {
        "GPUSCHED_FLEET": str(home / "fleet.yaml"), "GPUSCHED_QUOTA_FILE": str(home / "quota.yaml"),
        "E2E_OUT": str(out),
        "AIRFLOW__GPUSCHED__PREEMPTION": "partitions",
        "AIRFLOW__GPUSCHED__PREEMPTION_GRACE_SECONDS": "30",
        "AIRFLOW__GPUSCHED__PREEMPTION_MIN_RUNTIME_SECONDS": "2",
        "AIRFLOW__GPUSCHED__OVER_BUDGET": "stop",
        "AIRFLOW__GPUSCHED__RECONCILE_SECONDS": "2",
    })


@pytest.fixture(scope="module")
def ready(airflow: Airflow) -> Airflow:
    _wait("the api-server, scheduler and dag-processor", lambda: _healthy(airflow), 300, airflow)
    airflow.token = _wait("a login token", lambda: _login(airflow), 60, airflow)
    _wait("the DAGs to be parsed", lambda: {
        d["dag_id"] for d in airflow.api("GET", "/dags")["dags"]} >= DAG_IDS, 180, airflow)
    return airflow


def _ledger(airflow: Airflow) -> Any:
    from gpusched.ledger import Ledger

    return Ledger(f"sqlite:///{airflow.home / 'gpusched' / 'ledger.db'}")


def _outcome(airflow: Airflow, dag_id: str, run_id: str, task_id: str) -> dict[str, Any]:
    return dict(_wait(f"{dag_id}.{task_id} to finish", lambda: finished_ti(airflow, dag_id, run_id, task_id),
                      300, airflow, interval=2))


def test_a_training_task_reclaims_the_a100_a_dev_task_borrowed(ready: Airflow) -> None:
    airflow, out = ready, ready.home / "task-files"
    borrow_run = trigger(airflow, "pt_dev")
    _wait("the dev task's first checkpoint", lambda: (out / "borrow-checkpoint-try1").exists(), 240, airflow)
    reclaim_run = trigger(airflow, "pt_training")
    reclaim = _outcome(airflow, "pt_training", reclaim_run, "reclaim")
    assert (reclaim["state"], reclaim["try_number"]) == ("success", 1), reclaim
    borrow = _outcome(airflow, "pt_dev", borrow_run, "borrow")
    # Succeeded in its second try with no retry used (retries=0: max_tries follows the try).
    assert (borrow["state"], borrow["try_number"], borrow["max_tries"]) == ("success", 2, 1), borrow
    assert "preempted for" in str(borrow["note"]), borrow
    assert (out / "borrow-preempted-try1").read_text() == "1"
    assert int((out / "borrow-try2").read_text()) >= 4  # resumed from try 1's checkpoint

    ledger = _ledger(airflow)
    try:
        victim = ti_key("pt_dev", "borrow", borrow_run, 1)
        winner = ti_key("pt_training", "reclaim", reclaim_run, 1)
        (event,) = [e for e in ledger.events(50, kinds=["preempted"]) if "pt_dev" in e.subject]
        assert (event.subject, event.detail["by"]) == (victim, winner), event
        assert "partition 'dev' runs on capacity borrowed beyond its share; 'training' reclaims it" in str(
            event.detail["reason"]), event.detail
        history = ledger.history(0, time.time() + 1)
        (stopped,) = [a for a in history if a.key == victim]
        (reclaimed,) = [a for a in history if a.key == winner]
        assert str(stopped.release_reason).startswith("preempted for"), stopped.release_reason
        assert reclaimed.created_at >= stopped.released_at  # only once the borrower let go
        assert_whole_devices_never_shared(history)
    finally:
        ledger.close()
    text = _log_text(airflow, "pt_dev", borrow_run, "borrow", 1)
    assert "reclaims it" in text, text[-2000:]


def test_a_task_past_its_tenants_hard_budget_is_stopped(ready: Airflow) -> None:
    airflow, out = ready, ready.home / "task-files"
    run_id = trigger(airflow, "pt_vision")
    spend = _outcome(airflow, "pt_vision", run_id, "spend")
    assert spend["state"] == "failed", spend
    started = json.loads((out / "spend.json").read_text())
    # Its process is stopped (Airflow's supervisor, told the try failed), long before its work ends.
    _wait("the spender's process to end", lambda: not _alive(started["pid"]), 60, airflow)
    assert not (out / "spend-done").exists()
    key = ti_key("pt_vision", "spend", run_id, 1)
    ledger = _ledger(airflow)
    try:
        (event,) = ledger.events(10, kinds=["over_budget"], subject=key)
        assert event.detail["action"] == "stop", event.detail
        (alloc,) = [a for a in ledger.history(0, time.time() + 1) if a.key == key]
        assert alloc.released_at is not None and alloc.released_at - alloc.created_at >= BUDGET_S - 1, alloc
    finally:
        ledger.close()
    text = _log_text(airflow, "pt_vision", run_id, "spend", 1)
    assert "tenant vision used" in text and "stopping this task ([gpusched] over_budget = stop)" in text, \
        text[-2000:]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
