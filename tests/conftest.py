"""Shared test settings: every test gets its own AIRFLOW_HOME / gpusched state folder, and a
module-scoped migrated Airflow metadata DB (``airflow_db``) for tests that need Airflow's ORM."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _isolated_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path / "airflow_home"))
    monkeypatch.delenv("GPUSCHED_DB_URL", raising=False)
    yield


@pytest.fixture(scope="module")
def airflow_db(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A freshly migrated SQLite Airflow metadata DB, with the in-process ORM pointed at it."""
    home = tmp_path_factory.mktemp("af_home")
    url = f"sqlite:///{home / 'airflow.db'}"
    env = {**os.environ, "AIRFLOW_HOME": str(home), "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": url,
           "AIRFLOW__CORE__LOAD_EXAMPLES": "False"}
    subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], env=env, check=True,
                   capture_output=True, timeout=300)
    from airflow import settings
    from airflow.configuration import conf

    previous = conf.get("database", "sql_alchemy_conn")
    conf.set("database", "sql_alchemy_conn", url)
    settings.configure_vars()
    settings.reconfigure_orm()
    yield url
    conf.set("database", "sql_alchemy_conn", previous)
    settings.configure_vars()
    settings.reconfigure_orm()
