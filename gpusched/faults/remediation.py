"""Applying decisions: alert actions and recovery remedies turned into ledger writes and signals.

The policies (:mod:`gpusched.faults.alerts`, :mod:`gpusched.faults.classify`,
:mod:`gpusched.faults.remedies`) return data; this edge module does what the data says:

- :func:`apply_actions` — ``set_health`` / ``cordon`` through the ledger, ``stop_task`` through a
  :class:`TaskStopper`, ``notify`` as an ``alert`` ledger event.
- :func:`handle_failure` — the fault chain for one recorded failure: classify it with the
  devices' state from the ledger, choose the remedy, cordon / mark unhealthy, write the request
  override for the retry, record a scale-out request on shortage, and mark the failure handled.

Stopping a task (a ``stop_task`` action) goes through a :class:`~gpusched.faults.stopping.TaskStopper`
(:mod:`gpusched.faults.stopping`: the per-host registry of task processes and the stopper).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass

from gpusched.capacity.scaling import LocalFleetScaler, ScalingPlan, scaler_from_spec
from gpusched.errors import GpuschedError
from gpusched.faults.alerts import Action, ActionKind
from gpusched.faults.classify import Classification, classify_failure
from gpusched.faults.failures import FailureRecord, mark_handled, record_failure, refuse_retry, set_override
from gpusched.faults.remedies import Remedy, choose_remedy
from gpusched.faults.stopping import TaskStopper
from gpusched.ledger import Ledger
from gpusched.model import FleetSnapshot, Health

__all__ = [
    "SCALE_OUT",
    "Handled",
    "apply_actions",
    "apply_remedy",
    "handle_failure",
]

SCALE_OUT = "scale_out_request"
"""Ledger event kind: the fleet lacks capacity for a retry (the scaler reads these)."""


def apply_actions(
    actions: Sequence[Action], ledger: Ledger, stopper: TaskStopper | None = None, *, now: float | None = None
) -> list[str]:
    """Carry out alert actions; returns one line per action saying what was done."""
    done: list[str] = []
    for action in actions:
        if action.kind is ActionKind.SET_HEALTH and action.health is not None:
            ledger.set_health(action.target, action.health, f"{action.rule}: {action.reason}", now=now)
            done.append(f"{action.target}: health → {action.health} ({action.rule})")
        elif action.kind is ActionKind.CORDON:
            ledger.cordon(action.target, f"{action.rule}: {action.reason}", now=now)
            done.append(f"{action.target}: cordoned ({action.rule})")
        elif action.kind is ActionKind.STOP_TASK:
            # The alert is written before the signal, so a failure the task reports itself is
            # already classified as this stop (see handle_failure).
            ledger.record_event("alert", action.target, now=now, rule=action.rule, uuid=action.uuid,
                                reason=action.reason, action="stop_task")
            stopped = stopper(action.target, action.reason) if stopper is not None else False
            if stopped:
                _record_stop(ledger, action, now)
            verdict = "stopped" if stopped else "NOT stopped (no running process registered on this host)"
            done.append(f"{action.target}: task {verdict} ({action.rule}: {action.reason})")
        else:
            ledger.record_event("alert", action.target, now=now, rule=action.rule, uuid=action.uuid,
                                reason=action.reason, action=str(action.kind))
            done.append(f"{action.target}: {action.rule}: {action.reason}")
    return done


def _record_stop(ledger: Ledger, action: Action, now: float | None) -> None:
    # A killed task process cannot report its own failure: record it and run the chain on it.
    alloc = ledger.get(action.target)
    record = FailureRecord(
        key=action.target, devices=tuple(s.uuid for s in alloc.shares) if alloc else (action.uuid,),
        log_tail=f"gpusched agent stopped the task ({action.rule}): {action.reason}",
        at=time.time() if now is None else now, request=alloc.request if alloc else None,
        host=socket.gethostname(), extra={"stopped_by": "gpusched agent", "rule": action.rule},
    )
    record_failure(ledger, record)
    handle_failure(ledger, record, now=now)


@dataclass(frozen=True, slots=True)
class Handled:
    """What the chain did about one failure."""

    record: FailureRecord
    classification: Classification
    remedy: Remedy
    applied: tuple[str, ...]


def apply_remedy(
    remedy: Remedy,
    record: FailureRecord,
    ledger: Ledger,
    *,
    run_scoped: bool = True,
    now: float | None = None,
) -> list[str]:
    """Do what ``remedy`` says for ``record``; returns one line per change.

    The override is scoped to the failed task's DAG run (``run_scoped``) or to every run.
    """
    done: list[str] = []
    snapshot = ledger.snapshot()
    known = {d.uuid for d in snapshot.devices()} | {n.name for n in snapshot.nodes}
    for uuid in remedy.mark_unhealthy:
        if uuid in known:
            ledger.set_health(uuid, Health.UNHEALTHY, f"fault chain: {remedy.reason}", now=now)
            done.append(f"{uuid}: health → unhealthy")
    for target in remedy.cordon:
        if target in known:
            ledger.cordon(target, f"fault chain ({record.key}): {remedy.reason}", now=now)
            done.append(f"{target}: cordoned")
    if not remedy.retry and record.will_retry and record.dag_id and record.task_id:
        refuse_retry(ledger, record.dag_id, record.task_id, record.run_id, record.try_number + 1,
                     reason=remedy.reason, now=now)
        done.append(f"{record.dag_id}.{record.task_id}: retry {record.try_number + 1} refused")
    if remedy.retry and remedy.request is not None and record.dag_id and record.task_id:
        set_override(ledger, record.dag_id, record.task_id, remedy.request, reason=remedy.reason,
                     run_id=record.run_id if run_scoped else None, now=now)
        done.append(f"{record.dag_id}.{record.task_id}: request override {remedy.request.to_dict()}")
    if remedy.scale_out is not None:
        result = _activate(remedy, snapshot, now) if remedy.activate else None
        ledger.record_event(SCALE_OUT, record.key, now=now, request=remedy.scale_out.to_dict(),
                            reason=remedy.reason, activate=list(remedy.activate), scaler=result)
        done.append(f"scale-out requested for {remedy.scale_out.count} device(s)"
                    + (f": {result}" if result else ""))
    return done


def _activate(remedy: Remedy, snapshot: FleetSnapshot, now: float | None) -> str:
    """Ask the configured scaler (``GPUSCHED_SCALER``) to activate the remedy's standby nodes."""

    try:
        scaler = scaler_from_spec()
        # Keep the burst reserve the forecaster set; this plan only adds nodes.
        reserve = 0
        if isinstance(scaler, LocalFleetScaler):
            reserve = int(scaler.state().get("burst_reserve_gpus", 0))
        active = sum(len(n.devices) for n in snapshot.nodes if not n.standby and not n.cordoned)
        added = sum(len(snapshot.node(n).devices) for n in remedy.activate)
        plan = ScalingPlan(
            created_at=time.time() if now is None else now, provisioning_delay_s=0, active_gpus=active,
            target_gpus=active + added, activate=remedy.activate, surplus_gpus=0,
            burst_reserve_gpus=reserve, steps=(), model="fault-recovery", reason=remedy.reason,
        )
        outcome = scaler.apply(plan)
    except GpuschedError as exc:
        return f"scaler failed: {exc}"
    return f"{outcome.provider}: activated {', '.join(outcome.activated) or 'nothing'} ({outcome.detail})"


