"""The fault chain's request overrides and refused retries, and the executor's pinned tries:
standing instructions to the executor.

One row per scope in ``gpusched_request_overrides`` (the latest write for a scope wins), read by
the executor once per cycle in one query, however old the row. Each write also appends the audit
event the event log and the UI show (``request_override``, ``override_cleared``,
``retry_refused``, ``request_pinned``, ``pin_cleared``), in the same transaction. A *pin* replaces
the request of exactly one try (the ``migrate`` preemption mode pins a moved task's next try to
its target model). The meaning of the rows is the fault chain's (see
:mod:`gpusched.faults.failures`); this module only stores them.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass

import sqlalchemy as sa

from gpusched.errors import GPURequestError
from gpusched.ledger.engine import read_tx, write_tx
from gpusched.ledger.events import write_event
from gpusched.ledger.schema import REQUEST_OVERRIDES
from gpusched.request import GPURequest

__all__ = [
    "OVERRIDE",
    "OVERRIDE_CLEARED",
    "PINNED",
    "PIN_CLEARED",
    "REFUSED",
    "LedgerOverrides",
    "RequestOverride",
]

OVERRIDE = "request_override"
"""Event kind (and row kind ``override``) of a replaced request."""
OVERRIDE_CLEARED = "override_cleared"
"""Event kind of a cleared override (its rows are deleted)."""
REFUSED = "retry_refused"
"""Event kind (and row kind ``refusal``) of a refused try."""

PINNED = "request_pinned"
"""Event kind (and row kind ``pin``) of one try's pinned request."""
PIN_CLEARED = "pin_cleared"
"""Event kind of a pin removed before its try used it."""

_KIND_OVERRIDE = "override"
_KIND_PIN = "pin"
_KIND_REFUSAL = "refusal"
_T = REQUEST_OVERRIDES


@dataclass(frozen=True, slots=True)
class RequestOverride:
    """One stored instruction.

    ``request`` is set for an override (``run_id`` None: every run), ``try_number`` for a refusal
    (``request`` None); a pin (``pinned``) has both: the request of that one try. ``reason`` says why.
    """

    dag_id: str
    task_id: str
    run_id: str | None
    try_number: int
    request: GPURequest | None
    reason: str
    created_at: float
    pinned: bool = False

    @property
    def is_refusal(self) -> bool:
        """Whether this refuses one try rather than replacing the request."""
        return self.request is None


def _subject(dag_id: str, task_id: str) -> str:
    return f"{dag_id}/{task_id}"


