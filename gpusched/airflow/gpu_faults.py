"""What the GPU core does when something goes away: lost GPU hosts, dead workers, broken gangs.

Both run from :meth:`gpusched.airflow.gpu_scheduling.GPUScheduling.periodic` in the scheduler
process: a lost host's allocations are quarantined (its agent confirms their processes are gone)
and its tasks failed through the executor (so Airflow retries them elsewhere); a gang with a
failed member has its other members stopped.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from gpusched.airflow.executor_compat import save_task_event
from gpusched.ledger.hosts import HostState
from gpusched.ledger.liveness import process_alive
from gpusched.records import AllocationStatus
from gpusched.scheduler.hosts import quarantine_reason, record_verdicts
from gpusched.scheduler.keys import parse_ti_key, ti_key

__all__ = ["FaultCore", "fail_orphaned", "handle_lost_hosts", "quarantine_if_unconfirmed",
           "stop_broken_gangs", "tries_heard"]

if TYPE_CHECKING:  # typing only: the ledger loads its SQL tables, Airflow's executor its models
    from airflow.executors.base_executor import BaseExecutor
    from airflow.models.taskinstancekey import TaskInstanceKey

    from gpusched.scheduler.ledger_store import LedgerStore


class FaultCore(Protocol):
    """What these handlers use of :class:`~gpusched.airflow.gpu_scheduling.GPUScheduling`."""

    executor: BaseExecutor
    gangs: dict[str, set[TaskInstanceKey]]
    gpu_running: dict[TaskInstanceKey, str]
    holder: str
    host_timeout_s: float

    @property
    def log(self) -> logging.Logger: ...

    @property
    def ledger(self) -> LedgerStore: ...

    def release(self, key: TaskInstanceKey, reason: str) -> None: ...

    def requeue_unstarted(self, key: TaskInstanceKey, reason: str) -> bool: ...


def handle_lost_hosts(core: FaultCore, now: float) -> list[str]:
    """Judge the GPU hosts (:func:`gpusched.scheduler.hosts.judge_hosts`) and act on the verdicts.

    A lost host's active allocations are quarantined, not released: their devices stay out of
    placement until the host's agent confirms the tries' processes are gone. Each of its tries
    is failed through the executor (Airflow retries it; the host's nodes are out of the
    snapshot, so elsewhere), or placed again without spending a retry when it surely never
    started (``core.requeue_unstarted``). An unconfirmed host (agent silent, its tries still
    heartbeating) keeps its running work. Returns the ledger keys of the lost host's tries.
    """
    from airflow.models.taskinstancekey import TaskInstanceKey

    hosts = core.ledger.hosts()
    if not hosts:
        return []
    silent = [h.name for h in hosts
              if h.state != HostState.LOST and now - h.last_heartbeat > core.host_timeout_s]
    heard = tries_heard(core.ledger, silent) if silent else {}
    lost_keys: list[str] = []
    for verdict in record_verdicts(core.ledger, hosts, now, core.host_timeout_s, heard):
        if verdict.state != HostState.LOST:
            core.log.warning("gpusched: GPU host %s: %s", verdict.name, verdict.reason)
            continue
        core.log.error("gpusched: GPU host %s lost: %s", verdict.name, verdict.reason)
        nodes = set(core.ledger.host_nodes(verdict.name))
        by_ledger_key = {v: k for k, v in core.gpu_running.items()}
        for alloc in core.ledger.active():
            if alloc.status != AllocationStatus.ACTIVE or not any(s.node in nodes for s in alloc.shares):
                continue
            parts = parse_ti_key(alloc.key)
            reason = quarantine_reason(verdict.name, verdict.reason, parts.try_number if parts else None)
            core.ledger.quarantine(alloc.key, host=verdict.name, reason=reason, now=now)
            core.ledger.record_event("node_lost", alloc.key, now=now, host=verdict.name,
                                     reason=verdict.reason)
            lost_keys.append(alloc.key)
            airflow_key = by_ledger_key.get(alloc.key)
            if airflow_key is None:
                if parts is None:
                    continue
                airflow_key = TaskInstanceKey(parts.dag_id, parts.task_id, parts.run_id,
                                              parts.try_number, parts.map_index)
            if core.requeue_unstarted(airflow_key, f"GPU host {verdict.name} lost"):
                continue
            core.gpu_running.pop(airflow_key, None)
            failed = f"{verdict.reason}; the task is retried on another host"
            save_task_event(core.executor, event="gpusched.node_lost", extra=failed, ti_key=airflow_key)
            core.executor.fail(airflow_key, info=failed)
    return lost_keys


def quarantine_if_unconfirmed(core: FaultCore, key: TaskInstanceKey, reason: str) -> bool:
    """Quarantine try ``key`` (True) instead of releasing it when its devices are on a GPU host
    that is not live now: the executor heard that its process ended, but nothing on that host
    can confirm it (e.g. Airflow's task heartbeat timeout failed a try whose worker died), so its
    devices wait for the host's agent. False: no such host; release as usual."""
    ledger_key = core.gpu_running.get(key)
    alloc = core.ledger.get(ledger_key) if ledger_key is not None else None
    if alloc is None or alloc.released_at is not None or alloc.status != AllocationStatus.ACTIVE:
        return False
    node_hosts = core.ledger.node_hosts()
    hosts = {node_hosts[s.node] for s in alloc.shares if s.node in node_hosts}
    away = sorted(name for name, state in hosts if state != HostState.LIVE)
    if not away:
        return False
    parts = parse_ti_key(alloc.key)
    why = f"{reason}, but GPU host {away[0]} is {dict(hosts)[away[0]]}"
    core.ledger.quarantine(alloc.key, host=away[0], reason=quarantine_reason(
        away[0], why, parts.try_number if parts else None))
    core.gpu_running.pop(key, None)
    core.log.warning("gpusched: %s quarantined: %s", alloc.key, why)
    return True


def tries_heard(ledger: LedgerStore, hosts: Sequence[str]) -> dict[str, float]:
    """GPU host -> the newest heartbeat (epoch s) Airflow's task supervisors sent for the running
    tries whose active allocations are on that host (hosts without one are left out)."""
    from airflow.models.taskinstance import TaskInstance as TI
    from airflow.utils.session import create_session
    from sqlalchemy import select, tuple_

    node_host = {node: host for host in hosts for node in ledger.host_nodes(host)}
    wanted: dict[tuple[str, str, str, int, int], str] = {}
    for alloc in ledger.active():
        host = next((node_host[s.node] for s in alloc.shares if s.node in node_host), None)
        parts = parse_ti_key(alloc.key)
        if host is None or parts is None or alloc.status != AllocationStatus.ACTIVE:
            continue
        wanted[(parts.dag_id, parts.task_id, parts.run_id, parts.map_index, parts.try_number)] = host
    heard: dict[str, float] = {}
    if not wanted:
        return heard
    identities = list(wanted)
    with create_session() as session:
        for start in range(0, len(identities), 200):
            rows = session.execute(select(TI.dag_id, TI.task_id, TI.run_id, TI.map_index, TI.try_number,
                                          TI.last_heartbeat_at).where(
                tuple_(TI.dag_id, TI.task_id, TI.run_id, TI.map_index, TI.try_number).in_(
                    identities[start:start + 200]), TI.state == "running")).all()
            for row in rows:
                if row[5] is None:
                    continue
                host = wanted[(row[0], row[1], row[2], int(row[3]), int(row[4]))]
                heard[host] = max(heard.get(host, 0.0), row[5].timestamp())
    return heard


def stop_broken_gangs(core: FaultCore) -> list[TaskInstanceKey]:
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
