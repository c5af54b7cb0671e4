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

from gpusched.durations import FinishedRun, ServiceHistory, ServiceModel, group_keys
from gpusched.durations.predictor import GroupKey
from gpusched.durations.service import IndexCache, aged_index, gpu_seconds, queue_rank
from gpusched.placement import PendingTask, Policy, RunningTask
from gpusched.placement.policy import QueueOrder
from gpusched.request import GPURequest
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
        self._cache = IndexCache()  # waiting jobs' values (their attained service stands still)
        self._chains: dict[str, tuple[GroupKey, ...]] = {}  # job key -> its prediction groups

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
        out: list[PendingTask | None] = []
        missing: list[tuple[int, PendingTask, float]] = []
        for task in tasks:
            attained = gpu_seconds(task.request, served_s.get(task.key, 0.0))
            cached = self._ranked.get(task.key)
            if cached is None or cached[0] != self._version or cached[1] != attained or cached[2] is not task:
                missing.append((len(out), task, attained))
                out.append(None)
            else:
                out.append(cached[3])
        values = self._values([(t, a) for _, t, a in missing])
        for (n, task, attained), value in zip(missing, values, strict=True):
            ranked = replace(task, rank=queue_rank(value))
            self._ranked[task.key] = (self._version, attained, task, ranked)
            out[n] = ranked
        return [t for t in out if t is not None]

    def forget(self, key: str) -> None:
        """``key`` started: drop its cached offer."""
        self._ranked.pop(key, None)

    def indices(
        self, waiting: Sequence[PendingTask], running: Sequence[RunningTask], types: Mapping[str, str | None],
        served_s: Mapping[str, float], now: float, halving_s: float,
    ) -> dict[str, float]:
        """Key → index of ``waiting`` (aged by their wait) and ``running`` jobs at ``now``."""
        values = self._values([(t, gpu_seconds(t.request, served_s.get(t.key, 0.0))) for t in waiting])
        out = {t.key: aged_index(v, now - t.submitted_at, halving_s)
               for t, v in zip(waiting, values, strict=True)}
        items = [(r.request, types.get(r.key) or "",
                  gpu_seconds(r.request, served_s.get(r.key, 0.0) + now - r.started_at)) for r in running]
        ran = self.history.index_values(items, [self._chain(r.key, r.request, i[1])
                                                for r, i in zip(running, items, strict=True)])
        out.update({r.key: v for r, v in zip(running, ran, strict=True)})
        return out

    def _values(self, tasks: Sequence[tuple[PendingTask, float]]) -> list[float]:
        """Index values of waiting ``(task, attained GPU-s)`` (cached while their groups stand)."""
        items = [(t.request, t.job_type or "", a) for t, a in tasks]
        chains = [self._chain(t.key, t.request, t.job_type or "") for t, _ in tasks]
        return self.history.index_values(items, chains, (self._cache, [t.key for t, _ in tasks]))

    def _chain(self, key: str, request: GPURequest, task: str) -> tuple[GroupKey, ...]:
        """The prediction groups of job ``key`` (a job's tenant, GPUs and model never change)."""
        chain = self._chains.get(key)
        if chain is None:
            chain = self._chains[key] = group_keys(FinishedRun.of(request, task, 0.0))
        return chain

    def report(self) -> dict[str, Any]:
        """JSON-safe: the model's constants and the history learnt."""
        return {**self.history.report(), "warm_up_runs": self.warm_runs}
