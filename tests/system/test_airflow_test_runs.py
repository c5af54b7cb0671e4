"""A DAG author's local runs of GPU tasks in real Airflow, no executor running.

``airflow dags test`` and ``airflow tasks test`` of the bundled example DAGs: with the main job's
ledger (its fleet recorded), each GPU task is placed by the scheduler's cycle, sees exactly its
devices, says where it ran in one line, and its devices are released at its end; without a
ledger it runs with no GPU visible and one warning, no traceback.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpusched.ledger import Ledger

pytestmark = [pytest.mark.airflow, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """An Airflow home with a migrated metadata DB and the repository's DAGs; no ledger yet."""
    folder = tmp_path_factory.mktemp("af_test_runs")
    env = {**os.environ, "AIRFLOW_HOME": str(folder),
           "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{folder / 'airflow.db'}",
           "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
           "GPUSCHED_DB_URL": f"sqlite:///{folder / 'ledger.db'}", "GPUSCHED_BACKEND": "simulated"}
    for name in ("CUDA_VISIBLE_DEVICES", "GPUSCHED_ALLOCATION", "GPUSCHED_HOST"):
        env.pop(name, None)
    _run(env, "-m", "airflow", "db", "migrate")
    return env


def _run(env: dict[str, str], *argv: str) -> str:
    done = subprocess.run([sys.executable, *argv], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=600, check=False)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    return out


def _main_job_ledger(env: dict[str, str]) -> Ledger:
    """The ledger as the main job leaves it: migrated, the simulated fleet recorded."""
    from gpusched.hardware.simulated import SimulatedBackend, default_fleet_path

    ledger = Ledger(env["GPUSCHED_DB_URL"])
    ledger.migrate()
    ledger.sync_inventory(SimulatedBackend(default_fleet_path()).discover(), source="simulated")
    return ledger


def test_without_a_ledger_a_test_run_sees_no_gpu_and_one_warning(home: dict[str, str]) -> None:
    out = _run(home, "-m", "airflow", "dags", "test", "example_dev_smoke_test")
    assert re.search(r"CUDA_VISIBLE_DEVICES=(\s|$|\")", out, re.MULTILINE), out[-3000:]  # set, and empty
    warnings = [line for line in out.splitlines() if "runs with no GPU visible" in line]
    assert len(warnings) == 1, out[-3000:]
    assert "ledger cannot be read" in warnings[0]
    assert "Traceback" not in out and "could not export" not in out, out[-3000:]
    assert "smoke test passed" in out


def test_with_the_main_jobs_ledger_dags_test_and_tasks_test_place_each_gpu_task(home: dict[str, str]) -> None:
    ledger = _main_job_ledger(home)
    try:
        out = _run(home, "-m", "airflow", "dags", "test", "example_dev_smoke_test")
        assert len(_placed(out)) == 1, out[-3000:]
        runs = ledger.events(10, kinds=["test_run"])
        assert len(runs) == 1
        smoke = ledger.get(runs[0].subject)
        assert smoke is not None and smoke.released_at is not None and smoke.holder.startswith("test-run@")
        (share,) = smoke.shares
        device = ledger.snapshot().device(share.uuid)
        assert device.model == "T4" or "dev" in share.node, (device.model, share.node)
        assert f"CUDA_VISIBLE_DEVICES={share.index}" in out, out[-3000:]

        out = _run(home, "-m", "airflow", "tasks", "test", "example_dev_smoke_test", "smoke_test")
        assert len(_placed(out)) == 1, out[-3000:]
        assert len(ledger.events(10, kinds=["test_run"])) == 2

        steps = {**home, "GPUSCHED_EXAMPLE_STEPS": "3", "GPUSCHED_EXAMPLE_STEP_SECONDS": "0"}
        out = _run(steps, "-m", "airflow", "dags", "test", "example_multi_gpu_nvlink_training")
        train = _only(ledger, "train_resnet50")
        assert train.released_at is not None and len(train.shares) == 4  # its request: 4 on one NVLink island
        assert len({s.node for s in train.shares}) == 1
        assert f"CUDA_VISIBLE_DEVICES={','.join(str(s.index) for s in train.shares)}" in out, out[-3000:]
        assert ledger.active() == []  # nothing left held
        assert "Traceback" not in out, out[-3000:]
    finally:
        ledger.close()


def _placed(out: str) -> list[str]:
    """The lines that say where a test run was placed."""
    return [line for line in out.splitlines() if "placed by the scheduler on" in line]


def _only(ledger: Ledger, task_id: str) -> Any:
    found = [a for a in ledger.history(0, 1e12) if f"/{task_id}/" in a.key]
    assert len(found) == 1, found
    return found[0]
