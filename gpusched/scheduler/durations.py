"""Predicted durations in the GPU executors: the predictor, fed from the ledger's finished allocations.

A task whose author gave no ``expected_duration`` is placed with the run time
:mod:`gpusched.durations` predicts from the finished runs of similar tasks (same DAG task, then
tenant and GPU count, tenant, fleet). :class:`DurationHistory` keeps the predictor between cycles:
it reads ``[gpusched] duration_history_days`` of finished allocations once, then every
``[gpusched] duration_refresh_seconds`` only those released since the last read — never the
whole history each heartbeat. With ``preemption = service`` only, the same runs also feed
:attr:`DurationHistory.service`, their run-time distributions per group, from which that mode
computes each task's Gittins index (:mod:`gpusched.durations.service`); in every other mode it
stays empty and costs nothing. :func:`predict_pending` and
:func:`predict_running` rewrite the cycle's requests (pending work and the tasks holding
devices) before ``decide``. The ledger keeps the author's request; the executor says in the queue
reason and the try's log when an estimate was predicted.

A finished run is an allocation released because its task succeeded, as recorded with the
release (status ``succeeded``: the listener's success hook, the executor seeing the try end in
success, the simulator's end of a job): a failed or stopped try says little about how long the
task takes. Its run time is the task's whole work: the succeeded try's
own time plus, for each earlier try of the same task instance that reported a checkpoint, the time
from its start to its last checkpoint (the work the next try resumed from,
:func:`carried_work`). Without that a task preempted late would be learnt as short as its last
try, and every prediction after a preemption biased short; the simulator learns whole run times
too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from gpusched import settings
from gpusched.durations import (
    DurationModel,
    DurationPredictor,
    FinishedRun,
    Prediction,
    ServiceHistory,
    with_prediction,
)
from gpusched.placement import RunningTask
from gpusched.records import AllocationStatus
from gpusched.request import GPURequest
from gpusched.scheduler.attained import identity, instance_allocations
from gpusched.scheduler.cycle import PendingWork
from gpusched.scheduler.keys import parse_ti_key

__all__ = [
    "DurationHistory", "carried_work", "finished_runs", "less_saved", "predict_pending", "predict_running",
    "request_left", "saved_before", "task_name",
]

# A release committed a little after it was stamped must not be missed by the next read.
_OVERLAP_S = 120.0


def task_name(key: str) -> str:
    """``dag_id/task_id`` of a ledger key (the task of :func:`~gpusched.scheduler.keys.ti_key`), or ""."""
    parts = parse_ti_key(key)
    return f"{parts.dag_id}/{parts.task_id}" if parts else ""


def succeeded(allocation: Any) -> bool:
    """True for an allocation released because its task succeeded: its recorded outcome (status
    ``succeeded``; the ledger's migration 0012 gave older rows theirs), not its reason's wording."""
    return allocation.released_at is not None and allocation.status == AllocationStatus.SUCCEEDED


def finished_runs(
    allocations: Iterable[Any], carried: Mapping[str, float] | None = None
) -> list[FinishedRun]:
    """The succeeded runs among ledger ``allocations``, oldest release first; ``carried``: key →
    seconds of work its earlier tries saved (:func:`carried_work`), added to its own run time."""
    done = [a for a in allocations if succeeded(a)]
    done.sort(key=lambda a: a.released_at)
    extra = carried or {}
    return [FinishedRun.of(a.request, task_name(a.key),
                           max(0.0, a.released_at - a.created_at) + extra.get(a.key, 0.0)) for a in done]


def carried_work(ledger: Any, allocations: Iterable[Any]) -> dict[str, float]:
    """Key of each succeeded later try among ``allocations`` → seconds of work the earlier tries of
    its task instance saved (:func:`saved_before`). Reads the ledger only when there is such a try
    (after a preemption, a move or a retry)."""
    later = [a.key for a in allocations if succeeded(a)]
    return saved_before(ledger, later)


def saved_before(ledger: Any, keys: Iterable[str]) -> dict[str, float]:
    """Key of each later try among ``keys`` → seconds of work the earlier tries of its task
    instance saved: for each that reported a checkpoint while it held devices, from its start to
    its last checkpoint (keys without such work are left out). One ledger read, none when no key
    is a later try."""
    later = {key: parts for key in keys if (parts := parse_ti_key(key)) is not None and parts.try_number > 1}
    if not later:
        return {}
    by_instance = instance_allocations(ledger, later.values())
    earlier = {key: [a for a in by_instance.get(identity(parts), ())
                     if (o := parse_ti_key(a.key)) is not None and o.try_number < parts.try_number]
               for key, parts in later.items()}
    checkpoints = ledger.checkpoint_times({a.key for tries in earlier.values() for a in tries})
    out: dict[str, float] = {}
    for key, tries in earlier.items():
        saved = 0.0
        for alloc in tries:
            at = checkpoints.get(alloc.key)
            end = alloc.released_at if alloc.released_at is not None else at
            if at is not None and end is not None and float(alloc.created_at) < at <= float(end) + _OVERLAP_S:
                saved += min(at, float(end)) - float(alloc.created_at)
        if saved > 0:
            out[key] = saved
    return out


def less_saved(
    pending: Sequence[PendingWork], running: Sequence[RunningTask], saved: Mapping[str, float]
) -> tuple[tuple[PendingWork, ...], tuple[RunningTask, ...]]:
    """The cycle's work as what is left of it: the expected duration (given or predicted) of each
    task whose earlier runs saved ``saved[key]`` seconds of work is that much shorter (at least
    1 s), so placement expects its end and the budget gate charges only the rest."""
    if not saved:
        return tuple(pending), tuple(running)
    work = []
    for item in pending:
        left = request_left(item.request, saved.get(item.key, 0.0))
        work.append(item if left is item.request else replace(item, request=left))
    busy = []
    for task in running:
        left = request_left(task.request, saved.get(task.key, 0.0))
        busy.append(task if left is task.request else
                    replace(task, request=left, expected_end=task.started_at + left.expected_duration_s))
    return tuple(work), tuple(busy)


def request_left(request: GPURequest, saved_s: float) -> GPURequest:
    """``request`` with its expected duration less ``saved_s`` seconds of work done (at least 1 s);
    unchanged without an expected duration or saved work."""
    if saved_s <= 0 or request.expected_duration_s <= 0:
        return request
    return replace(request, expected_duration_s=max(1, math.ceil(request.expected_duration_s - saved_s)))


class DurationHistory:
    """The executor's predictor, refreshed from the ledger at most every ``refresh_s`` seconds.

    ``days`` ≤ 0 turns prediction off (:meth:`predictor` returns None). ``service_history``:
    also keep :attr:`service` (only ``preemption = service`` reads it).
    """

    def __init__(self, days: float, refresh_s: float, model: DurationModel | None = None, *,
                 service_history: bool = False) -> None:
        self.days = days
        self.service_history = service_history
        self.refresh_s = refresh_s
        self.model = model or DurationModel()
        self._predictor: DurationPredictor | None = None
        self.service = ServiceHistory()  # the same runs as distributions (preemption = service)
        self._read_at = 0.0
        self._seen: dict[tuple[str, float], float] = {}  # (key, created_at) -> released_at
        self._saved: dict[str, float] = {}  # try key -> seconds of work its earlier tries saved

    @classmethod
    def from_settings(cls, conf: Any) -> DurationHistory:
        """``[gpusched] duration_history_days`` and ``duration_refresh_seconds`` of ``conf`` (the
        executor's team-scoped config); the service history only when ``preemption = service``."""

        days = settings.get_float("duration_history_days", conf)
        mode = settings.get_str("preemption", conf).strip().lower()
        refresh_s = settings.get_float("duration_refresh_seconds", conf)
        return cls(days, refresh_s, service_history=mode == "service")

    def apply(
        self, ledger: Any, now: float, pending: Sequence[PendingWork], running: Sequence[RunningTask]
    ) -> tuple[tuple[PendingWork, ...], tuple[RunningTask, ...], dict[str, Prediction]]:
        """A cycle's pending work and running tasks with predicted durations less the work their
        earlier tries saved, and the predictions of the pending work by key (see
        :func:`predict_pending`, :func:`predict_running`, :func:`less_saved`)."""
        predictor = self.predictor(ledger, now)
        work, made = predict_pending(pending, predictor)
        keys = [w.key for w in pending] + [r.key for r in running]
        missing = [k for k in keys if k not in self._saved]
        if missing:  # earlier tries have ended: what they saved is read once per try
            found = saved_before(ledger, missing)
            self._saved.update({k: found.get(k, 0.0) for k in missing})
        self._saved = {k: self._saved[k] for k in keys}
        saved = {k: v for k, v in self._saved.items() if v > 0}
        work, busy = less_saved(work, predict_running(running, predictor), saved)
        return work, busy, made

    def predictor(self, ledger: Any, now: float) -> DurationPredictor | None:
        """The predictor at ``now`` (reads the ledger only when due)."""
        if self.days <= 0:
            return None
        if self._predictor is not None and now - self._read_at < self.refresh_s:
            return self._predictor
        first = self._predictor is None
        since = now - self.days * 86400.0 if first else self._read_at - _OVERLAP_S
        fresh = []
        for alloc in ledger.history(since, now):
            mark = (alloc.key, float(alloc.created_at))
            if alloc.released_at is None or alloc.released_at > now or mark in self._seen:
                continue
            self._seen[mark] = float(alloc.released_at)
            fresh.append(alloc)
        # Forget what the next read cannot return again.
        self._seen = {m: at for m, at in self._seen.items() if at > since}
        base = self._predictor or DurationPredictor(self.model)
        runs = finished_runs(fresh, carried_work(ledger, fresh))
        self._predictor = base.with_runs(runs)
        if self.service_history:
            self.service = self.service.with_runs(runs)
        self._read_at = now
        return self._predictor


def predict_pending(
    pending: Sequence[PendingWork], predictor: DurationPredictor | None,
    name_of: Callable[[str], str] = task_name,
) -> tuple[tuple[PendingWork, ...], dict[str, Prediction]]:
    """``pending`` with predicted durations where the request has none, and the predictions by key
    (``name_of``: a work's task name from its key, the first group it is predicted from)."""
    out, made = [], {}
    for work in pending:
        request, prediction = with_prediction(work.request, name_of(work.key), predictor)
        if prediction is None:
            out.append(work)
        else:
            out.append(replace(work, request=request))
            made[work.key] = prediction
    return tuple(out), made


def predict_running(
    running: Sequence[RunningTask], predictor: DurationPredictor | None,
    name_of: Callable[[str], str] = task_name,
) -> tuple[RunningTask, ...]:
    """The running tasks with an ``expected_end`` from the predicted duration where they had none
    (predicted again every cycle, from what the predictor knows now)."""
    out = []
    for task in running:
        request, prediction = with_prediction(task.request, name_of(task.key), predictor)
        if prediction is None:
            out.append(task)
        else:
            out.append(replace(task, request=request,
                               expected_end=task.started_at + request.expected_duration_s))
    return tuple(out)
