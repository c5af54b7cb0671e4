"""The gpusched Airflow plugin: registers what gpusched.airflow provides.

Registered by the ``airflow.plugins`` entry point of the installed package (``plugins/`` keeps a
shim for the plugins-folder style). Keep this file light: the plugin manager imports it in every
Airflow process.
"""

from __future__ import annotations

from typing import Any

from airflow.plugins_manager import AirflowPlugin

from gpusched.airflow import fault_listener as gpusched_fault_listener
from gpusched.airflow import listener as gpusched_listener
from gpusched.airflow.api import URL_PREFIX, LazyApp


class GpuschedPlugin(AirflowPlugin):
    """GPU-aware scheduling: the task listener that exports and releases assigned devices."""

    name = "gpusched"
    # Plain annotations (no ClassVar): AirflowPlugin declares these as instance attributes.
    listeners: list[Any] = [gpusched_listener, gpusched_fault_listener]  # noqa: RUF012
    # Fleet / queue / quota / forecast API behind Airflow auth, and its page in the UI nav
    # (Browse → GPU fleet). LazyApp: FastAPI is only loaded by the api-server that serves it.
    fastapi_apps: list[Any] = [  # noqa: RUF012
        {"app": LazyApp(), "url_prefix": URL_PREFIX, "name": "gpusched"}
    ]
    external_views: list[Any] = [  # noqa: RUF012
        {
            "name": "GPU fleet",
            "href": f"{URL_PREFIX}/ui",
            "destination": "nav",
            "category": "browse",
            "url_route": "gpusched",
        }
    ]
