"""The genetic re-planner through real Airflow (``scripts/run.sh``), with quotas in force.

Four fractional tasks of one run reach the executor in one cycle on a fleet of two nodes of two
A100s. The policy's greedy plan packs the three half-GPU tasks on n1 and cuts the quarter-GPU
task into the untouched node n2; the re-planner puts the quarter beside a half on n1 and leaves n2
whole for a task that needs whole GPUs. The moved task's log says so. A quota file (budgets and
the 70/20/10 partitions) is in force all along, as the main job ships one.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from _run_sh_support import Airflow, finished_ti, run_sh_airflow, trigger
from _run_sh_support import healthy as _healthy
from _run_sh_support import log_text as _log_text
from _run_sh_support import login as _login
from _run_sh_support import wait_for as _wait

from gpusched.scheduler.keys import ti_key

pytestmark = [pytest.mark.airflow, pytest.mark.slow]

DAG_ID = "e2e_gpu_replan"
DAG_SOURCE = """
from __future__ import annotations

from datetime import datetime

from airflow.sdk import dag, task

from gpusched.airflow.authoring import gpu


@dag(dag_id="e2e_gpu_replan", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def e2e_gpu_replan():
    for name in ("half_a", "half_b", "half_c"):
        @task(task_id=name, **gpu(gpus=0.5, memory="20GiB", expected_duration="10m", tenant="research"))
        def half() -> None:
            import time
            time.sleep(20)  # all four hold their devices at once

        half()

    @task(task_id="quarter", **gpu(gpus=0.25, memory="10GiB", tenant="research"))
    def quarter() -> None:
        import time
        time.sleep(20)

    quarter()


e2e_gpu_replan()
"""

FLEET = """name: replan
racks:
  - name: r1
    nodes:
      - {name: n1, cpu: 32, memory: 256GiB, devices: {model: A100-SXM-80GB, count: 2}}
      - {name: n2, cpu: 32, memory: 256GiB, devices: {model: A100-SXM-80GB, count: 2}}
"""

QUOTA = """shares: {training: 70, burst: 20, dev: 10}
borrowing: true
budgets: {research: 50}
period_s: 604800
default_duration_s: 3600
"""


@pytest.fixture(scope="module")
def airflow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Airflow]:
    home = tmp_path_factory.mktemp("airflow_home")
    dags = tmp_path_factory.mktemp("dags")
    (dags / f"{DAG_ID}.py").write_text(DAG_SOURCE)
    (home / "fleet.yaml").write_text(FLEET)
    (home / "quota.yaml").write_text(QUOTA)
    yield from run_sh_airflow(home, dags, {
        "GPUSCHED_FLEET": str(home / "fleet.yaml"),
        "GPUSCHED_QUOTA_FILE": str(home / "quota.yaml"),
        # A budget that the generation cap (200) binds before, so that the search ends where it
        # would on an idle machine (the default, 100 ms, is a time budget).
        "AIRFLOW__GPUSCHED__REPLAN_BUDGET_MS": "5000",
    })


def test_the_re_planner_keeps_a_node_whole_and_says_so_with_quotas_in_force(airflow: Airflow) -> None:
    import httpx

    from gpusched.ledger import Ledger

    _wait("the api-server, scheduler and dag-processor", lambda: _healthy(airflow), 300, airflow)
    airflow.token = _wait("a login token", lambda: _login(airflow), 60, airflow)
    _wait("the DAG to be parsed", lambda: DAG_ID in {
        d["dag_id"] for d in airflow.api("GET", "/dags")["dags"]}, 180, airflow)
    quotas = httpx.get(f"{airflow.url}/gpusched/quotas", headers=airflow.headers(), timeout=30).json()
    assert quotas["enforced"] is True, quotas
    run_id = trigger(airflow, DAG_ID)
    tasks = ("half_a", "half_b", "half_c", "quarter")
    ledger = Ledger(f"sqlite:///{airflow.home / 'gpusched' / 'ledger.db'}")
    try:
        held = _wait("all four tasks placed", lambda: (lambda got: got if all(got.values()) else None)(
            {t: ledger.get(ti_key(DAG_ID, t, run_id, 1)) for t in tasks}), 300, airflow)
        nodes = {t: {s.node for s in a.shares} for t, a in held.items()}
        assert set().union(*nodes.values()) == {"n1"}, nodes  # n2 left whole (greedy cut into it)
        for t in tasks:
            assert _wait(f"{t} to finish", lambda t=t: finished_ti(airflow, DAG_ID, run_id, t), 300,
                         airflow)["state"] == "success"
        logs = {t: _log_text(airflow, DAG_ID, run_id, t, 1) for t in tasks}
        moved = [t for t in tasks if "placed by the batch re-planner" in logs[t]]
        assert "quarter" in moved, moved
        text = logs["quarter"]
        assert "fragmentation" in text.partition("placed by the batch re-planner:")[2][:200], text[-2000:]
    finally:
        ledger.close()
