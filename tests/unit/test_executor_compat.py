"""The Airflow internals gpusched's executors touch exist in the pinned Airflow and Celery provider.

When an upgrade renames one, this test names it: fix ``gpusched/airflow/executor_compat.py`` only.
"""

from __future__ import annotations

import inspect
from importlib.metadata import version

from gpusched.airflow.executor_compat import PINNED_AIRFLOW, PINNED_CELERY_PROVIDER


def test_pinned_versions_are_installed() -> None:
    assert version("apache-airflow") == PINNED_AIRFLOW
    assert version("apache-airflow-providers-celery") == PINNED_CELERY_PROVIDER


def test_local_executor_internals_exist() -> None:
    from airflow.executors.local_executor import LocalExecutor, _run_worker

    source = inspect.getsource(LocalExecutor)
    for name in ("activity_queue", "result_queue", "_unread_messages", "workers", "_check_workers",
                 "_spawn_worker", "_process_workloads"):
        assert name in source, f"LocalExecutor.{name} is gone"
    assert list(inspect.signature(_run_worker).parameters)[:5] == [
        "logger_name", "input", "output", "unread_messages", "team_conf"]


def test_celery_executor_internals_exist() -> None:
    from airflow.providers.celery.executors.celery_executor import CeleryExecutor

    assert callable(CeleryExecutor._process_workloads)
    source = inspect.getsource(CeleryExecutor._process_workloads)
    assert "workload.ti.queue" in source  # routing by the workload's queue is what we rely on


def test_executors_accept_extra_keywords_airflow_may_pass() -> None:
    from gpusched.airflow.celery_executor import GPUCeleryExecutor
    from gpusched.airflow.executor import GPUExecutor

    for cls in (GPUExecutor, GPUCeleryExecutor):
        for method in ("change_state", "revoke_task", "queue_workload"):
            params = inspect.signature(getattr(cls, method)).parameters.values()
            assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params), f"{cls.__name__}.{method}"


def test_the_stuck_in_queued_failure_path_fail_unstarted_mirrors_exists() -> None:
    """fail_unstarted sets a queued try failed before the executor reports it, as the scheduler
    does for a try stuck in queued; the scheduler then skips its 'state mismatch' handling, which
    applies only to a try still scheduled, queued, running or restarting."""
    from airflow.api_fastapi.execution_api.datamodels.taskinstance import TIRunContext
    from airflow.callbacks.callback_requests import TaskCallbackRequest
    from airflow.jobs.scheduler_job_runner import SchedulerJobRunner
    from airflow.listeners.listener import get_listener_manager
    from airflow.models.dagbag import DBDagBag

    stuck = inspect.getsource(SchedulerJobRunner._maybe_requeue_stuck_ti)
    assert "ti.set_state(TaskInstanceState.FAILED, session=session)" in stuck
    assert "executor.fail(ti.key)" in stuck
    events = inspect.getsource(SchedulerJobRunner.process_executor_events)
    assert "TaskInstanceState.QUEUED," in events and 'event="state mismatch"' in events
    assert callable(DBDagBag.get_dag_for_run) and callable(get_listener_manager)
    assert {"ti", "msg", "task_callback_type", "context_from_server", "bundle_name", "bundle_version",
            "filepath"} <= set(TaskCallbackRequest.model_fields)
    context = {"dag_run", "max_tries", "variables", "connections", "xcom_keys_to_clear"}
    assert context <= set(TIRunContext.model_fields)
