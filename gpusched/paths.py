"""Where gpusched finds its shipped data (``gpusched/include/``) and its state (under ``AIRFLOW_HOME``)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["include_dir", "state_dir"]


def include_dir() -> Path:
    """The ``include/`` folder with the catalog, fleets and expectation suites.

    It is package data (``gpusched/include/``, inside the wheel and the sdist), so an installed
    gpusched finds it without the repository. ``GPUSCHED_INCLUDE_DIR`` overrides it.
    """
    override = os.environ.get("GPUSCHED_INCLUDE_DIR")
    if override:
        return Path(override)
    return Path(__file__).resolve().parent / "include"


def state_dir() -> Path:
    """The folder for gpusched's own state: ``$AIRFLOW_HOME/gpusched`` (``~/airflow/gpusched``)."""
    home = os.environ.get("AIRFLOW_HOME") or str(Path.home() / "airflow")
    return Path(home) / "gpusched"
