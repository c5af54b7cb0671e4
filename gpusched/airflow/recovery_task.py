"""The body of the ``gpusched_fault_recovery`` DAG: handle recorded GPU task failures.

For every ``task_failed`` ledger event not yet handled (the task-side listener usually handles
its own failure at once; this sweep catches the rest, e.g. failures recorded by the scheduler
for tasks that never started, or when the inline chain was disabled or crashed):

1. classify it and apply the remedy (:func:`gpusched.faults.remediation.handle_failure`: cordon /
   mark unhealthy, request override for the retry, scale-out request on shortage);
2. when the remedy says retry but Airflow will not retry by itself (no retries left), clear the
   failed task instance through the REST API so the scheduler runs a new try — which the GPU
   executor places with the override, away from cordoned devices.

Also retries the REST clear for failures handled inline whose task Airflow will not retry.
"""

from __future__ import annotations

import logging
from typing import Any

from gpusched.airflow.rest import AirflowApi
from gpusched.faults.failures import HANDLED, pending_failures
from gpusched.faults.remediation import handle_failure
from gpusched.ledger import Ledger

__all__ = ["run_recovery"]

_log = logging.getLogger("gpusched.recovery_task")
RETRY_REQUESTED = "retry_requested"


def run_recovery(ledger: Any = None, api: Any = None, *, max_attempts: int = 3) -> dict[str, Any]:
    """Handle pending failures; returns a JSON-safe summary (handled, retried, errors)."""

    own = ledger is None
    ledger = ledger or Ledger()
    summary: dict[str, Any] = {"handled": [], "retried": [], "errors": []}
    try:
        for record in pending_failures(ledger):
            handled = handle_failure(ledger, record, max_attempts=max_attempts)
            summary["handled"].append({
                "key": record.key, "kind": str(handled.classification.kind),
                "evidence": list(handled.classification.evidence), "remedy": handled.remedy.reason,
                "applied": list(handled.applied),
            })
        # Retries Airflow will not do by itself: handled, retry wanted, not yet requested.
        events = ledger.events(2000, kinds=(HANDLED, RETRY_REQUESTED))
        requested = {e.subject for e in events if e.kind == RETRY_REQUESTED}
        for event in events:
            detail = event.detail
            if (event.kind != HANDLED or event.subject in requested or not detail.get("retry")
                    or detail.get("will_retry") or not detail.get("dag_id")):
                continue
            requested.add(event.subject)
            try:
                if api is None:
                    api = AirflowApi()
                api.clear_task(str(detail["dag_id"]), str(detail["run_id"]), str(detail["task_id"]))
            except Exception as exc:  # report and move on; the next run tries again
                summary["errors"].append(f"{event.subject}: {exc}")
                requested.discard(event.subject)
                continue
            ledger.record_event(RETRY_REQUESTED, event.subject, dag_id=detail["dag_id"],
                                run_id=detail["run_id"], task_id=detail["task_id"])
            summary["retried"].append(event.subject)
    finally:
        if own:
            ledger.close()
    for line in summary["errors"]:
        _log.warning("gpusched recovery: %s", line)
    return summary
