"""Quotas through real Airflow: a tenant over its GPU-hour budget waits, with the reason in its
task log and the queue view, while another tenant's task runs (``scripts/run.sh`` on SQLite).
The same Airflow runs with ``[gpusched] policy_parts = filter.whole-devices=on``: a half-GPU task
is given a whole device."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from _ledger_support import budget_period_around
from _run_sh_support import Airflow, run_sh_airflow
from _run_sh_support import healthy as _healthy
from _run_sh_support import log_text as _log_text
from _run_sh_support import login as _login
from _run_sh_support import wait_for as _wait

from gpusched.model import DeviceShare
from gpusched.scheduler.keys import ti_key

pytestmark = [pytest.mark.airflow, pytest.mark.slow]

DAG_ID = "e2e_gpu_quota"
DAG_SOURCE = """
from __future__ import annotations

from datetime import datetime

from airflow.sdk import dag, task

from gpusched.airflow.authoring import gpu


@dag(dag_id="e2e_gpu_quota", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def e2e_gpu_quota():
    for name in ("vision", "nlp"):
        @task(task_id=name, **gpu(gpus=1, models=["A100-SXM-80GB"], tenant=name))
        def one_gpu() -> None:
            pass

        one_gpu()

    @task(task_id="nlp_half", **gpu(gpus=0.5, memory="10GiB", tenant="nlp"))
    def half_gpu() -> None:
        pass

    half_gpu()


e2e_gpu_quota()
"""


@pytest.fixture(scope="module")
def airflow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Airflow]:
    home = tmp_path_factory.mktemp("airflow_home")
    dags = tmp_path_factory.mktemp("dags")
    (dags / f"{DAG_ID}.py").write_text(DAG_SOURCE)
    quota = home / "quota.yaml"
    # vision may spend 1 A100-hour a week; a task is charged 60 s unless it says otherwise.
    # The test charges 45 minutes of past use and may take a while: one period must hold both.
    period_s, _ = budget_period_around(time.time(), 2701, 1800)
    quota.write_text(f"budgets: {{vision: 1}}\nperiod_s: {period_s}\ndefault_duration_s: 60\n")
    yield from run_sh_airflow(home, dags, {"GPUSCHED_QUOTA_FILE": str(quota),
                                           "AIRFLOW__GPUSCHED__POLICY_PARTS": "filter.whole-devices=on"})


def test_tenant_over_budget_waits_with_the_reason_while_another_tenant_runs(airflow: Airflow) -> None:
    import httpx

    from gpusched.ledger import Ledger

    _wait("the api-server, scheduler and dag-processor", lambda: _healthy(airflow), 300, airflow)
    airflow.token = _wait("a login token", lambda: _login(airflow), 60, airflow)
    _wait("the DAG to be parsed", lambda: DAG_ID in {
        d["dag_id"] for d in airflow.api("GET", "/dags")["dags"]}, 180, airflow)
    ledger = Ledger(f"sqlite:///{airflow.home / 'gpusched' / 'ledger.db'}")
    try:
        # vision's use this week so far: 2 A100s for 45 minutes = 1.5 A100-h (budget 1).
        from gpusched.request import GPURequest

        now = time.time()
        shares = [DeviceShare(f"GPU-sim-a-a100-1-{i}", "a-a100-1", i, 1000, 0) for i in range(2)]
        ledger.allocate("earlier-vision", GPURequest.build(gpus=2, tenant="vision"), shares,
                        holder="earlier", now=now - 2701)
        ledger.release("earlier-vision", reason="done", now=now - 1)
        airflow.api("PATCH", f"/dags/{DAG_ID}", json={"is_paused": False})
        run_id = airflow.api("POST", f"/dags/{DAG_ID}/dagRuns", json={"logical_date": None})["dag_run_id"]

        def state(task_id: str) -> str:
            path = f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/{task_id}"
            return str(airflow.api("GET", path)["state"])

        _wait("the nlp task to succeed", lambda: state("nlp") == "success", 300, airflow, interval=2)
        _wait("the half-GPU task to succeed", lambda: state("nlp_half") == "success", 300, airflow,
              interval=2)
        half = ledger.get(ti_key(DAG_ID, "nlp_half", run_id, 1))
        assert half is not None and [s.milli for s in half.shares] == [1000], half  # policy_parts at work
        key = ti_key(DAG_ID, "vision", run_id, 1)
        entry = _wait("vision to be held in the queue", lambda: [e for e in ledger.queue() if e.key == key],
                      120, airflow)[0]
        assert entry.reason.startswith("tenant vision used 1.5 of 1.0 A100-h this "), entry.reason
        assert " UTC" in entry.reason.partition("resets ")[2], entry.reason
        assert state("vision") == "queued" and ledger.get(key) is None
        # The queue view of the fleet page and the task's own log say why.
        queue = httpx.get(f"{airflow.url}/gpusched/queue", headers=airflow.headers(), timeout=30).json()
        assert [q["reason"] for q in queue if q["key"] == key] == [entry.reason]
        text = _wait("the reason in vision's log", lambda: (lambda t: t if entry.reason in t else "")(
            _log_text(airflow, DAG_ID, run_id, "vision", 1)), 60, airflow)
        assert "waiting for GPUs: tenant vision used" in text
    finally:
        ledger.close()


