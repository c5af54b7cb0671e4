"""A MIG profile no instance of the fleet offers, through real Airflow on the local executor
(``scripts/run.sh``, GPUExecutor, a simulated fleet of one A100 not in MIG mode, the agent run.sh
starts with ``GPUSCHED_DYNAMIC_MIG=local``): the task waits with the re-partition reason instead of
failing as never fitting, the agent re-partitions the A100, and the task runs on the new MIG
instance, seeing its ``MIG-…`` UUID."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from _run_sh_support import Airflow, finished_ti, run_sh_airflow, trigger
from _run_sh_support import healthy as _healthy
from _run_sh_support import log_text as _log_text
from _run_sh_support import login as _login
from _run_sh_support import wait_for as _wait

pytestmark = [pytest.mark.airflow, pytest.mark.slow]

GPU = "GPU-sim-only-0"
FLEET = """
name: one-a100
racks:
  - name: r1
    nodes:
      - name: only
        cpu: 8
        memory: 32GiB
        devices: {model: A100-SXM-80GB, count: 1}
"""
DAG_SOURCE = '''
from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path

from airflow.sdk import dag, task

from gpusched.airflow.authoring import gpu

OUT = Path(os.environ["E2E_OUT"])


@dag(dag_id="dm_serve", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def dm_serve():
    @task(task_id="serve", retries=0, **gpu(gpus=0.5, memory="30GiB", profile="4g.40gb"))
    def serve() -> None:
        seen = f"{os.environ.get('CUDA_VISIBLE_DEVICES')} {os.environ.get('GPUSCHED_ISOLATION')}"
        (OUT / "serve").write_text(seen)

    serve()


dm_serve()
'''


@pytest.fixture(scope="module")
def airflow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Airflow]:
    home = tmp_path_factory.mktemp("airflow_home")
    dags = tmp_path_factory.mktemp("dags")
    (dags / "e2e_dynamic_mig.py").write_text(DAG_SOURCE)
    (home / "fleet.yaml").write_text(FLEET)
    out = home / "task-files"
    out.mkdir()
    yield from run_sh_airflow(home, dags, {
        "GPUSCHED_FLEET": str(home / "fleet.yaml"), "E2E_OUT": str(out),
        "GPUSCHED_DYNAMIC_MIG": "local", "GPUSCHED_AGENT_INTERVAL": "2",
    })


def _ledger(airflow: Airflow) -> Any:
    from gpusched.ledger import Ledger

    return Ledger(f"sqlite:///{airflow.home / 'gpusched' / 'ledger.db'}")


def test_a_profile_no_instance_offers_runs_after_the_agent_re_partitions(airflow: Airflow) -> None:
    _wait("the api-server, scheduler and dag-processor", lambda: _healthy(airflow), 300, airflow)
    airflow.token = _wait("a login token", lambda: _login(airflow), 60, airflow)
    _wait("the DAG to be parsed", lambda: "dm_serve" in {
        d["dag_id"] for d in airflow.api("GET", "/dags")["dags"]}, 180, airflow)
    run_id = trigger(airflow, "dm_serve")
    done = dict(_wait("dm_serve.serve to finish", lambda: finished_ti(airflow, "dm_serve", run_id, "serve"),
                      300, airflow, interval=2))
    assert (done["state"], done["try_number"]) == ("success", 1), done
    seen, isolation = (airflow.home / "task-files" / "serve").read_text().split()
    assert seen.startswith("MIG-") and isolation == "hard", seen
    ledger = _ledger(airflow)
    try:
        (event,) = ledger.events(50, kinds=["mig_repartition"])
        assert event.subject == GPU and event.detail["layout"] == ["4g.40gb"], event
        (device,) = [d for d in ledger.snapshot().devices() if d.uuid == seen]
        assert device.parent == GPU and device.profile == "4g.40gb"
    finally:
        ledger.close()
    text = _log_text(airflow, "dm_serve", run_id, "serve", 1)
    assert f"waiting for a MIG re-partition of {GPU}" in text, text[-2000:]
