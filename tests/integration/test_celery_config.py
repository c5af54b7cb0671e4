"""``[celery] celery_config_options = gpusched.airflow.celery_config.CELERY_CONFIG``: Airflow's own
Celery configuration, and a worker that imports the ledger and its SQL driver once, before it
forks the processes that run tasks, instead of once per GPU task (the driver only in a worker:
``worker_init``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from _ledger_support import PG_URL

REPO = Path(__file__).resolve().parents[2]

CHECK = """
import sys
from airflow.providers.celery.executors.default_celery import DEFAULT_CELERY_CONFIG
from celery.signals import worker_init
from gpusched.airflow.celery_config import CELERY_CONFIG
assert CELERY_CONFIG == DEFAULT_CELERY_CONFIG
before = {m for m in ("psycopg", "gpusched.ledger", "gpusched.airflow.listener") if m in sys.modules}
worker_init.send(sender=None)  # what a Celery worker's main process sends before its pool starts
after = {m for m in ("psycopg", "gpusched.ledger", "gpusched.airflow.listener") if m in sys.modules}
print(sorted(before), sorted(after))
"""


def test_a_worker_imports_the_ledger_driver_before_it_forks(tmp_path: Path) -> None:
    env = {"PATH": str(Path(sys.executable).parent), "PYTHONPATH": str(REPO), "AIRFLOW_HOME": str(tmp_path),
           "GPUSCHED_DB_URL": "postgresql+psycopg://nobody@127.0.0.1:9/none"}  # never connected to
    out = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    ledger = "'gpusched.airflow.listener', 'gpusched.ledger'"
    assert out.stdout.strip().splitlines()[-1] == f"[{ledger}] [{ledger}, 'psycopg']"


def test_the_shipped_deployments_choose_it() -> None:
    option = "AIRFLOW__CELERY__CELERY_CONFIG_OPTIONS"
    value = "gpusched.airflow.celery_config.CELERY_CONFIG"
    from gpusched.deploy.multihost_cluster import compose_environments

    envs = compose_environments()
    workers = [role for role in envs if "worker" in role or "gpu-host" in role]
    assert workers and all(envs[role].get(option) == value for role in workers), workers
    assert f"{option}:-{value}" in (REPO / "scripts" / "gpu_host.sh").read_text()


WARM = """
from celery.signals import worker_init
from gpusched.airflow import listener
from gpusched.airflow.celery_config import CELERY_CONFIG  # noqa: F401  (connects preload)
worker_init.send(sender=None)
(ledger,) = listener._LEDGERS.values()
print(ledger.engine.dialect.server_version_info is not None, ledger.engine.pool.checkedin())
"""


@pytest.mark.skipif(not PG_URL, reason="GPUSCHED_TEST_PG_URL is not set")
def test_a_worker_learns_the_ledger_server_once_and_keeps_no_connection_into_its_fork(tmp_path: Path) -> None:
    env = {"PATH": str(Path(sys.executable).parent), "PYTHONPATH": str(REPO), "AIRFLOW_HOME": str(tmp_path),
           "GPUSCHED_DB_URL": PG_URL}
    out = subprocess.run([sys.executable, "-c", WARM], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "True 0"  # dialect initialised; no open connection
