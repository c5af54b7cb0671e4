"""The capacity_forecast DAG under real Airflow (dag.test() on SQLite), on a synthetic series."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

RUNNER = """
import importlib.util, json, os, sys
spec = importlib.util.spec_from_file_location("capacity_forecast", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
run = module.capacity_forecast_dag.test()
tis = run.get_task_instances()
states = {ti.task_id: str(ti.state) for ti in tis}
tries = {ti.task_id: ti.try_number for ti in tis}
print("RESULT " + json.dumps({"state": str(run.state), "tasks": states, "tries": tries}))
"""


def _run_dag(home: Path, **extra: str) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW__", "GPUSCHED_"))}
    env.update({
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "GPUSCHED_DEMAND_SOURCE": "synthetic",
        "GPUSCHED_FORECAST_MODELS": "seasonal_naive,ets",
        "GPUSCHED_FORECAST_ORIGINS": "2",
        "PYTHONPATH": str(REPO),
        **extra,
    })
    if not (home / "airflow.db").exists():
        subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], env=env, check=True,
                       capture_output=True, timeout=600)
    done = subprocess.run([sys.executable, "-c", RUNNER, str(REPO / "dags" / "capacity_forecast.py")],
                          env=env, capture_output=True, text=True, timeout=900)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, done.stdout[-3000:] + done.stderr[-3000:]
    return dict(json.loads(lines[-1][len("RESULT "):]))


@pytest.mark.airflow
@pytest.mark.slow
def test_capacity_forecast_dag_end_to_end(tmp_path: Path) -> None:
    home = tmp_path / "airflow"
    outcome = _run_dag(home)
    assert outcome["state"] == "success", outcome
    state = home / "gpusched"
    latest = json.loads((state / "forecast" / "latest.json").read_text())
    assert latest["model"] in ("seasonal_naive", "ets") and len(latest["mean"]) == 24
    assert latest["backtest"]["origins"] == 2
    assert json.loads((state / "forecast.json").read_text())["mean"] == latest["mean"]  # the UI's file
    pngs = list((state / "forecast").glob("forecast-*.png"))
    assert pngs and pngs[0].read_bytes()[:4] == b"\x89PNG"
    scaling = json.loads((state / "scaling.json").read_text())
    assert scaling["last_plan"]["provisioning_delay_s"] == 900

    # Demand above the declared capacity fails validation, at once (the same history would fail
    # the retry too: the DAG's retries=1 is not spent), and nothing downstream runs.
    failed = _run_dag(home, GPUSCHED_FORECAST_CAPACITY="5")
    tasks, tries = failed["tasks"], failed["tries"]
    assert failed["state"] == "failed"
    assert isinstance(tasks, dict) and tasks["validate"] == "failed"
    assert isinstance(tries, dict) and tries["validate"] == 1
    assert tasks["prescale"] != "success"

    # So does a model name the backtest does not know: the settings are wrong, not the moment.
    unknown = _run_dag(home, GPUSCHED_FORECAST_MODELS="prophet")
    tasks, tries = unknown["tasks"], unknown["tries"]
    assert unknown["state"] == "failed"
    assert isinstance(tasks, dict) and tasks["select_model"] == "failed" and tasks["validate"] == "success"
    assert isinstance(tries, dict) and tries["select_model"] == 1


@pytest.mark.airflow
@pytest.mark.slow
def test_capacity_forecast_dag_reads_the_ledger_and_records_a_forecast_event() -> None:
    import time
    from dataclasses import replace

    from gpusched.ledger import Ledger
    from gpusched.model import DeviceShare
    from gpusched.request import GPURequest
    from gpusched.testing import synthetic_fleet

    home = Path(os.environ["AIRFLOW_HOME"])  # the ledger lives under it, for both processes
    ledger = Ledger()
    ledger.migrate()
    nodes = list(synthetic_fleet(4, used_fraction=0.0).nodes)
    nodes[3] = replace(nodes[3], standby=True)
    ledger.sync_inventory(nodes, source="test")
    now = time.time()
    devices = [d for n in nodes[:3] for d in n.devices]
    for k in range(10):  # one more GPU taken every 10 hours
        d = devices[k]
        ledger.allocate(f"job-{k}", GPURequest.build(gpus=1),
                        [DeviceShare(d.uuid, d.node, d.index, 1000, d.memory_bytes)],
                        holder="test", now=now - (k + 1) * 10 * 3600, lease_s=10**7)
    outcome = _run_dag(home, GPUSCHED_DEMAND_SOURCE="ledger")
    assert outcome["state"] == "success", outcome
    events = ledger.events(1, kinds=["forecast"])
    assert events and len(events[0].detail["mean"]) == 24
    plan = json.loads((home / "gpusched" / "scaling.json").read_text())["last_plan"]
    assert plan["active_gpus"] == 24  # the standby node is not active capacity
    recorded = ledger.events(1, kinds=["prescale_plan"])  # what the agent's scale-in reads
    assert recorded and recorded[0].detail["plan"] == plan


@pytest.mark.airflow
@pytest.mark.slow
def test_capacity_forecast_dag_on_an_empty_ledger_skips_with_the_reason() -> None:
    """A fresh install: no allocations yet. The run succeeds, forecast and prescale are skipped,
    and the fleet page's forecast panel says why instead of 'no forecast yet'."""
    from gpusched.airflow.api import load_forecast
    from gpusched.ledger import Ledger

    home = Path(os.environ["AIRFLOW_HOME"])  # the ledger lives under it, for both processes
    outcome = _run_dag(home, GPUSCHED_DEMAND_SOURCE="ledger", GPUSCHED_FORECAST_MODELS="")
    tasks = outcome["tasks"]
    assert outcome["state"] == "success", outcome
    assert isinstance(tasks, dict)
    assert tasks["load_history"] == tasks["validate"] == "success"
    assert tasks["select_model"] == tasks["forecast"] == tasks["prescale"] == "skipped"
    shown = load_forecast(Ledger())
    assert shown["available"] is False
    assert "insufficient data: no GPU demand recorded" in shown["note"], shown
