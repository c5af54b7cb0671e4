"""The gpusched Airflow plugin: registers what gpusched.airflow provides.

Keep this file light: the plugin manager imports it in every Airflow process.
"""

from __future__ import annotations

from typing import Any, ClassVar

from airflow.plugins_manager import AirflowPlugin

from gpusched.airflow import listener as gpusched_listener


class GpuschedPlugin(AirflowPlugin):
    """GPU-aware scheduling: the task listener that exports and releases assigned devices."""

    name = "gpusched"
    listeners: ClassVar[list[Any]] = [gpusched_listener]
