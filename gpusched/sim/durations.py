"""The replay's duration history: the executors' predictor, learning online (no oracle).

The rewrite is the executors' (:func:`gpusched.scheduler.durations.predict_pending` and
:func:`~gpusched.scheduler.durations.predict_running`): every waiting job whose request has no
``expected_duration_s`` gets the predicted one, and every running job without one gets the
expected end its predicted duration gives, again each pass from what the predictor knows then.
Only where the runs come from is the replay's: the jobs that have **finished so far** (plus an
optional warm-up history that ended before the replay starts), folded into the predictor at most
every ``refresh_s`` (the executors' ``[gpusched] duration_refresh_seconds``: they read the
ledger's finished allocations that often). A job's task name is its trace job type (Gavel) when
it has one; Philly's flattened trace has none, so its jobs are predicted from their tenant
(virtual cluster) and GPU count.

The prediction a job started with is paired with its true run time for the error report.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol

from gpusched import settings
from gpusched.durations import (
    DurationModel,
    DurationPredictor,
    FinishedRun,
    Prediction,
    prediction_errors,
)
from gpusched.placement import RunningTask
from gpusched.request import GPURequest
from gpusched.scheduler.cycle import PendingWork
from gpusched.scheduler.durations import predict_pending, predict_running

__all__ = ["OnlineDurations"]


class TraceJob(Protocol):
    """What is learnt of a finished replay job (a :class:`~gpusched.sim.engine.SimJob`)."""

    @property
    def request(self) -> GPURequest: ...

    @property
    def job_type(self) -> str | None: ...


class OnlineDurations:
    """The engine's predictor state: the current predictor, the runs not yet folded in, per-job
    caches of the rewrites and the error pairs (mutable bookkeeping of one replay around the pure
    predictor; a cached rewrite is reused until the predictor learns something new).
    ``names``: job key → its task name (trace job type)."""

    def __init__(self, model: DurationModel, history: Iterable[FinishedRun] = (),
                 names: Mapping[str, str | None] | None = None, refresh_s: float | None = None) -> None:
        self.predictor = DurationPredictor.learn(history, model)
        self.warm_runs = self.predictor.learned
        self.names = names or {}
        default = float(settings.default("duration_refresh_seconds"))
        self.refresh_s = default if refresh_s is None else refresh_s
        self._fresh: list[FinishedRun] = []
        self._read_at = -float("inf")
        self._version = 0
        self._pending: dict[str, tuple[int, GPURequest, GPURequest, Prediction | None]] = {}
        self._running: dict[str, tuple[int, RunningTask, RunningTask]] = {}
        self._started: dict[str, Prediction] = {}
        self._pairs: list[tuple[Prediction, float]] = []
        self._unpredicted = 0
        self._given = 0

    def name(self, key: str) -> str:
        return self.names.get(key) or ""

    def refresh(self, now: float) -> None:
        """Fold the runs finished since the last read into the predictor, when ``refresh_s`` has
        passed since then (as the executors read their ledger)."""
        if self._fresh and now - self._read_at >= self.refresh_s:
            self.predictor = self.predictor.with_runs(self._fresh)
            self._fresh = []
            self._read_at = now
            self._version += 1

    def pending(self, work: Sequence[PendingWork]) -> tuple[PendingWork, ...]:
        """``work`` with predicted expected durations where their requests have none."""
        out = []
        for item in work:
            cached = self._pending.get(item.key)
            if cached is None or cached[0] != self._version or cached[1] is not item.request:
                (rewritten,), made = predict_pending((item,), self.predictor, self.name)
                cached = (self._version, item.request, rewritten.request, made.get(item.key))
                self._pending[item.key] = cached
            out.append(item if cached[3] is None else replace(item, request=cached[2]))
        return tuple(out)

    def running(self, tasks: Iterable[RunningTask]) -> tuple[RunningTask, ...]:
        """``tasks`` with the expected end of their predicted duration where they have none."""
        out = []
        for task in tasks:
            cached = self._running.get(task.key)
            if cached is None or cached[0] != self._version or cached[1] is not task:
                (rewritten,) = predict_running((task,), self.predictor, self.name)
                cached = (self._version, task, rewritten)
                self._running[task.key] = cached
            out.append(cached[2])
        return tuple(out)

    def started(self, key: str, request: GPURequest, run_s: float) -> None:
        """Job ``key`` started for the first time with ``request`` (as offered) and will run
        ``run_s`` in all: pair its prediction with that."""
        cached = self._pending.pop(key, None)
        prediction = cached[3] if cached is not None else None
        if prediction is not None:
            self._pairs.append((prediction, run_s))
        elif request.expected_duration_s > 0:
            self._given += 1
        else:
            self._unpredicted += 1

    def ended(self, key: str) -> None:
        """Job ``key``'s run ended (finished or stopped): drop its cached rewrite."""
        self._running.pop(key, None)

    def finished(self, job: TraceJob, run_s: float) -> None:
        """Learn that ``job`` (a :class:`~gpusched.sim.engine.SimJob`) finished after ``run_s`` of
        work (folded in at the next :meth:`refresh`)."""
        self._fresh.append(FinishedRun.of(job.request, job.job_type or "", run_s))

    def report(self) -> dict[str, Any]:
        """JSON-safe: jobs started with a prediction / an author's estimate / none, and the errors."""
        return {
            "model": {"min_runs": self.predictor.model.min_runs, "recent": self.predictor.model.recent},
            "refresh_s": self.refresh_s,
            "warm_up_runs": self.warm_runs,
            "learned_runs": self.predictor.learned + len(self._fresh),  # every run it was given
            "jobs_predicted": len(self._pairs),
            "jobs_with_given_estimate": self._given,
            "jobs_without_estimate": self._unpredicted,
            "errors": prediction_errors(self._pairs).as_dict(),
        }
