"""Declare what a task needs, in the DAG file: ``@task(**gpu(gpus=2, memory="40GiB"))``.

The request is validated when the DAG is parsed (a wrong field is a :class:`GPURequestError`
shown as an import error in the Airflow UI, naming the field and what it accepts) and travels in
the task's ``executor_config`` as ``{"gpusched": GPURequest.to_dict()}``, where the GPU executor
finds it.

This module is imported by DAG files, so it stays light: the standard library and the gpusched
vocabulary only; ``airflow.sdk`` is imported inside :func:`gpu_task`.

Pool sync: when ``GPUSCHED_POOL_SYNC`` is true in the DAG processor's environment (or
``pool_sync=True`` is passed), :func:`gpu` also sets ``pool`` to the partition's pool
(``gpu_training``, ``gpu_burst``, ``gpu_dev``) and ``pool_slots`` to the device count, so the
Airflow Pools page shows GPU capacity per partition.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from gpusched.errors import GPURequestError
from gpusched.request import REQUEST_KEYS, GPURequest
from gpusched.settings import env_bool

__all__ = [
    "CONFIG_KEY",
    "POOL_PREFIX",
    "POOL_SYNC_VAR",
    "gpu",
    "gpu_task",
    "is_gpu_task",
    "partition_pool",
    "request_from_executor_config",
]

CONFIG_KEY = "gpusched"
"""The key of the request inside a task's ``executor_config``."""



def is_gpu_task(obj: Any) -> bool:
    """True when ``obj``'s ``executor_config`` carries a request under :data:`CONFIG_KEY`.

    ``obj`` may be a task, a task instance (its task's config first, then its own) or an executor
    workload (its ``ti``'s config): the first ``executor_config`` found decides.
    """
    for holder in (getattr(obj, "task", None), getattr(obj, "ti", None), obj):
        config = getattr(holder, "executor_config", None) if holder is not None else None
        if config is not None:
            return isinstance(config, dict) and CONFIG_KEY in config
    return False


POOL_PREFIX = "gpu_"
"""Partition pools are named ``gpu_<partition>``."""

POOL_SYNC_VAR = "GPUSCHED_POOL_SYNC"
"""Environment switch: when true, :func:`gpu` also assigns the partition's Airflow pool."""

def partition_pool(partition: str) -> str:
    """The Airflow pool name of a capacity partition (``"training"`` → ``"gpu_training"``)."""
    return f"{POOL_PREFIX}{partition}"


def gpu(*, pool_sync: bool | None = None, **request_kwargs: Any) -> dict[str, Any]:
    """Operator keyword arguments that make a task a GPU task.

    Args:
        pool_sync: assign the partition pool (default: the ``GPUSCHED_POOL_SYNC`` variable).
        **request_kwargs: the fields of :meth:`GPURequest.build` (``gpus``, ``memory``,
            ``vendor``, ``models``, ``interconnect``, ``partition``, ``tenant``, ``priority`` …).

    Returns:
        ``{"executor_config": {"gpusched": {...}}}``, plus ``pool`` and ``pool_slots`` when pool
        sync is on. Spread it into an operator or ``@task``: ``BashOperator(..., **gpu(gpus=1))``.

    Raises:
        GPURequestError: an invalid field (at DAG parse time).
    """
    request = GPURequest.build(**request_kwargs)
    kwargs: dict[str, Any] = {"executor_config": {CONFIG_KEY: request.to_dict()}}
    if pool_sync is None:
        pool_sync = env_bool(POOL_SYNC_VAR)
    if pool_sync:
        kwargs["pool"] = partition_pool(str(request.partition))
        kwargs["pool_slots"] = request.count
    return kwargs


def gpu_task(python_callable: Callable[..., Any] | None = None, **kwargs: Any) -> Any:
    """``@task`` for a GPU task: request fields and ``@task`` arguments in one call.

    Keywords that :meth:`GPURequest.build` accepts form the request; the rest (``retries``,
    ``task_id``, ``executor_config`` …) go to ``airflow.sdk.task``. An ``executor_config`` of
    your own is merged with the request. Use as ``@gpu_task(gpus=4, interconnect="island")`` or
    bare ``@gpu_task`` (one whole device).
    """
    from airflow.sdk import task

    request_kwargs = {k: v for k, v in kwargs.items() if k in REQUEST_KEYS}
    pool_sync = kwargs.pop("pool_sync", None)
    task_kwargs = {k: v for k, v in kwargs.items() if k not in REQUEST_KEYS}
    extra = gpu(pool_sync=pool_sync, **request_kwargs)
    user_config = task_kwargs.pop("executor_config", None) or {}
    if not isinstance(user_config, Mapping):
        raise GPURequestError("executor_config", user_config, "a mapping (dict)")
    extra["executor_config"] = {**user_config, **extra["executor_config"]}
    for name in ("pool", "pool_slots"):
        if name in task_kwargs:  # an explicit pool wins over the partition pool
            extra.pop(name, None)
    if python_callable is None:
        return task(**task_kwargs, **extra)
    return task(python_callable, **task_kwargs, **extra)


def request_from_executor_config(executor_config: object) -> GPURequest | None:
    """The GPU request in a task's ``executor_config``, or None for a task that needs no GPU.

    Raises:
        GPURequestError: the ``gpusched`` entry is present but invalid.
    """
    if not isinstance(executor_config, Mapping):
        return None
    data = executor_config.get(CONFIG_KEY)
    if data is None:
        return None
    return GPURequest.from_dict(data)
