"""The task's own log file: where an Airflow user reads why a GPU task failed or waits.

Airflow's log reader serves a finished try from the local file
``[logging] base_log_folder/dag_id=…/run_id=…/task_id=…[/map_index=…]/attempt=<try>.log`` (the
default ``log_filename_template``). A try the executor fails before it starts has no such file,
and the Logs tab then only says "Could not read served logs"; the executor writes its reason
there instead, as one of Airflow 3's JSON log lines.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

__all__ = ["append_task_log", "task_log_path"]

_log = logging.getLogger("gpusched.task_log")


def task_log_path(ti: Any, base_folder: str | None = None) -> Path | None:
    """The local log file of ``ti``'s try (anything with dag_id, task_id, run_id, try_number,
    map_index), or None when Airflow's logging settings cannot be read."""
    if base_folder is None:
        try:
            from airflow.configuration import conf

            base_folder = conf.get("logging", "base_log_folder")
        except Exception:
            return None
    map_index = getattr(ti, "map_index", -1)
    path = Path(base_folder) / f"dag_id={ti.dag_id}" / f"run_id={ti.run_id}" / f"task_id={ti.task_id}"
    if map_index is not None and map_index >= 0:
        path = path / f"map_index={map_index}"
    return path / f"attempt={ti.try_number}.log"


def append_task_log(ti: Any, message: str, *, level: str = "error", base_folder: str | None = None) -> bool:
    """Append ``message`` to ``ti``'s try log as an Airflow JSON log line; False if it could not."""
    path = task_log_path(ti, base_folder)
    if path is None:
        return False
    line = {"timestamp": datetime.now(UTC).isoformat(), "level": level, "event": message,
            "logger": "gpusched.executor"}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(line) + "\n")
    except OSError as exc:
        _log.warning("gpusched: cannot write the task log %s: %s", path, exc)
        return False
    return True