def handle_failure(
    ledger: Ledger,
    record: FailureRecord,
    *,
    max_attempts: int = 3,
    run_scoped: bool = True,
    xid_window_s: float = 600.0,
    now: float | None = None,
) -> Handled:
    """Classify one recorded failure, apply the remedy and mark it handled.

    Device evidence comes from the ledger: the devices' health now and the Xid codes in their
    samples of the last ``xid_window_s`` seconds before the failure.
    """
    at = time.time() if now is None else now
    snapshot = ledger.snapshot(at)
    health = {u: snapshot.device(u).health for u in record.devices if snapshot.has_device(u)}
    xids = {u: [x for s in ledger.samples(u, record.at - xid_window_s) for x in s.xid_errors]
            for u in record.devices}
    stops = [str(e.detail.get("reason", "")) for e in ledger.events(200, kinds=("alert",))
             if e.subject == record.key and e.detail.get("action") == "stop_task"]
    classification = classify_failure(record.log_tail, health, xids, stops)
    request = record.request
    if request is None:
        alloc = ledger.get(record.key)
        request = alloc.request if alloc is not None else None
    if request is None:
        remedy = Remedy(False, f"{classification.kind}: the task's GPU request is unknown; cannot retry it")
    else:
        remedy = choose_remedy(classification, request, record.devices, snapshot,
                               attempt=max(record.try_number, 1), max_attempts=max_attempts)
    applied = apply_remedy(remedy, record, ledger, run_scoped=run_scoped, now=at)
    mark_handled(
        ledger, record.key, now=at, failure_kind=str(classification.kind),
        evidence=list(classification.evidence),
        retry=remedy.retry, reason=remedy.reason, applied=applied,
        request=remedy.request.to_dict() if remedy.request else None,
        dag_id=record.dag_id, task_id=record.task_id, run_id=record.run_id, will_retry=record.will_retry,
    )
    return Handled(record, classification, remedy, tuple(applied))
