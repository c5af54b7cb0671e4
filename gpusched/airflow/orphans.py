"""Which of an executor's allocations no live task needs any more (restart, dead worker).

After a crash the ledger may still hold allocations of tries that Airflow has since superseded,
or of processes that are gone. :func:`stale_reason` decides, from the task instance's current try
and state in Airflow and from whether the recorded holder processes still run, whether an
allocation must be released now (pure); :func:`task_views` and :func:`task_state` read Airflow's
metadata database, and :func:`reconcile_holder` applies the decisions to the ledger (I/O).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any, NamedTuple

from gpusched.ledger import Ledger
from gpusched.ledger.liveness import holders_alive
from gpusched.records import Allocation
from gpusched.scheduler.keys import KEY_PREFIX, TaskKeyParts, parse_ti_key, ti_key_of

__all__ = ["LIVE_STATES", "TaskView", "reconcile_holder", "stale_reason", "task_state", "task_views"]

LIVE_STATES = frozenset({"queued", "running", "restarting"})
"""Task-instance states in which a try may still use its devices."""


class TaskView(NamedTuple):
    """What Airflow says about a task instance now: its current try and state."""

    try_number: int
    state: str | None


def stale_reason(allocation: Allocation, task: TaskView | None, processes_alive: bool | None) -> str | None:
    """Why ``allocation`` (of an Airflow task try) must be released now, or None to keep it.

    ``task`` is the task instance as Airflow sees it now (None: it no longer exists);
    ``processes_alive`` is :func:`gpusched.ledger.liveness.holders_alive` of its recorded
    processes (None: unknown). A try that Airflow has superseded, or that is no longer queued or
    running, is released even if a process of it lingers; a live try whose every recorded process
    is gone is released too (Airflow then fails or retries it).
    """
    parts = parse_ti_key(allocation.key)
    if parts is None:
        return None
    if task is None:
        return "reconciled: the task instance no longer exists"
    if task.try_number > parts.try_number:
        return f"reconciled: try {parts.try_number} superseded by try {task.try_number}"
    if (task.state or "none") not in LIVE_STATES:
        return f"reconciled: task instance is {task.state or 'none'}"
    if processes_alive is False:
        pids = ", ".join(f"{p.role} {p.pid}" for p in allocation.processes)
        return f"reconciled: holder processes gone ({pids})"
    return None


def _identity(parts: TaskKeyParts) -> tuple[str, str, str, int]:
    return (parts.dag_id, parts.task_id, parts.run_id, parts.map_index)


def task_views(keys: Iterable[str]) -> dict[str, TaskView]:
    """Airflow's current view of the task instances behind ledger ``keys`` (missing ones left out)."""
    from airflow.models.taskinstance import TaskInstance as TI
    from airflow.utils.session import create_session
    from sqlalchemy import select, tuple_

    wanted: dict[tuple[str, str, str, int], list[str]] = {}
    for key in keys:
        parts = parse_ti_key(key)
        if parts is not None:
            wanted.setdefault(_identity(parts), []).append(key)
    if not wanted:
        return {}
    found: dict[str, TaskView] = {}
    identities = list(wanted)
    with create_session() as session:
        for start in range(0, len(identities), 200):
            rows = session.execute(
                select(TI.dag_id, TI.task_id, TI.run_id, TI.map_index, TI.try_number, TI.state).where(
                    tuple_(TI.dag_id, TI.task_id, TI.run_id, TI.map_index).in_(identities[start:start + 200])
                )
            ).all()
            for row in rows:
                view = TaskView(int(row[4] or 0), None if row[5] is None else str(row[5]))
                for key in wanted.get((row[0], row[1], row[2], int(row[3])), ()):
                    found[key] = view
    return found


def task_state(airflow_key: Any) -> str | None:
    """The state Airflow records now for the try ``airflow_key`` (a TaskInstanceKey), if still current."""

    view = task_views([ti_key_of(airflow_key)]).get(ti_key_of(airflow_key))
    if view is None or view.try_number != int(airflow_key.try_number):
        return None
    return view.state


def reconcile_holder(
    ledger: Ledger,
    holder: str,
    *,
    dispatched: Collection[str],
    waiting: Collection[str],
    lease_s: int,
    log: Any,
) -> list[str]:
    """Release ``holder``'s allocations that no live try needs; renew those a live process holds.

    ``dispatched`` (running under this executor) and ``waiting`` (queued in it) ledger keys are
    left alone: the executor tracks those itself. Waiting records of tasks no longer queued are
    dropped. Returns the released keys.
    """

    mine = set(dispatched) | set(waiting)
    candidates = [
        a for a in ledger.active(holder) if a.key not in mine and a.key.startswith(KEY_PREFIX)
    ]
    views = task_views(a.key for a in candidates) if candidates else {}
    released: list[str] = []
    for alloc in candidates:
        alive = holders_alive(alloc.processes)
        reason = stale_reason(alloc, views.get(alloc.key), alive)
        if reason is None:
            if alive:
                ledger.renew(alloc.key, lease_s)
            continue
        if ledger.release(alloc.key, reason=reason) is not None:
            released.append(alloc.key)
            log.warning("gpusched: released %s: %s", alloc.key, reason)
    stale_queue = [e.key for e in ledger.queue() if e.key.startswith(KEY_PREFIX) and e.key not in waiting]
    queue_views = task_views(stale_queue) if stale_queue else {}
    for key in stale_queue:
        view = queue_views.get(key)
        if view is None or (view.state or "none") not in {"queued", "scheduled"}:
            ledger.clear_queue(key)
    return released
