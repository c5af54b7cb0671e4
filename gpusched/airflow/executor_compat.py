"""Every use of LocalExecutor's and CeleryExecutor's private members, in one place.

gpusched's executors subclass Airflow's; the few internals they must touch (LocalExecutor's
worker queue, message counter and worker table; CeleryExecutor's workload sending, its send
results and its table of sent workloads; the scheduler's way of failing a queued try for good,
:func:`fail_unstarted`) live here
only, so an Airflow upgrade that renames them breaks one module, and
``tests/unit/test_executor_compat.py`` (pinned to :data:`PINNED_AIRFLOW`) says which.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "PINNED_AIRFLOW", "PINNED_CELERY_PROVIDER", "celery_forget", "celery_send", "celery_task_id",
    "fail_unstarted", "is_broker_error", "local_any_worker_dead", "local_put", "local_spawn_worker",
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


def celery_send(
    executor: Any, workloads: Sequence[Any], *, keep_unsent: bool = False
) -> dict[Any, BaseException]:
    """Send ``workloads`` as CeleryExecutor does (each to its ``ti.queue``).

    CeleryExecutor turns a send that raised into a failed event for the task (and takes it off
    ``queued_tasks``): a broker outage then fails the try. With ``keep_unsent``, a workload whose
    send failed with a broker error (:func:`is_broker_error`) is left exactly as before the send
    — still in ``queued_tasks``, not running, no event — and its error is returned by key; any
    other send error is handled by CeleryExecutor as usual. Without it, returns ``{}``.
    """
    from airflow.providers.celery.executors.celery_executor import CeleryExecutor

    if not keep_unsent:
        CeleryExecutor._process_workloads(executor, workloads)
        return {}
    from airflow.providers.celery.executors.celery_executor_utils import ExceptionWithTraceback

    unsent: dict[Any, BaseException] = {}
    send = executor._send_workloads_to_celery

    def send_keeping_unsent(tuples: Sequence[Any]) -> list[Any]:
        results = []
        for key, args, result in send(tuples):
            if isinstance(result, ExceptionWithTraceback) and is_broker_error(result.exception):
                unsent[key] = result.exception
            else:
                results.append((key, args, result))
        return results

    # CeleryExecutor._send_workloads sends through this method and books every result it returns;
    # the unsent ones are taken out of what it books, for this one call.
    shadowed = vars(executor).get("_send_workloads_to_celery")
    executor._send_workloads_to_celery = send_keeping_unsent
    try:
        CeleryExecutor._process_workloads(executor, workloads)
    finally:
        if shadowed is None:
            del executor._send_workloads_to_celery
        else:
            executor._send_workloads_to_celery = shadowed
    return unsent


def is_broker_error(exc: BaseException) -> bool:
    """Whether a send failed because the broker did not answer (refused, reset, timed out).

    kombu re-raises a transport's connection errors as ``kombu.exceptions.OperationalError``;
    Airflow's send timeout (``[celery] operation_timeout``) raises ``AirflowTaskTimeout``.
    """
    from airflow.providers.common.compat.sdk import AirflowTaskTimeout
    from kombu.exceptions import OperationalError

    if isinstance(exc, (OperationalError, AirflowTaskTimeout, ConnectionError, TimeoutError)):
        return True
    try:
        from redis.exceptions import ConnectionError as RedisConnectionError
        from redis.exceptions import TimeoutError as RedisTimeoutError
    except ImportError:  # a broker other than Redis
        return False
    return isinstance(exc, (RedisConnectionError, RedisTimeoutError))


def celery_task_id(executor: Any, key: Any) -> str | None:
    """The Celery task id CeleryExecutor watches for ``key`` (None when it watches none)."""
    result = executor.workloads.get(key)
    return None if result is None else str(result.task_id)


def celery_forget(executor: Any, key: Any) -> None:
    """Stop watching ``key`` in Celery (it is neither running nor polled any more)."""
    executor.workloads.pop(key, None)
    executor.running.discard(key)


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


def fail_unstarted(executor: Any, workload: Any, reason: str) -> bool:
    """Fail the queued try of ``workload`` for good, as Airflow fails a try stuck in queued.

    The scheduler's own path for a try it gives up on before it started
    (``SchedulerJobRunner._maybe_requeue_stuck_ti``): the task instance is set ``failed`` in the
    metadata database — no retry is spent, whatever ``retries`` says — and its failure callback,
    if it has one, goes to the dag-processor. The executor's failure event that follows
    (``executor.fail``, the caller's) then agrees with the database, so the scheduler records no
    "state mismatch" and logs no "task state changed externally". Unlike that path, the failure
    listeners run as ``TaskInstance.handle_failure`` runs them (``previous_state`` queued), so the
    fault chain sees the failure.

    Returns False, changing nothing, when the try is not queued in the database (a later try, or
    cleared or marked by hand) or the database cannot be written; the caller's failure event then
    takes Airflow's usual path (retries included). Never raises.
    """
    try:
        from airflow.models.taskinstance import TaskInstance
        from airflow.utils.session import create_session
        from airflow.utils.state import TaskInstanceState

        with create_session() as session:
            ti = session.get(TaskInstance, workload.ti.id)
            if ti is None or ti.state != TaskInstanceState.QUEUED or ti.try_number != workload.ti.try_number:
                return False
            ti.set_state(TaskInstanceState.FAILED, session=session)
            _send_failure_callback(executor, ti, reason, session)
        with create_session() as session:  # the state is committed: a listener cannot undo it
            ti = session.get(TaskInstance, workload.ti.id)
            _failure_listeners(executor, ti, reason)
        return True
    except Exception:
        executor.log.exception("gpusched: could not fail %s for good; Airflow fails it the usual way",
                               workload.key)
        return False


def _send_failure_callback(executor: Any, ti: Any, reason: str, session: Any) -> None:
    """The task's ``on_failure_callback`` request, as the scheduler sends it for a stuck try."""
    try:
        from airflow.api_fastapi.execution_api.datamodels.taskinstance import DagRun as DRDataModel
        from airflow.api_fastapi.execution_api.datamodels.taskinstance import TIRunContext
        from airflow.callbacks.callback_requests import TaskCallbackRequest
        from airflow.models.dagbag import DBDagBag
        from airflow.utils.state import TaskInstanceState

        dag = DBDagBag(load_op_links=False).get_dag_for_run(dag_run=ti.dag_run, session=session)
        if dag is None or not dag.get_task(ti.task_id).has_on_failure_callback or ti.dag_version is None:
            return
        executor.send_callback(TaskCallbackRequest(
            filepath=ti.dag_model.relative_fileloc or "",
            bundle_name=ti.dag_version.bundle_name,
            bundle_version=ti.dag_version.bundle_version if ti.dag_run.bundle_version is not None
            else ti.dag_run.bundle_version,
            ti=ti, msg=reason, task_callback_type=TaskInstanceState.FAILED,
            context_from_server=TIRunContext(
                dag_run=DRDataModel.model_validate(ti.dag_run, from_attributes=True),
                max_tries=ti.max_tries, variables=[], connections=[], xcom_keys_to_clear=[],
            ),
        ))
    except Exception:
        executor.log.exception("gpusched: the failure callback of %s was not sent", ti.key)


def _failure_listeners(executor: Any, ti: Any, reason: str) -> None:
    try:
        from airflow.listeners.listener import get_listener_manager
        from airflow.utils.state import TaskInstanceState

        get_listener_manager().hook.on_task_instance_failed(
            previous_state=TaskInstanceState.QUEUED, task_instance=ti, error=reason)
    except Exception:
        executor.log.exception("gpusched: a failure listener of %s failed", ti.key)
