"""Every use of LocalExecutor's and CeleryExecutor's private members, in one place.

gpusched's executors subclass Airflow's; the few internals they must touch (LocalExecutor's
worker queue, message counter and worker table; CeleryExecutor's workload sending) live here
only, so an Airflow upgrade that renames them breaks one module, and
``tests/unit/test_executor_compat.py`` (pinned to :data:`PINNED_AIRFLOW`) says which.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "PINNED_AIRFLOW", "PINNED_CELERY_PROVIDER", "celery_send", "local_any_worker_dead", "local_put",
    "local_spawn_worker",
    "save_task_event",
]

PINNED_AIRFLOW = "3.3.2"
"""The Airflow version these internals were checked against."""

PINNED_CELERY_PROVIDER = "3.26.0"
"""The apache-airflow-providers-celery version these internals were checked against."""


def local_put(executor: Any, workload: Any, env: Mapping[str, str]) -> None:
    """Hand ``workload`` to a LocalExecutor worker that runs it with ``env`` applied."""
    executor.queued_tasks.pop(workload.key, None)
    executor.activity_queue.put((workload, dict(env)))
    with executor._unread_messages:
        executor._unread_messages.value += 1
    executor._check_workers()


def local_spawn_worker(executor: Any, target: Any) -> None:
    """LocalExecutor._spawn_worker with ``target`` as the worker loop."""
    import multiprocessing

    proc = multiprocessing.Process(
        target=target,
        kwargs={
            "logger_name": executor.log.name,
            "input": executor.activity_queue,
            "output": executor.result_queue,
            "unread_messages": executor._unread_messages,
            "team_conf": executor.conf,
        },
    )
    proc.start()
    assert proc.pid is not None
    executor.workers[proc.pid] = proc


def local_any_worker_dead(executor: Any) -> bool:
    """Whether a LocalExecutor worker process has died (before ``_check_workers`` reaps it)."""
    return any(not proc.is_alive() for proc in getattr(executor, "workers", {}).values())


def celery_send(executor: Any, workloads: Sequence[Any]) -> None:
    """Send ``workloads`` as CeleryExecutor does (each to its ``ti.queue``)."""
    from airflow.providers.celery.executors.celery_executor import CeleryExecutor

    CeleryExecutor._process_workloads(executor, workloads)


def save_task_event(executor: Any, *, event: str, extra: str, ti_key: Any) -> None:
    """Write one row of Airflow's event log for task ``ti_key`` now.

    ``BaseExecutor.log_task_event`` queues the row for the scheduler, which saves the queue with
    ``session.bulk_save_objects(<generator>)``; with the pinned SQLAlchemy 2.1 that inserts empty
    rows and fails (NOT NULL on ``log.event``), so every executor event would be lost. Writing the
    row in its own transaction avoids it; on any error the row goes the usual way.
    """
    try:
        from airflow.models.log import Log
        from airflow.utils.session import create_session

        with create_session() as session:
            session.add(Log(event=event, task_instance=ti_key, extra=extra))
    except Exception:
        from airflow.executors.base_executor import BaseExecutor

        executor.log.exception("gpusched: could not write the %s event log row; queueing it", event)
        BaseExecutor.log_task_event(executor, event=event, extra=extra, ti_key=ti_key)
