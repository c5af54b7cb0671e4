"""The replay's run-time history for mode ``service``, learnt online (``SimPreemption('service')``).

The rules — queue ranks and the victims' indices from each job's Gittins index at the service it
attained — are the scheduler's (:mod:`gpusched.scheduler.service`), as in the executors; this is
only where the history comes from: the run-time distribution of each prediction group, learnt
from the jobs finished so far in the replay (plus the same warm-up history the duration
predictor gets) — no oracle. A job's prediction group is named by its trace job type.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from gpusched.durations import FinishedRun, ServiceHistory, ServiceModel, group_keys
from gpusched.durations.predictor import GroupKey
from gpusched.durations.service import IndexCache
from gpusched.placement import Policy
from gpusched.placement.policy import QueueOrder
from gpusched.request import GPURequest
from gpusched.sim.durations import TraceJob

__all__ = ["OnlineService"]


class OnlineService:
    """The replay's service history (mutable bookkeeping around the pure
    :class:`~gpusched.durations.ServiceHistory`) and a per-job cache of index values; a
    :class:`~gpusched.scheduler.service.ServiceIndex`. ``names``: job key → its trace job type."""

    def __init__(self, history: Iterable[FinishedRun] = (), model: ServiceModel | None = None,
                 names: Mapping[str, str | None] | None = None) -> None:
        self.history = ServiceHistory.learn(history, model)
        self.warm_runs = self.history.learned
        self.names = names or {}
        self._cache = IndexCache()  # values while a job's groups and attained service stand still
        self._chains: dict[str, tuple[GroupKey, ...]] = {}  # job key -> its prediction groups

    @staticmethod
    def policy(policy: Policy) -> Policy:
        """``policy`` ordering its queue by the jobs' ranks."""
        ranked = QueueOrder.RANKED
        return policy if policy.queue_order is ranked else replace(policy, queue_order=ranked)

    def finished(self, job: TraceJob, run_s: float) -> None:
        """Learn that ``job`` finished after ``run_s`` of work."""
        self.history = self.history.with_runs((FinishedRun.of(job.request, job.job_type or "", run_s),))

    def index_values(self, work: Sequence[tuple[str, GPURequest, float]]) -> list[float]:
        """The index value of each ``(job key, request, attained GPU-s)``."""
        history, cache = self.history, self._cache
        out: list[float] = []
        items, chains, keys, at = [], [], [], []
        for key, request, attained in work:
            value = cache.known(history, key, attained)
            if value is None:
                task = self.names.get(key) or ""
                items.append((request, task, attained))
                chains.append(self._chain(key, request, task))
                keys.append(key)
                at.append(len(out))
            out.append(math.nan if value is None else value)
        if items:
            for n, value in zip(at, history.index_values(items, chains, (cache, keys)), strict=True):
                out[n] = value
        return out

    def _chain(self, key: str, request: GPURequest, task: str) -> tuple[GroupKey, ...]:
        """The prediction groups of job ``key`` (a job's tenant, GPUs and model never change)."""
        chain = self._chains.get(key)
        if chain is None:
            chain = self._chains[key] = group_keys(FinishedRun.of(request, task, 0.0))
        return chain

    def report(self) -> dict[str, Any]:
        """JSON-safe: the model's constants and the history learnt."""
        return {**self.history.report(), "warm_up_runs": self.warm_runs}
