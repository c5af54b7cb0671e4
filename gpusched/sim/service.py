"""Preemption and queue order by expected remaining service in the simulator (``SimPreemption('service')``).

The executor's rule (:mod:`gpusched.durations.service`): each job's Gittins index given the
GPU-time it has attained, from the run-time distribution of its prediction group, learnt online
from the jobs finished so far in the replay (plus the same warm-up history the duration predictor
gets) — no oracle. :meth:`OnlineService.rank` gives each pass's offered jobs their queue rank
(``QueueOrder.RANKED``; the engine ages it), :meth:`OnlineService.indices` the indices of the
waiting and running jobs for the victim selection (a waiting job's aged by its wait).

Attained service counts all the GPU-time a job has received, as Tiresias does: its earlier runs
in full (:attr:`SimPreemption.served_s`, the work lost since a checkpoint included) and its
current run. Counting only the checkpointed work would rank a victim that lost its last half
hour as fresh again, and it would take the devices straight back (thrashing).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from gpusched.durations import FinishedRun, ServiceHistory, ServiceModel
from gpusched.durations.service import aged_index, gpu_seconds, queue_rank
from gpusched.placement import PendingTask, Policy, RunningTask
from gpusched.placement.policy import QueueOrder
from gpusched.sim.durations import TraceJob

__all__ = ["OnlineService"]


class OnlineService:
    """The replay's service history and a per-job cache of ranked offers (mutable bookkeeping
    around the pure :class:`~gpusched.durations.ServiceHistory`)."""

    def __init__(self, history: Iterable[FinishedRun] = (), model: ServiceModel | None = None) -> None:
        self.history = ServiceHistory.learn(history, model)
        self.warm_runs = self.history.learned
        self._version = 0
        self._ranked: dict[str, tuple[int, float, PendingTask, PendingTask]] = {}

    @staticmethod
    def policy(policy: Policy) -> Policy:
        """``policy`` ordering its queue by the jobs' ranks."""
        ranked = QueueOrder.RANKED
        return policy if policy.queue_order is ranked else replace(policy, queue_order=ranked)

    def finished(self, job: TraceJob, run_s: float) -> None:
        """Learn that ``job`` finished after ``run_s`` of work."""
        self.history = self.history.with_runs((FinishedRun.of(job.request, job.job_type or "", run_s),))
        self._version += 1

    def rank(self, tasks: Sequence[PendingTask], served_s: Mapping[str, float]) -> list[PendingTask]:
        """``tasks`` with ``rank`` = −log2 of their Gittins index at their attained service."""
        out = []
        for task in tasks:
            attained = gpu_seconds(task.request, served_s.get(task.key, 0.0))
            cached = self._ranked.get(task.key)
            if cached is None or cached[0] != self._version or cached[1] != attained or cached[2] is not task:
                value = self.history.index(task.request, task.job_type or "", attained).value
                cached = (self._version, attained, task, replace(task, rank=queue_rank(value)))
                self._ranked[task.key] = cached
            out.append(cached[3])
        return out

    def forget(self, key: str) -> None:
        """``key`` started: drop its cached offer."""
        self._ranked.pop(key, None)

    def indices(
        self, waiting: Sequence[PendingTask], running: Sequence[RunningTask], types: Mapping[str, str | None],
        served_s: Mapping[str, float], now: float, halving_s: float,
    ) -> dict[str, float]:
        """Key → index of ``waiting`` (aged by their wait) and ``running`` jobs at ``now``."""
        items = [(t.request, types.get(t.key) or "", gpu_seconds(t.request, served_s.get(t.key, 0.0)))
                 for t in waiting]
        items += [(r.request, types.get(r.key) or "",
                   gpu_seconds(r.request, served_s.get(r.key, 0.0) + now - r.started_at)) for r in running]
        values = self.history.index_values(items)
        out = {t.key: aged_index(v, now - t.submitted_at, halving_s)
               for t, v in zip(waiting, values, strict=False)}
        out.update({r.key: v for r, v in zip(running, values[len(waiting):], strict=True)})
        return out

    def report(self) -> dict[str, Any]:
        """JSON-safe: the model's constants and the history learnt."""
        return {**self.history.report(), "warm_up_runs": self.warm_runs}
