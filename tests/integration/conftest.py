"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from _ledger_support import BACKENDS, database_url, fleet

from gpusched.ledger import Ledger


@pytest.fixture(params=BACKENDS)
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty ledger database for one test, once per backend (SQLite; PostgreSQL when
    ``GPUSCHED_TEST_PG_URL`` is set)."""
    yield from database_url(request.param, tmp_path)


@pytest.fixture
def ledger(url: str) -> Iterator[Ledger]:
    """A migrated ledger holding ``fleet()`` (two nodes of four A100s); modules that need another
    inventory define their own ``ledger``."""
    with Ledger(url) as led:
        led.migrate()
        led.sync_inventory(fleet(), "test")
        yield led
