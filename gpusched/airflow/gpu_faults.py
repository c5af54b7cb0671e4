"""What the GPU core does when something goes away: lost GPU hosts, dead workers, broken gangs.

Both run from :meth:`gpusched.airflow.gpu_scheduling.GPUScheduling.periodic` in the scheduler
process: a lost host's allocations are released and its tasks failed through the executor (so
Airflow retries them elsewhere); a gang with a failed member has its other members stopped.
"""

from __future__ import annotations

import socket
from typing import Any, Protocol

from gpusched.airflow.executor_compat import save_task_event
from gpusched.ledger.liveness import process_alive
from gpusched.scheduler.keys import parse_ti_key, ti_key

__all__ = ["FaultCore", "fail_orphaned", "handle_lost_hosts", "stop_broken_gangs"]


class FaultCore(Protocol):
    """What these handlers use of :class:`~gpusched.airflow.gpu_scheduling.GPUScheduling`."""

    executor: Any
    gangs: dict[str, set[Any]]
    gpu_running: dict[Any, str]
    holder: str
    host_timeout_s: float

    @property
    def log(self) -> Any: ...

    @property
    def ledger(self) -> Any: ...

    def release(self, key: Any, reason: str) -> None: ...

    def requeue_unstarted(self, key: Any, reason: str) -> bool: ...


def handle_lost_hosts(core: FaultCore, now: float) -> list[str]:
    """Mark silent GPU hosts lost; release their allocations and fail their tasks (node lost).

    A task sent to a lost host that never started is placed again instead, without spending a
    retry, when the executor can tell (``core.requeue_unstarted``).
    """
    from airflow.models.taskinstancekey import TaskInstanceKey

    lost_keys: list[str] = []
    for host in core.ledger.mark_lost_hosts(core.host_timeout_s, now=now):
        nodes = set(core.ledger.host_nodes(host.name))
        core.log.error("gpusched: GPU host %s lost: %s", host.name, host.reason)
        by_ledger_key = {v: k for k, v in core.gpu_running.items()}
        for alloc in core.ledger.active():
            if not any(s.node in nodes for s in alloc.shares):
                continue
            reason = f"{host.reason}; its devices are released and the task is retried on another host"
            core.ledger.release(alloc.key, reason=reason, now=now)
            core.ledger.record_event("node_lost", alloc.key, now=now, host=host.name, reason=host.reason)
            lost_keys.append(alloc.key)
            airflow_key = by_ledger_key.get(alloc.key)
            if airflow_key is None:
                parts = parse_ti_key(alloc.key)
                if parts is None:
                    continue
                airflow_key = TaskInstanceKey(parts.dag_id, parts.task_id, parts.run_id,
                                              parts.try_number, parts.map_index)
            if core.requeue_unstarted(airflow_key, f"GPU host {host.name} lost"):
                continue
            core.gpu_running.pop(airflow_key, None)
            save_task_event(core.executor, event="gpusched.node_lost", extra=reason, ti_key=airflow_key)
            core.executor.fail(airflow_key, info=reason)
    return lost_keys


def stop_broken_gangs(core: FaultCore) -> list[Any]:
    """Stop the live members of every launched gang one of whose members failed (or was lost).

    The stopped members fail now (their retries wait for the whole gang again); Airflow's
    task supervisor ends their processes at the next heartbeat. Returns the stopped keys.
    """
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session
    from sqlalchemy import and_, or_, select

    keys = {k for members in core.gangs.values() for k in members}
    ti = TaskInstance
    with create_session() as session:
        rows = session.execute(select(ti.dag_id, ti.task_id, ti.run_id, ti.map_index, ti.try_number,
                                      ti.state).where(or_(*(and_(
            ti.dag_id == k.dag_id, ti.task_id == k.task_id, ti.run_id == k.run_id,
            ti.map_index == k.map_index) for k in keys)))).all()
    state = {}
    for r in rows:
        for k in keys:
            if (k.dag_id, k.task_id, k.run_id, k.map_index) == (r[0], r[1], r[2], r[3]):
                state[k] = str(r[5]) if r[4] == k.try_number else "superseded"
    broken_states = {"failed", "up_for_retry", "upstream_failed", "removed", "superseded"}
    live_states = {"queued", "running", "scheduled", "None"}
    stopped = []
    for gang, members in list(core.gangs.items()):
        broken = sorted(str(k.task_id) for k in members if state.get(k) in broken_states)
        if broken:
            reason = (f"multi-node gang member {', '.join(broken)} failed; stopping the other members "
                      "so that the gang is retried as a whole")
            for k in members:
                if state.get(k) in live_states and k.task_id not in broken:
                    ledger_key = ti_key(k.dag_id, k.task_id, k.run_id, k.try_number, k.map_index)
                    core.ledger.record_event("gang_stopped", ledger_key, reason=reason)
                    core.release(k, reason)
                    save_task_event(core.executor, event="gpusched.gang_stopped", extra=reason, ti_key=k)
                    core.executor.fail(k, info=reason)
                    stopped.append(k)
        if broken or not any(state.get(k) in live_states for k in members):
            del core.gangs[gang]
    return stopped


def fail_orphaned(core: FaultCore) -> list[str]:
    """Release and fail the tries whose LocalExecutor worker (their supervisor) died.

    Judged by pid and start time (a respawned worker may reuse a dead one's pid); a task
    whose worker has not picked it up yet has no worker record and is left alone.
    """

    host = socket.gethostname()
    by_ledger_key = {v: k for k, v in core.gpu_running.items()}
    failed = []
    for alloc in core.ledger.active(core.holder):
        airflow_key = by_ledger_key.get(alloc.key)
        workers = [p for p in alloc.processes if p.role == "worker" and p.host == host]
        if airflow_key is None or not workers or process_alive(workers[-1]) is not False:
            continue
        reason = f"worker process {workers[-1].pid} died"
        core.release(airflow_key, reason)
        core.log.error("gpusched: %s: %s; failing the try so Airflow retries it", alloc.key, reason)
        core.executor.fail(airflow_key, info=f"gpusched: {reason}")
        failed.append(alloc.key)
    return failed
