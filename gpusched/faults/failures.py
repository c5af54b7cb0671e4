"""The fault chain's records in the ledger: failed tasks, their handling, and request overrides.

Failures are stored as ledger events (``Ledger.record_event`` / ``Ledger.events``); overrides
and refused retries are rows of the ledger's overrides table (``gpusched.ledger.overrides``), read
in one query however old, and each write also appends its event. Every record shows in the event
log of the UI:

``task_failed`` (subject: task key)
    A GPU task failed: :class:`FailureRecord` (task identity, devices, request, log tail).
    Written by the task-side fault listener (or by anyone who sees a failure).
``failure_handled`` (subject: task key)
    The chain classified the failure and applied its remedy (classification, evidence, remedy).
``request_override`` (subject: ``<dag_id>/<task_id>``)
    The next tries of that task must use this :class:`~gpusched.request.GPURequest` instead of the
    one in its ``executor_config`` (Airflow's REST API cannot change ``executor_config``). With a
    ``run_id`` it applies to that DAG run only; without, to every run until cleared.
``override_cleared`` (subject: ``<dag_id>/<task_id>``)
    Cancels earlier overrides of that task.
``retry_refused`` (subject: ``<dag_id>/<task_id>``)
    The chain judged a retry pointless (code error, a leak, no larger device) while Airflow still
    has retries left: the executor may fail try ``try_number`` of that run at once instead of
    spending GPU time on it. Only that one try: a later manual clear runs normally.
``request_pinned`` / ``pin_cleared`` (subject: ``<dag_id>/<task_id>``)
    Not the fault chain's: the executor's ``migrate`` mode pins the next try of a task it moves
    to the target model (:meth:`OverrideTable.pinned`, exactly that try), and removes the pin
    when the move is given up.

The GPU executor calls :func:`load_overrides` once per scheduling cycle, then
:meth:`OverrideTable.pinned`, :meth:`OverrideTable.lookup` and :meth:`OverrideTable.refusal` per workload (see
docs/fault-recovery.md).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from gpusched.errors import GPURequestError, LedgerError
from gpusched.ledger.overrides import OVERRIDE, OVERRIDE_CLEARED, REFUSED, RequestOverride
from gpusched.request import GPURequest

__all__ = [
    "FAILED",
    "HANDLED",
    "OVERRIDE",
    "OVERRIDE_CLEARED",
    "REFUSED",
    "EventLedger",
    "FailureRecord",
    "OverrideTable",
    "clear_override",
    "load_overrides",
    "mark_handled",
    "pending_failures",
    "record_failure",
    "refuse_retry",
    "set_override",
]

FAILED = "task_failed"
HANDLED = "failure_handled"
_SCAN_LIMIT = 5000  # newest failure events one read of pending failures looks at


class EventLedger(Protocol):
    """The part of :class:`gpusched.ledger.Ledger` the chain's records use."""

    def record_event(self, kind: str, subject: str, *, now: float | None = None, **detail: Any) -> None: ...

    def events(
        self, limit: int = 100, *, kinds: Sequence[str] = (), since: float | None = None
    ) -> list[Any]: ...

    def set_request_override(
        self, dag_id: str, task_id: str, request: GPURequest, *, reason: str,
        run_id: str | None = None, now: float | None = None,
    ) -> None: ...

    def refuse_try(
        self, dag_id: str, task_id: str, run_id: str, try_number: int, *, reason: str,
        now: float | None = None,
    ) -> None: ...

    def clear_request_overrides(self, dag_id: str, task_id: str, *, now: float | None = None) -> None: ...

    def request_overrides(
        self, tasks: Collection[tuple[str, str]] | None = None
    ) -> list[RequestOverride]: ...


@dataclass(frozen=True, slots=True)
class FailureRecord:
    """One failed try of one GPU task, as the fault listener saw it.

    Attributes:
        key: the task key (``airflow/<dag>/<task>/<map>/<try>/<run>`` for Airflow tasks).
        dag_id / task_id / run_id / try_number / map_index: the task instance ("" / 0 / -1 if
            the failure is not an Airflow task's).
        devices: uuids of the devices the try held.
        request: the request it ran with (None if unknown).
        log_tail: the last lines of its log and the formatted exception.
        will_retry: whether Airflow itself will run another try (retries left).
        host / pid: where the try ran.
        at: when the failure was seen (epoch seconds).
    """

    key: str
    devices: tuple[str, ...]
    log_tail: str
    at: float
    dag_id: str = ""
    task_id: str = ""
    run_id: str = ""
    try_number: int = 0
    map_index: int = -1
    request: GPURequest | None = None
    will_retry: bool = False
    host: str = ""
    pid: int = 0
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_detail(self) -> dict[str, Any]:
        """JSON-safe event detail."""
        data = asdict(self)
        data["devices"] = list(self.devices)
        data["request"] = self.request.to_dict() if self.request else None
        data["extra"] = dict(self.extra)
        return data

    @classmethod
    def from_detail(cls, detail: Mapping[str, Any]) -> FailureRecord:
        """The record an event's detail holds (LedgerError if it is not one)."""
        try:
            request = GPURequest.from_dict(detail["request"]) if detail.get("request") else None
            return cls(
                key=str(detail["key"]),
                devices=tuple(str(d) for d in detail.get("devices") or ()),
                log_tail=str(detail.get("log_tail") or ""),
                at=float(detail["at"]),
                dag_id=str(detail.get("dag_id") or ""),
                task_id=str(detail.get("task_id") or ""),
                run_id=str(detail.get("run_id") or ""),
                try_number=int(detail.get("try_number") or 0),
                map_index=int(detail.get("map_index", -1)),
                request=request,
                will_retry=bool(detail.get("will_retry")),
                host=str(detail.get("host") or ""),
                pid=int(detail.get("pid") or 0),
                extra=dict(detail.get("extra") or {}),
            )
        except (KeyError, TypeError, ValueError, GPURequestError) as exc:
            raise LedgerError(
                f"a {FAILED} event is malformed ({exc}); it was not written by gpusched.faults.failures"
            ) from exc


