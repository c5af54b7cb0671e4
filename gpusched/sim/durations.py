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
from typing import Any, Protocol

from gpusched import settings
from gpusched.durations import (
    DurationModel,
    DurationPredictor,
    FinishedRun,
    Prediction,
    group_keys,
    prediction_errors,
)
from gpusched.durations.predictor import GroupKey
from gpusched.placement import RunningTask
from gpusched.request import GPURequest
from gpusched.scheduler.cycle import PendingWork
from gpusched.scheduler.durations import predict_pending, predict_running

__all__ = ["OnlineDurations"]

_Evidence = tuple[tuple[GroupKey, object], ...]


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
        # key -> (predictor version, work asked, work rewritten, prediction, the groups it read)
        self._pending: dict[str, tuple[int, PendingWork, PendingWork, Prediction | None, _Evidence]] = {}
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
            if cached is None or cached[1] is not item or (
                    cached[0] != self._version and not self._holds(cached[4])):
                (rewritten,), made = predict_pending((item,), self.predictor, self.name)
                prediction = made.get(item.key)
                if cached is not None and cached[1] is item and rewritten.request == cached[2].request:
                    rewritten = cached[2]  # the same duration: the same work (later rewrites keep theirs)
                cached = (self._version, item, rewritten, prediction, self._evidence(item, prediction))
                self._pending[item.key] = cached
            elif cached[0] != self._version:  # the predictor learnt nothing of this work's groups
                cached = self._pending[item.key] = (self._version, *cached[1:])
            out.append(cached[2])
        return tuple(out)

    def _evidence(self, item: PendingWork, prediction: Prediction | None) -> _Evidence:
        """The predictor's groups ``item``'s prediction read (most specific first, up to the one
        it came from; all of them when none predicted it): while each is the same object, a
        newer predictor predicts the same."""
        if item.request.expected_duration_s > 0:
            return ()  # the author's estimate: never predicted
        chain = group_keys(FinishedRun.of(item.request, self.name(item.key), 0.0))
        depth = len(chain) if prediction is None else \
            next(n for n, key in enumerate(chain) if key[0] == prediction.basis) + 1
        groups = self.predictor.groups
        return tuple((key, groups.get(key)) for key in chain[:depth])

    def _holds(self, evidence: _Evidence) -> bool:
        groups = self.predictor.groups
        return all(groups.get(key) is group for key, group in evidence)

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
