"""Per-task environment for LocalExecutor workers.

LocalExecutor workers are long-lived processes that take workloads off one shared queue and fork
the task process, which inherits the worker's ``os.environ``. So the executor puts
``(workload, env)`` pairs on the queue for GPU tasks, and each worker reads the queue through
:class:`EnvApplyingQueue`: it sets the pair's variables just before the workload runs and puts
the previous values back before it takes the next item. Plain workloads and the ``None`` poison
pill pass through unchanged.

A worker is the supervisor of the task it runs, so each worker records itself in the ledger as a
holder of the allocation it picks up (:func:`record_worker`): if it dies, the executor — or, after
a restart, ``reconcile`` — sees that the devices' holder is gone.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any, Protocol

from gpusched.hardware.envexport import ALLOCATION_VAR
from gpusched.ledger import Ledger
from gpusched.ledger.liveness import current_process

__all__ = ["EnvApplyingQueue", "QueueLike", "apply_env", "record_worker", "restore_env", "run_gpu_worker"]

_log = logging.getLogger("gpusched.dispatch")


class QueueLike(Protocol):
    """The one method a worker uses on its input queue."""

    def get(self) -> Any:
        """Block until an item is available and return it."""
        ...


def apply_env(env: Mapping[str, str], environ: MutableMapping[str, str]) -> dict[str, str | None]:
    """Set ``env`` in ``environ``; return what to put back (None = the key was absent)."""
    previous: dict[str, str | None] = {}
    for name, value in env.items():
        previous[name] = environ.get(name)
        environ[name] = value
    return previous


def restore_env(previous: Mapping[str, str | None], environ: MutableMapping[str, str]) -> None:
    """Undo :func:`apply_env`."""
    for name, value in previous.items():
        if value is None:
            environ.pop(name, None)
        else:
            environ[name] = value


class EnvApplyingQueue:
    """Worker-side view of the activity queue that applies each GPU workload's environment.

    ``get`` first restores the environment changed for the previous item (the worker only asks
    for the next item once the previous task has finished), then returns the next item: for a
    ``(workload, env)`` pair it applies ``env`` to ``environ`` and returns the workload.
    """

    def __init__(
        self,
        inner: QueueLike,
        environ: MutableMapping[str, str] | None = None,
        on_pickup: Callable[[Mapping[str, str]], None] | None = None,
    ) -> None:
        self._inner = inner
        self._environ: MutableMapping[str, str] = os.environ if environ is None else environ
        self._previous: dict[str, str | None] = {}
        self._on_pickup = on_pickup

    def get(self) -> Any:
        """The next workload (or poison pill), with its environment applied."""
        self.clear()
        item = self._inner.get()
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], Mapping):
            workload, env = item
            self._previous = apply_env(env, self._environ)
            if self._on_pickup is not None:
                self._on_pickup(env)
            return workload
        return item

    def clear(self) -> None:
        """Put back the variables changed for the last workload."""
        if self._previous:
            restore_env(self._previous, self._environ)
            self._previous = {}


def run_gpu_worker(
    logger_name: str,
    input: QueueLike,  # the keyword LocalExecutor passes it under
    output: Any,
    unread_messages: Any,
    team_conf: Any,
) -> None:
    """LocalExecutor's worker loop, reading its queue through :class:`EnvApplyingQueue`."""
    from airflow.executors.local_executor import _run_worker

    queue = EnvApplyingQueue(input, on_pickup=record_worker)
    _run_worker(logger_name, queue, output, unread_messages, team_conf)  # type: ignore[arg-type]


_worker_ledger: Any = None


def record_worker(env: Mapping[str, str]) -> None:
    """Record this process as the ``worker`` holder of the allocation named in ``env`` (never raises)."""
    global _worker_ledger

    try:
        key = json.loads(env.get(ALLOCATION_VAR) or "{}").get("key")
        if not key:
            return

        if _worker_ledger is None:
            _worker_ledger = Ledger(lock_wait_s=10.0)
        _worker_ledger.attach_process(str(key), current_process("worker"))
    except Exception:  # the task runs anyway; only crash recovery gets slower (lease)
        _log.exception("gpusched: could not record the worker as the holder of its allocation")
