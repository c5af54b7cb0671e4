"""gpusched as an Airflow provider: what ``airflow providers list`` and ``airflow config list`` show.

``pyproject.toml`` registers :func:`get_provider_info` under the ``apache_airflow_provider`` entry
point (read by Airflow's providers manager) and the plugin (:mod:`gpusched.airflow.plugin`) under
``airflow.plugins``, so ``pip install gpusched`` into any Airflow 3.3 makes both appear without a
plugins folder. The ``config`` part comes from :mod:`gpusched.settings` (one source).
"""

from __future__ import annotations

from typing import Any

from gpusched import __version__
from gpusched.settings import provider_config

__all__ = ["get_cli_commands", "get_provider_info"]

EXECUTORS = ("gpusched.airflow.executor.GPUExecutor",)


def get_cli_commands() -> list[Any]:
    """The ``airflow`` subcommands the executor adds: none (gpusched's commands are the ``gpusched``
    CLI). Declared so that Airflow does not fall back to probing the executor class for them."""
    return []


def get_provider_info() -> dict[str, Any]:
    """The provider info dictionary (Airflow's ``provider_info.schema.json``)."""
    return {
        "package-name": "gpusched",
        "name": "gpusched",
        "description": "GPU-aware scheduling for Apache Airflow on heterogeneous GPU fleets "
                       "(NVIDIA, AMD, Huawei Ascend): GPU executor, fleet API and UI page.",
        "versions": [__version__],
        "executors": list(EXECUTORS),
        "cli": ["gpusched.provider_info.get_cli_commands"],
        "config": provider_config(),
    }
