"""Predicted durations in the simulator: the executor's predictor, learning online (no oracle).

The engine hands each pass's waiting jobs through :meth:`OnlineDurations.offer` — every job
whose request has no ``expected_duration_s`` gets the prediction of
:func:`gpusched.durations.with_prediction` from the runs that have **finished so far** in the
replay (plus an optional warm-up history that ended before the replay starts), exactly as the
executor rewrites its pending requests from the ledger's finished allocations. A job's task name
is its trace job type (Gavel) when it has one; Philly's flattened trace has none, so its jobs
are predicted from their tenant (virtual cluster) and GPU count.

The prediction a job started with is paired with its true run time for the error report.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any, Protocol

from gpusched.durations import (
    DurationModel,
    DurationPredictor,
    FinishedRun,
    Prediction,
    prediction_errors,
    with_prediction,
)
from gpusched.placement import PendingTask
from gpusched.request import GPURequest

__all__ = ["OnlineDurations"]


class TraceJob(Protocol):
    """What is learnt of a finished replay job (a :class:`~gpusched.sim.engine.SimJob`)."""

    @property
    def request(self) -> GPURequest: ...

    @property
    def job_type(self) -> str | None: ...


class OnlineDurations:
    """The engine's predictor state: the current predictor, a per-job cache and the error pairs.

    Mutable bookkeeping of one replay around the pure predictor; a cached rewrite is reused until
    the predictor learns something new.
    """

    def __init__(self, model: DurationModel, history: Iterable[FinishedRun] = ()) -> None:
        self.predictor = DurationPredictor.learn(history, model)
        self.warm_runs = self.predictor.learned
        self._version = 0
        self._cache: dict[str, tuple[int, PendingTask, Prediction | None]] = {}
        self._pairs: list[tuple[Prediction, float]] = []
        self._unpredicted = 0
        self._given = 0

    def offer(self, tasks: Sequence[PendingTask]) -> list[PendingTask]:
        """``tasks`` with predicted expected durations where their requests have none."""
        out = []
        for task in tasks:
            cached = self._cache.get(task.key)
            if cached is None or cached[0] != self._version:
                request, prediction = with_prediction(task.request, task.job_type or "", self.predictor)
                rewritten = task if prediction is None else replace(task, request=request)
                cached = (self._version, rewritten, prediction)
                self._cache[task.key] = cached
            out.append(cached[1])
        return out

    def started(self, key: str, request: GPURequest, run_s: float) -> None:
        """Job ``key`` started for the first time with ``request`` (as offered) and will run
        ``run_s`` in all: pair its prediction with that."""
        cached = self._cache.pop(key, None)
        prediction = cached[2] if cached is not None else None
        if prediction is not None:
            self._pairs.append((prediction, run_s))
        elif request.expected_duration_s > 0:
            self._given += 1
        else:
            self._unpredicted += 1

    def finished(self, job: TraceJob, run_s: float) -> None:
        """Learn that ``job`` (a :class:`~gpusched.sim.engine.SimJob`) finished after ``run_s`` of work."""
        self.predictor = self.predictor.with_runs((FinishedRun.of(job.request, job.job_type or "", run_s),))
        self._version += 1

    def report(self) -> dict[str, Any]:
        """JSON-safe: jobs started with a prediction / an author's estimate / none, and the errors."""
        return {
            "model": {"min_runs": self.predictor.model.min_runs, "recent": self.predictor.model.recent},
            "warm_up_runs": self.warm_runs,
            "learned_runs": self.predictor.learned,
            "jobs_predicted": len(self._pairs),
            "jobs_with_given_estimate": self._given,
            "jobs_without_estimate": self._unpredicted,
            "errors": prediction_errors(self._pairs).as_dict(),
        }
