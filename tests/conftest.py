"""Shared test settings: every test gets its own AIRFLOW_HOME / gpusched state folder."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _isolated_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path / "airflow_home"))
    monkeypatch.delenv("GPUSCHED_DB_URL", raising=False)
    yield
