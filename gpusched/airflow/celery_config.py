"""Airflow's Celery configuration for a fleet of GPU hosts.

Set ``[celery] celery_config_options = gpusched.airflow.celery_config.CELERY_CONFIG`` (the
shipped ``docker-compose.yaml``, ``scripts/gpu_host.sh`` and the local multi-host deployment do):
it is Airflow's default configuration, and a Celery worker started with it imports the ledger and
its SQL driver once, and connects to the ledger once, before it forks the processes that run
tasks (:func:`preload`). Every GPU task's process reads and writes the ledger
(:mod:`gpusched.airflow.listener`: its devices, its process, its release); without this each
would import the driver anew (0.2–0.4 s of CPU a task) and learn the server's dialect anew.
"""

from __future__ import annotations

from typing import Any

from airflow.providers.celery.executors.default_celery import DEFAULT_CELERY_CONFIG
from celery.signals import worker_init
from sqlalchemy.engine import make_url

from gpusched.airflow import listener  # imported before the fork, as the ledger below
from gpusched.ledger import Ledger  # noqa: F401
from gpusched.ledger.engine import default_url

__all__ = ["CELERY_CONFIG", "preload"]

CELERY_CONFIG: dict[str, Any] = dict(DEFAULT_CELERY_CONFIG)
"""Airflow's ``DEFAULT_CELERY_CONFIG``, unchanged: choosing it is what connects :func:`preload`."""


@worker_init.connect
def preload(**_: Any) -> None:
    """In a Celery worker's main process, before its pool forks: import the driver of the
    ledger's database URL, which the task-side listener needs for every GPU task (the ledger
    itself and the listener are imported with this module), and connect to the ledger once
    (:func:`gpusched.airflow.listener.warm_ledger`). A ledger that cannot be configured or
    reached now is left to the tasks, which report it."""
    try:
        make_url(default_url()).get_dialect().import_dbapi()
    except Exception:  # the worker runs plain tasks too; never keep it from starting
        return
    try:
        listener.warm_ledger()
    except Exception:  # not reachable now: each task connects (and reports it) itself
        return
