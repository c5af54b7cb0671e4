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
Airflow Pools page shows GPU capacity per partition. Both executors keep those pools sized
(:mod:`gpusched.airflow.pool_sync`).

The pool rule: a ``pool`` given to :func:`gpu` (or to :func:`gpu_task` /
:func:`gpusched.airflow.gang.gang_task`) wins — the task goes there, whatever pool sync says;
the partition pool is assigned only when no ``pool`` is given and pool sync is on. Whenever
:func:`gpu` sets a pool, ``pool_slots`` is the device count unless ``pool_slots`` is given.
(``@task(pool=..., **gpu(...))`` names ``pool`` twice, which Python refuses before any code
runs: name the pool inside ``gpu(...)``.)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from gpusched.errors import GPURequestError
from gpusched.request import REQUEST_KEYS, GPURequest
from gpusched.settings import env_bool

__all__ = [
    "CONFIG_KEY",
    "GPU_OPTIONS",
    "POOL_PREFIX",
    "POOL_SYNC_VAR",
    "gpu",
    "gpu_task",
    "is_gpu_task",
    "partition_pool",
    "request_from_executor_config",
    "split_task_kwargs",
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

GPU_OPTIONS: frozenset[str] = frozenset({"pool_sync", "pool", "pool_slots"})
"""The keywords of :func:`gpu` besides the request fields (``pool`` and ``pool_slots`` are also
``@task``'s: :func:`gpu` passes them on under the pool rule)."""

_MAX_POOL_NAME = 256  # Airflow's slot_pool.pool column


def partition_pool(partition: str) -> str:
    """The Airflow pool name of a capacity partition (``"training"`` → ``"gpu_training"``)."""
    return f"{POOL_PREFIX}{partition}"


def gpu(
    *,
    pool_sync: bool | None = None,
    pool: str | None = None,
    pool_slots: int | None = None,
    **request_kwargs: Any,
) -> dict[str, Any]:
    """Operator keyword arguments that make a task a GPU task.

    Args:
        pool_sync: assign the partition pool (default: the ``GPUSCHED_POOL_SYNC`` variable).
        pool: an Airflow pool of your own. It wins: the partition pool is then not assigned,
            whatever ``pool_sync`` says.
        pool_slots: the task's slots in its pool (default: the device count).
        **request_kwargs: the fields of :meth:`GPURequest.build` (``gpus``, ``memory``,
            ``vendor``, ``models``, ``interconnect``, ``partition``, ``tenant``, ``priority`` …).

    Returns:
        ``{"executor_config": {"gpusched": {...}}}``, plus ``pool`` and ``pool_slots`` when
        ``pool`` is given or pool sync is on.
        Spread it into an operator or ``@task``: ``BashOperator(..., **gpu(gpus=1))``.

    Raises:
        GPURequestError: an invalid field (at DAG parse time).
    """
    if pool is not None and (not isinstance(pool, str) or not pool.strip() or len(pool) > _MAX_POOL_NAME):
        raise GPURequestError("pool", pool, f"the name of an Airflow pool (1-{_MAX_POOL_NAME} characters)")
    if pool_slots is not None and (isinstance(pool_slots, bool) or not isinstance(pool_slots, int)
                                   or pool_slots < 1):
        raise GPURequestError("pool_slots", pool_slots, "an integer >= 1 (slots the task takes in its pool)")
    request = GPURequest.build(**request_kwargs)
    kwargs: dict[str, Any] = {"executor_config": {CONFIG_KEY: request.to_dict()}}
    if pool_sync is None:
        pool_sync = env_bool(POOL_SYNC_VAR)
    if pool is None and pool_sync:
        pool = partition_pool(str(request.partition))
    if pool is not None:
        kwargs["pool"] = pool
        kwargs["pool_slots"] = request.count if pool_slots is None else pool_slots
    elif pool_slots is not None:
        kwargs["pool_slots"] = pool_slots  # slots in the task's default pool
    return kwargs


def split_task_kwargs(kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Split a decorator's keywords into those of :func:`gpu`, those of ``@task`` and the author's
    own ``executor_config``, so that no keyword reaches ``@task`` twice or unknown to it.

    Returns:
        (request fields and :data:`GPU_OPTIONS`, every other keyword, the ``executor_config``
        given or ``{}``).

    Raises:
        GPURequestError: ``executor_config`` is not a mapping.
    """
    gpu_kwargs = {k: v for k, v in kwargs.items() if k in REQUEST_KEYS or k in GPU_OPTIONS}
    task_kwargs = {k: v for k, v in kwargs.items() if k not in gpu_kwargs and k != "executor_config"}
    user_config = kwargs.get("executor_config") or {}
    if not isinstance(user_config, Mapping):
        raise GPURequestError("executor_config", user_config, "a mapping (dict)")
    return gpu_kwargs, task_kwargs, dict(user_config)


def gpu_task(python_callable: Callable[..., Any] | None = None, **kwargs: Any) -> Any:
    """``@task`` for a GPU task: request fields and ``@task`` arguments in one call.

    Keywords that :meth:`GPURequest.build` accepts form the request and :data:`GPU_OPTIONS`
    (``pool_sync``, ``pool``, ``pool_slots``) go to :func:`gpu` and its pool rule; the rest
    (``retries``, ``task_id``, ``executor_config`` …) go to ``airflow.sdk.task``. An
    ``executor_config`` of your own is merged with the request. Use as
    ``@gpu_task(gpus=4, interconnect="island")`` or bare ``@gpu_task`` (one whole device).
    """
    from airflow.sdk import task

    gpu_kwargs, task_kwargs, user_config = split_task_kwargs(kwargs)
    extra = gpu(**gpu_kwargs)
    extra["executor_config"] = {**user_config, **extra["executor_config"]}
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
