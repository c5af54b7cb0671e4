"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from _ledger_support import BACKENDS, database_url


@pytest.fixture(params=BACKENDS)
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty ledger database for one test, once per backend (SQLite; PostgreSQL when
    ``GPUSCHED_TEST_PG_URL`` is set)."""
    yield from database_url(request.param, tmp_path)
