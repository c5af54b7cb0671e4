"""Task-side listener of the fault chain: register the running try, record a failed one.

``on_task_instance_running`` (in the task process) registers the process id under the task key
(:class:`gpusched.faults.stopping.PidRegistry`), so ``gpusched agent`` on this host can stop the task
when an alert rule says so. ``on_task_instance_failed`` (task process; scheduler for a task that
never started; called for ``up_for_retry`` as well as ``failed``) records a
:class:`gpusched.faults.failures.FailureRecord` — task identity, devices, request, log tail and the
formatted exception — as a ``task_failed`` ledger event, then runs the chain at once
(:func:`gpusched.faults.remediation.handle_failure`: classify, cordon, request override) unless
``GPUSCHED_RECOVERY_INLINE=0``. The ``gpusched_fault_recovery`` DAG handles whatever is left
(and clears tasks that Airflow will not retry by itself).

Nothing here may fail a task: every hook logs and swallows its own errors. Registered by
``plugins/gpusched_plugin.py``.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import traceback
from typing import Any

from airflow.listeners import hookimpl

from gpusched.airflow.authoring import is_gpu_task, request_from_executor_config
from gpusched.airflow.listener import is_test_run
from gpusched.airflow.task_log import task_log_path
from gpusched.faults.stopping import PidRegistry
from gpusched.hardware.envexport import allocation_from_env
from gpusched.scheduler.keys import ti_key_of
from gpusched.settings import env_bool

__all__ = [
    "build_failure_record",
    "on_task_instance_failed",
    "on_task_instance_running",
    "on_task_instance_success",
    "read_log_tail",
]

_log = logging.getLogger("gpusched.fault_listener")
_TAIL_LINES = 200
_TAIL_CHARS = 20_000


def _executor_config(task_instance: Any) -> Any:
    task = getattr(task_instance, "task", None)
    config = getattr(task, "executor_config", None) if task is not None else None
    return config if config is not None else getattr(task_instance, "executor_config", None)


def read_log_tail(task_instance: Any, base_folder: str | None = None) -> str:
    """The last lines of the try's log file (Airflow's default file layout), or "".

    Airflow 3 writes JSON lines; their ``event`` text is returned, one per line.
    """

    path = task_log_path(task_instance, base_folder)
    if path is None:
        return ""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - 4 * _TAIL_CHARS))
            lines = handle.read().decode(errors="replace").splitlines()[-_TAIL_LINES:]
    except OSError:
        return ""
    out = []
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            out.append(line)
            continue
        out.append(str(entry.get("event", line)) if isinstance(entry, dict) else line)
    return "\n".join(out)[-_TAIL_CHARS:]


def build_failure_record(task_instance: Any, error: Any, ledger: Any) -> Any:
    """The :class:`~gpusched.faults.failures.FailureRecord` of this failed try."""
    # local: failures loads the ledger (SQL tables); the plugin loads this module in every Airflow process
    from gpusched.faults.failures import FailureRecord

    key = ti_key_of(task_instance)
    allocation = ledger.get(key)
    devices: tuple[str, ...] = ()
    env_alloc = allocation_from_env(os.environ)
    if env_alloc is not None and env_alloc.get("key") == key:
        devices = tuple(str(u) for u in env_alloc.get("uuids") or ())
    if not devices and allocation is not None:
        devices = tuple(s.uuid for s in allocation.shares)
    request = allocation.request if allocation is not None else None
    if request is None:
        try:
            request = request_from_executor_config(_executor_config(task_instance))
        except Exception:
            request = None
    text = read_log_tail(task_instance)
    if isinstance(error, BaseException):
        text += "\n" + "".join(traceback.format_exception(error))
    elif error:
        text += "\n" + str(error)
    task = getattr(task_instance, "task", None)
    retries = int(getattr(task, "retries", 0) or 0)
    try_number = int(getattr(task_instance, "try_number", 0) or 0)
    map_index = getattr(task_instance, "map_index", -1)
    return FailureRecord(
        key=key, devices=devices, log_tail=text[-_TAIL_CHARS:], at=time.time(),
        dag_id=str(task_instance.dag_id), task_id=str(task_instance.task_id),
        run_id=str(task_instance.run_id), try_number=try_number,
        map_index=-1 if map_index is None else int(map_index), request=request,
        will_retry=try_number <= retries, host=socket.gethostname(), pid=os.getpid(),
    )


@hookimpl
def on_task_instance_running(previous_state: Any, task_instance: Any) -> None:
    """Register this task process under its key so the host's agent can stop it."""
    if not is_gpu_task(task_instance):
        return
    try:
        PidRegistry().register(ti_key_of(task_instance))
    except Exception:
        _log.exception("gpusched: could not register the task process for alert actions")


@hookimpl
def on_task_instance_success(previous_state: Any, task_instance: Any) -> None:
    """Forget the process registration."""
    if not is_gpu_task(task_instance):
        return
    try:
        PidRegistry().unregister(ti_key_of(task_instance))
    except Exception:
        _log.exception("gpusched: could not unregister the task process")


@hookimpl
def on_task_instance_failed(previous_state: Any, task_instance: Any, error: Any) -> None:
    """Record the failure in the ledger and, unless disabled, run the fault chain on it now
    (not for a test run: ``airflow dags test`` / ``tasks test`` say nothing about the hardware)."""
    if not is_gpu_task(task_instance):
        return
    if is_test_run(ti_key_of(task_instance)):
        _log.info("gpusched: %s is a test run; the fault chain ignores its failure", ti_key_of(task_instance))
        return
    try:
        # local: remediation loads placement (numpy), the ledger its SQL tables; wanted only when a GPU
        # task fails, not at plugin load (every Airflow process)
        from gpusched.faults.failures import record_failure
        from gpusched.faults.remediation import handle_failure
        from gpusched.ledger import Ledger

        PidRegistry().unregister(ti_key_of(task_instance))
        ledger = Ledger()
        try:
            record = build_failure_record(task_instance, error, ledger)
            record_failure(ledger, record)
            if env_bool("GPUSCHED_RECOVERY_INLINE", True):
                handled = handle_failure(ledger, record)
                _log.warning(
                    "gpusched: %s failed: %s (%s); %s", record.key, handled.classification.kind,
                    "; ".join(handled.classification.evidence[:2]), handled.remedy.reason,
                )
        finally:
            ledger.close()
    except Exception:
        _log.exception("gpusched: recording the GPU task failure failed; the recovery DAG will not see it")
