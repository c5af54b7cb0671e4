"""``[gpusched] preemption = service`` through real Airflow on the local executor (``scripts/run.sh``,
GPUExecutor, a one-A100 simulated fleet, the example quota file run.sh applies by default).

The ledger's history says 9 in 10 runs of ``svc.train`` take a second; a run that has already had
40 s is probably one of the ten-hour ones, and a fresh run of the same task preempts it (the
Gittins index of the attained service). The long run gets the notice, checkpoints, is stopped and
requeued without using a retry, and its next try resumes from the checkpoint; the fresh run is
never preempted back.

``test_celery_preemption_modes.py`` covers the same rule on the Celery executor.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from _ledger_support import assert_whole_devices_never_shared, record_finished_runs
from _run_sh_support import Airflow, finished_ti, run_sh_airflow
from _run_sh_support import healthy as _healthy
from _run_sh_support import login as _login
from _run_sh_support import wait_for as _wait

from gpusched.scheduler.keys import ti_key

pytestmark = [pytest.mark.airflow, pytest.mark.slow]

A100 = "A100-SXM-80GB"
FLEET = f"""
name: one-a100
racks:
  - name: r1
    nodes:
      - name: solo
        cpu: 8
        memory: 32GiB
        devices: {{model: {A100}, count: 1}}
"""
DAG_SOURCE = '''
from __future__ import annotations

import json
import os
import time
from datetime import datetime
from pathlib import Path

from airflow.sdk import dag, get_current_context, task

from gpusched.airflow.authoring import gpu

OUT = Path(os.environ["E2E_OUT"])


@dag(dag_id="svc", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def svc():
    @task(task_id="train", retries=0, **gpu(gpus=1))
    def train() -> None:
        """A quick run (conf quick) ends in a second; a long one steps 0.5 s, checkpoints every 4
        steps, runs until it is preempted in its first try and ends 4 steps after its resume."""
        from gpusched.airflow import checkpoint

        context = get_current_context()
        attempt, name = context["ti"].try_number, "quick" if context["dag_run"].conf.get("quick") else "long"
        earlier = checkpoint.resume()
        first = earlier.step + 1 if earlier is not None else 0
        (OUT / f"{name}-try{attempt}.json").write_text(json.dumps({"resumed_at": first, "at": time.time()}))
        if name == "quick":
            time.sleep(1)
            return
        for step in range(first, 1200 if attempt == 1 else first + 4):
            time.sleep(0.5)
            if step % 4 == 3 or checkpoint.preempted():
                checkpoint.report(step=step, path=str(OUT / "long.state"))
                if checkpoint.preempted():
                    (OUT / f"long-preempted-try{attempt}").write_text(os.environ["GPUSCHED_PREEMPTED"])
                    checkpoint.wait_for_stop()

    train()


svc()
'''
MIN_RUNTIME_S = 40
"""A victim has had this much before it may be preempted, and the quick run that preempts it ends
well within it (so the long run's requeued try cannot preempt it back)."""


@pytest.fixture(scope="module")
def airflow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Airflow]:
    from gpusched.fleetfile import load_fleet
    from gpusched.ledger import Ledger
    from gpusched.model import DeviceShare
    from gpusched.request import GPURequest

    home = tmp_path_factory.mktemp("airflow_home")
    dags = tmp_path_factory.mktemp("dags")
    (dags / "e2e_service.py").write_text(DAG_SOURCE)
    (home / "fleet.yaml").write_text(FLEET)
    out = home / "task-files"
    out.mkdir()
    # The past, which the executor reads when it starts: 27 runs of a second, 3 of ten hours. Fresh,
    # a run's index is about 0.9 /GPU-s; after 1 s, about 3e-5.
    (home / "gpusched").mkdir()
    with Ledger(f"sqlite:///{home / 'gpusched' / 'ledger.db'}") as ledger:
        ledger.migrate()
        nodes = load_fleet(home / "fleet.yaml")
        ledger.sync_inventory(nodes, "simulated", now=time.time())  # as the executor's backend names it
        (a100,) = nodes[0].devices
        record_finished_runs(ledger, "svc", "train", GPURequest.build(gpus=1),
                             DeviceShare(a100.uuid, "solo", a100.index, 1000, 0),
                             [1.0] * 27 + [36_000.0] * 3, end=time.time() - 60)
    yield from run_sh_airflow(home, dags, {
        "GPUSCHED_FLEET": str(home / "fleet.yaml"), "E2E_OUT": str(out),
        "AIRFLOW__GPUSCHED__PREEMPTION": "service",
        "AIRFLOW__GPUSCHED__PREEMPTION_GRACE_SECONDS": "30",
        "AIRFLOW__GPUSCHED__PREEMPTION_MIN_RUNTIME_SECONDS": str(MIN_RUNTIME_S),
    })


def _outcome(airflow: Airflow, run_id: str) -> dict[str, Any]:
    return dict(_wait(f"run {run_id} to finish", lambda: finished_ti(airflow, "svc", run_id, "train"), 300,
                      airflow, interval=2))


def _trigger(airflow: Airflow, conf: dict[str, Any]) -> str:
    run = airflow.api("POST", "/dags/svc/dagRuns", json={"logical_date": None, "conf": conf})
    return str(run["dag_run_id"])


def test_a_fresh_run_preempts_one_that_outlived_most_runs_of_its_kind(airflow: Airflow) -> None:
    from gpusched.ledger import Ledger

    out = airflow.home / "task-files"
    _wait("the api-server, scheduler and dag-processor", lambda: _healthy(airflow), 300, airflow)
    airflow.token = _wait("a login token", lambda: _login(airflow), 60, airflow)
    _wait("the DAG to be parsed", lambda: "svc" in {d["dag_id"] for d in airflow.api("GET", "/dags")["dags"]},
          180, airflow)
    airflow.api("PATCH", "/dags/svc", json={"is_paused": False})
    long_run = _trigger(airflow, {})
    _wait("the long run to start", lambda: (out / "long-try1.json").exists(), 240, airflow)
    quick_run = _trigger(airflow, {"quick": True})
    quick = _outcome(airflow, quick_run)
    assert (quick["state"], quick["try_number"]) == ("success", 1), quick
    long = _outcome(airflow, long_run)
    # Succeeded in its second try with no retry used (retries=0: max_tries follows the try).
    assert (long["state"], long["try_number"], long["max_tries"]) == ("success", 2, 1), long
    assert "preempted for" in str(long["note"]), long
    assert (out / "long-preempted-try1").read_text() == "1"
    assert json.loads((out / "long-try2.json").read_text())["resumed_at"] >= 4  # from try 1's checkpoint

    ledger = Ledger(f"sqlite:///{airflow.home / 'gpusched' / 'ledger.db'}")
    try:
        victim, winner = ti_key("svc", "train", long_run, 1), ti_key("svc", "train", quick_run, 1)
        preempted = [e for e in ledger.events(50, kinds=["preempted"]) if "svc" in e.subject]
        assert [e.subject for e in preempted] == [victim], [(e.subject, e.detail) for e in preempted]
        (event,) = preempted
        assert event.detail["by"] == winner and "expected-service index" in str(event.detail["reason"]), event
        history = ledger.history(time.time() - 3600, time.time() + 1)
        (stopped,) = [a for a in history if a.key == victim]
        (quick_alloc,) = [a for a in history if a.key == winner]
        assert stopped.released_at - stopped.created_at >= MIN_RUNTIME_S  # never a fresh victim
        assert quick_alloc.created_at >= stopped.released_at
        assert_whole_devices_never_shared(history)
        assert not ledger.active()
    finally:
        ledger.close()
