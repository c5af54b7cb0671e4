"""One string key per task-instance try, shared by the executor, the listener and the ledger.

Format: ``airflow/<dag_id>/<task_id>/<map_index>/<try_number>/<run_id>``. dag and task ids
cannot contain ``/``; the run id comes last so it may.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, NamedTuple

__all__ = ["KEY_PREFIX", "TaskKeyParts", "parse_ti_key", "task_of", "ti_key", "ti_key_of"]

KEY_PREFIX = "airflow/"


class TaskKeyParts(NamedTuple):
    """The parts of a task-instance key."""

    dag_id: str
    task_id: str
    run_id: str
    try_number: int
    map_index: int


def ti_key(dag_id: str, task_id: str, run_id: str, try_number: int, map_index: int = -1) -> str:
    """The ledger key of one try of one task instance."""
    return f"{KEY_PREFIX}{dag_id}/{task_id}/{map_index}/{try_number}/{run_id}"


def ti_key_of(obj: Any) -> str:
    """The ledger key of anything with dag_id, task_id, run_id, try_number and map_index.

    Works for Airflow's ``TaskInstanceKey``, ORM ``TaskInstance``, the workload's ``ti`` and the
    task-side ``RuntimeTaskInstance``.
    """
    map_index = getattr(obj, "map_index", -1)
    return ti_key(
        str(obj.dag_id), str(obj.task_id), str(obj.run_id), int(obj.try_number),
        -1 if map_index is None else int(map_index),
    )


def parse_ti_key(key: str) -> TaskKeyParts | None:
    """The parts of a key made by :func:`ti_key`, or None for any other key."""
    if not key.startswith(KEY_PREFIX):
        return None
    parts = key[len(KEY_PREFIX):].split("/", 4)
    if len(parts) != 5:
        return None
    dag_id, task_id, map_index, try_number, run_id = parts
    try:
        return TaskKeyParts(dag_id, task_id, run_id, int(try_number), int(map_index))
    except ValueError:
        return None


@lru_cache(maxsize=65536)
def task_of(key: str) -> str:
    """The task instance of ledger key ``key`` across its tries (the key without its try number)."""
    parts = parse_ti_key(key)
    if parts is None:
        return key
    return f"{KEY_PREFIX}{parts.dag_id}/{parts.task_id}/{parts.map_index}/{parts.run_id}"