class LedgerOverrides:
    """Override methods of :class:`gpusched.ledger.Ledger` (needs ``self.engine``)."""

    engine: sa.Engine

    def set_request_override(
        self, dag_id: str, task_id: str, request: GPURequest, *, reason: str,
        run_id: str | None = None, now: float | None = None,
    ) -> None:
        """Tries of ``dag_id.task_id`` (in ``run_id`` only, if given) use ``request`` from now on."""
        at = time.time() if now is None else now
        self._put(_KIND_OVERRIDE, dag_id, task_id, run_id or "", 0, request.to_dict(), reason, at)

    def refuse_try(
        self, dag_id: str, task_id: str, run_id: str, try_number: int, *, reason: str,
        now: float | None = None,
    ) -> None:
        """Try ``try_number`` of ``dag_id.task_id`` in ``run_id`` should fail without running."""
        at = time.time() if now is None else now
        self._put(_KIND_REFUSAL, dag_id, task_id, run_id, int(try_number), None, reason, at)

    def pin_try(
        self, dag_id: str, task_id: str, run_id: str, try_number: int, request: GPURequest, *,
        reason: str, now: float | None = None,
    ) -> None:
        """Try ``try_number`` of ``dag_id.task_id`` in ``run_id`` (only that one) uses ``request``."""
        at = time.time() if now is None else now
        self._put(_KIND_PIN, dag_id, task_id, run_id, int(try_number), request.to_dict(), reason, at)

    def unpin_try(
        self, dag_id: str, task_id: str, run_id: str, try_number: int, *, reason: str,
        now: float | None = None,
    ) -> bool:
        """Remove the pin of that try (if any); returns whether there was one."""
        at = time.time() if now is None else now
        with write_tx(self.engine) as conn:
            gone = conn.execute(sa.delete(_T).where(
                _T.c.dag_id == dag_id, _T.c.task_id == task_id, _T.c.run_id == run_id,
                _T.c.try_number == int(try_number), _T.c.kind == _KIND_PIN,
            )).rowcount
            if gone:
                write_event(conn, at, PIN_CLEARED, _subject(dag_id, task_id), dag_id=dag_id, task_id=task_id,
                            run_id=run_id, try_number=int(try_number), reason=reason)
        return bool(gone)

    def clear_request_overrides(self, dag_id: str, task_id: str, *, now: float | None = None) -> None:
        """Delete every override of ``dag_id.task_id`` (refused tries stay refused)."""
        at = time.time() if now is None else now
        with write_tx(self.engine) as conn:
            conn.execute(sa.delete(_T).where(
                _T.c.dag_id == dag_id, _T.c.task_id == task_id, _T.c.kind == _KIND_OVERRIDE
            ))
            write_event(conn, at, OVERRIDE_CLEARED, _subject(dag_id, task_id), dag_id=dag_id, task_id=task_id)

    def request_overrides(self, tasks: Collection[tuple[str, str]] | None = None) -> list[RequestOverride]:
        """Stored overrides and refusals (of ``tasks``' (dag_id, task_id) only, if given), newest first."""
        query = sa.select(_T)
        if tasks is not None:
            if not tasks:
                return []
            query = query.where(sa.tuple_(_T.c.dag_id, _T.c.task_id).in_(list(tasks)))
        with read_tx(self.engine) as conn:
            rows = conn.execute(query.order_by(_T.c.id.desc())).all()
        result: list[RequestOverride] = []
        for r in rows:
            request = None
            if r.kind in (_KIND_OVERRIDE, _KIND_PIN):
                try:
                    request = GPURequest.from_dict(r.request)
                except (GPURequestError, KeyError, TypeError):  # stored by an older, incompatible version
                    continue
            run_id = (r.run_id or None) if r.kind == _KIND_OVERRIDE else r.run_id
            result.append(RequestOverride(r.dag_id, r.task_id, run_id, r.try_number, request, r.reason,
                                          r.created_at, pinned=r.kind == _KIND_PIN))
        return result

    def _put(
        self, kind: str, dag_id: str, task_id: str, run_id: str, try_number: int,
        request: dict[str, object] | None, reason: str, at: float,
    ) -> None:
        scope = (_T.c.dag_id == dag_id, _T.c.task_id == task_id, _T.c.run_id == run_id,
                 _T.c.try_number == try_number, _T.c.kind == kind)
        with write_tx(self.engine) as conn:
            # delete + insert (not update): the newest write gets the highest id, and reads order by id
            conn.execute(sa.delete(_T).where(*scope))
            conn.execute(sa.insert(_T).values(
                dag_id=dag_id, task_id=task_id, run_id=run_id, try_number=try_number, kind=kind,
                request=request, reason=reason, created_at=at,
            ))
            subject = _subject(dag_id, task_id)
            if kind == _KIND_OVERRIDE:
                write_event(conn, at, OVERRIDE, subject, dag_id=dag_id, task_id=task_id,
                            run_id=run_id or None, request=request, reason=reason)
            elif kind == _KIND_PIN:
                write_event(conn, at, PINNED, subject, dag_id=dag_id, task_id=task_id, run_id=run_id,
                            try_number=try_number, request=request, reason=reason)
            else:
                write_event(conn, at, REFUSED, subject, dag_id=dag_id, task_id=task_id,
                            run_id=run_id, try_number=try_number, reason=reason)