def record_failure(ledger: EventLedger, record: FailureRecord) -> None:
    """Store ``record`` as a ``task_failed`` event."""
    ledger.record_event(FAILED, record.key, now=record.at, **record.to_detail())


def pending_failures(ledger: EventLedger, *, since: float | None = None) -> list[FailureRecord]:
    """Recorded failures not yet handled, oldest first (malformed events are skipped)."""
    events = ledger.events(_SCAN_LIMIT, kinds=(FAILED, HANDLED), since=since)
    handled = {e.subject for e in events if e.kind == HANDLED}
    seen: set[str] = set()
    result: list[FailureRecord] = []
    for event in reversed(events):  # events come newest first
        if event.kind != FAILED or event.subject in handled or event.subject in seen:
            continue
        try:
            result.append(FailureRecord.from_detail(event.detail))
        except LedgerError:
            continue
        seen.add(event.subject)
    return result


def mark_handled(ledger: EventLedger, key: str, *, now: float | None = None, **detail: Any) -> None:
    """Record that the failure of ``key`` was classified and its remedy applied."""
    ledger.record_event(HANDLED, key, now=now, **detail)


def set_override(
    ledger: EventLedger,
    dag_id: str,
    task_id: str,
    request: GPURequest,
    *,
    reason: str,
    run_id: str | None = None,
    now: float | None = None,
) -> None:
    """From now on, tries of ``dag_id.task_id`` (of ``run_id`` only, if given) use ``request``."""
    ledger.set_request_override(dag_id, task_id, request, reason=reason, run_id=run_id, now=now)


def clear_override(ledger: EventLedger, dag_id: str, task_id: str, *, now: float | None = None) -> None:
    """Cancel every override of ``dag_id.task_id``; its own executor_config applies again."""
    ledger.clear_request_overrides(dag_id, task_id, now=now)


def refuse_retry(
    ledger: EventLedger, dag_id: str, task_id: str, run_id: str, try_number: int, *, reason: str,
    now: float | None = None,
) -> None:
    """Ask the executor to fail try ``try_number`` of ``dag_id.task_id`` in ``run_id`` at once."""
    ledger.refuse_try(dag_id, task_id, run_id, try_number, reason=reason, now=now)


@dataclass(frozen=True, slots=True)
class OverrideTable:
    """The overrides (and refused retries) in force at one instant (build with :func:`load_overrides`)."""

    # (dag_id, task_id) -> [(run_id or None, request, reason)], newest first
    entries: Mapping[tuple[str, str], tuple[tuple[str | None, GPURequest, str], ...]]
    # (dag_id, task_id, run_id, try_number) -> reason
    refused: Mapping[tuple[str, str, str, int], str] = field(default_factory=dict)
    # (dag_id, task_id, run_id, try_number) -> (request, reason, created_at): one try's pinned request
    pins: Mapping[tuple[str, str, str, int], tuple[GPURequest, str, float]] = field(default_factory=dict)

    def pinned(self, dag_id: str, task_id: str, run_id: str, try_number: int) -> GPURequest | None:
        """The request pinned for exactly this try (it wins over every override), or None."""
        pin = self.pins.get((dag_id, task_id, run_id, int(try_number)))
        return None if pin is None else pin[0]

    def refusal(self, dag_id: str, task_id: str, run_id: str, try_number: int) -> str | None:
        """Why this try should fail without running (the chain refused the retry), or None."""
        return self.refused.get((dag_id, task_id, run_id, int(try_number)))

    def lookup(self, dag_id: str, task_id: str, run_id: str) -> GPURequest | None:
        """The request that overrides this task's ``executor_config`` in ``run_id``, or None.

        The newest override that applies wins (a run-specific one or a task-wide one).
        """
        for scope, request, _reason in self.entries.get((dag_id, task_id), ()):
            if scope is None or scope == run_id:
                return request
        return None

    def reason(self, dag_id: str, task_id: str, run_id: str) -> str | None:
        """Why the override returned by :meth:`lookup` exists."""
        for scope, _request, why in self.entries.get((dag_id, task_id), ()):
            if scope is None or scope == run_id:
                return why
        return None


def load_overrides(
    ledger: EventLedger, tasks: Collection[tuple[str, str]] | None = None
) -> OverrideTable:
    """Read the overrides in force (of ``tasks``' (dag_id, task_id) only, if given): one query.

    Call once per scheduling cycle; an override applies however long ago it was written.
    """
    entries: dict[tuple[str, str], list[tuple[str | None, GPURequest, str]]] = {}
    refused: dict[tuple[str, str, str, int], str] = {}
    pins: dict[tuple[str, str, str, int], tuple[GPURequest, str, float]] = {}
    for row in ledger.request_overrides(tasks):  # newest first
        task = (row.dag_id, row.task_id)
        if row.pinned and row.request is not None:
            pins.setdefault((*task, str(row.run_id), row.try_number),
                            (row.request, row.reason, row.created_at))
        elif row.request is None:
            refused.setdefault((*task, str(row.run_id), row.try_number), row.reason)
        else:
            entries.setdefault(task, []).append((row.run_id, row.request, row.reason))
    return OverrideTable({k: tuple(v) for k, v in entries.items()}, refused, pins)
