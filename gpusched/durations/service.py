"""Expected remaining service (pure): the Gittins index of a job given the GPU-time it has had.

Tiresias (Gu et al., NSDI '19) schedules jobs whose run times are unknown but drawn from a known
distribution by their **Gittins index**: for a job that has attained ``a`` GPU-seconds of service,

    G(a) = max over Δ of  P(S − a ≤ Δ | S > a)  /  E[min(S − a, Δ) | S > a]

— the best rate of completions per GPU-second of further service the job can promise. A job
that has run longer than most runs of its kind gets a lower index (it is probably one of the long
ones), a job that is likely to end soon a higher one. The distribution of ``S`` here is the
empirical one of the job's prediction group (:func:`gpusched.durations.group_keys`: the same task,
then tenant and GPU count, tenant, fleet — the groups the duration predictor uses), in GPU-seconds
(run time × GPUs), so a wide job accrues service faster (Tiresias' two-dimensional attained
service). For an empirical distribution the maximum is reached at one of the samples, so with the
samples above ``a`` sorted as ``r_1 ≤ … ≤ r_m`` (remaining service ``x − a``):

    G(a) = max_j  j / (r_1 + … + r_j + (m − j)·r_j)

computed with numpy in O(m). When no group has :attr:`ServiceModel.min_runs` runs, or fewer than
:attr:`ServiceModel.min_tail` of its runs outlasted ``a``, the job falls back to **discretised
least-attained-service** (Tiresias' fallback for unknown distributions): queues bounded at
``las_bounds_s`` GPU-seconds, each queue's index 1 / its bound.

Constants (:class:`ServiceModel`), set by these reasons and not fitted to a trace:

* ``window`` = 200 most recent runs per group: resolves the tail to the 99.5th percentile while
  still following a task whose runs changed (4× the predictor's 50-run window, whose median needs
  fewer); the index costs O(window) per job.
* ``min_runs`` = 20: the least sample whose top decile still holds two runs.
* ``min_tail`` = 2: an index needs two runs longer than the attained service, so one outlier
  alone never decides.
* ``las_bounds_s`` = 1, 10, 100 GPU-hours: one queue per decade of attained GPU-time, the first
  bound being the GPU-time the policy assumes for a task without an estimate
  (``Policy.unknown_service_s``); jobs in one queue never preempt each other.
* ``margin`` = 2: a waiting job preempts a running one only if its index is more than twice the
  running job's — indices within a factor of two are not told apart (the accuracy yardstick the
  predictor is judged by: "within 2×"), and the beneficiary's index must halve before the victim
  can take the devices back (hysteresis, together with the minimum run time).

Queue order uses the same index: :func:`queue_rank` = −log2(index), so the placement engine's
aging (``Policy.service_halving_s``: every day of waiting doubles the index) applies as it does
to shortest-first.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import numpy as np

from gpusched.durations.predictor import FinishedRun, GroupKey, group_keys, group_phrase
from gpusched.errors import ConfigurationError
from gpusched.model import MILLI
from gpusched.request import GPURequest

__all__ = [
    "IndexCache", "ServiceHistory", "ServiceIndex", "ServiceModel", "aged_index", "gittins_index",
    "gittins_indices", "gpu_seconds",
    "las_index", "outranks", "queue_rank",
]


@dataclass(frozen=True, slots=True)
class ServiceModel:
    """The index's constants (see the module docstring for why these values)."""

    window: int = 200
    min_runs: int = 20
    min_tail: int = 2
    las_bounds_s: tuple[float, ...] = (3600.0, 36000.0, 360000.0)
    margin: float = 2.0

    def __post_init__(self) -> None:
        bounds = self.las_bounds_s
        if (self.min_runs < 1 or self.window < self.min_runs or self.min_tail < 1 or not bounds
                or any(b <= 0 for b in bounds) or list(bounds) != sorted(bounds) or self.margin < 1):
            raise ConfigurationError(
                f"service model: window={self.window}, min_runs={self.min_runs}, min_tail={self.min_tail}, "
                f"las_bounds_s={bounds}, margin={self.margin}; need 1 ≤ min_runs ≤ window, min_tail ≥ 1, "
                "increasing positive bounds and margin ≥ 1, e.g. the defaults 200, 20, 2, (3600, 36000, "
                "360000), 2"
            )


@dataclass(frozen=True, slots=True)
class ServiceIndex:
    """A job's Gittins index (completions per GPU-second; higher = more urgent), the ``basis`` it
    came from (a group basis of :data:`gpusched.durations.BASES`, or ``las``), the ``runs`` of
    that group and the group in words."""

    value: float
    basis: str
    runs: int
    group: str

    def describe(self) -> str:
        """``index 1.2e-04 /GPU-s from 140 past 1-GPU runs of tenant vc1``."""
        if self.basis == "las":
            return f"index {self.value:.3g} /GPU-s (least attained service: too little history)"
        return f"index {self.value:.3g} /GPU-s from {self.runs} past {self.group}"


def gpu_seconds(request: GPURequest, run_s: float) -> float:
    """GPU-seconds of ``run_s`` seconds of ``request`` (GPUs × milli per GPU / 1000 × time)."""
    return max(0.0, run_s) * request.count * request.milli_per_gpu / MILLI


def gittins_index(
    samples: np.ndarray, prefix: np.ndarray, attained: float, min_tail: int = 1
) -> float | None:
    """The Gittins index at ``attained`` of the empirical distribution ``samples`` (sorted
    ascending; ``prefix`` = their cumulative sums with a leading 0), or None when fewer than
    ``min_tail`` samples exceed ``attained``."""
    start = int(np.searchsorted(samples, attained, side="right"))
    m = len(samples) - start
    if m < max(1, min_tail):
        return None
    tail = samples[start:]
    remaining = tail - attained
    j = np.arange(1, m + 1, dtype=float)
    used = (prefix[start + 1:] - prefix[start]) - j * attained  # r_1 + … + r_j
    return float(np.max(j / (used + (m - j) * remaining)))


def gittins_indices(
    samples: np.ndarray, prefix: np.ndarray, attained: np.ndarray, min_tail: int = 1
) -> np.ndarray:
    """:func:`gittins_index` for many attained values at once (NaN where the tail is too short)."""
    a = np.asarray(attained, dtype=float)[:, None]
    m = len(samples)
    start = np.searchsorted(samples, a[:, 0], side="right")[:, None]
    i = np.arange(m)[None, :]
    j = (i - start + 1).astype(float)
    tail = (m - start).astype(float)
    used = (prefix[None, 1:] - prefix[start]) - j * a
    with np.errstate(divide="ignore", invalid="ignore"):
        rate = np.where(i >= start, j / (used + (tail - j) * (samples[None, :] - a)), -np.inf)
    best = rate.max(axis=1) if m else np.full(len(a), -np.inf)
    return np.where((m - start[:, 0]) >= max(1, min_tail), best, np.nan)


def las_index(attained: float, bounds: tuple[float, ...]) -> float:
    """Discretised least attained service: 1 / the bound of the first queue whose bound exceeds
    ``attained`` (the last queue's bound beyond it)."""
    for bound in bounds:
        if attained < bound:
            return 1.0 / bound
    return 1.0 / bounds[-1]


def aged_index(index: float, waited_s: float, halving_s: float) -> float:
    """A waiting job's index after ``waited_s`` of waiting: doubled every ``halving_s`` (the
    placement engine's aging of shortest-first, so nothing starves)."""
    return index * 2.0 ** min(64.0, max(0.0, waited_s) / max(halving_s, 1e-9))


def queue_rank(index: float) -> float:
    """The queue key of a job with ``index`` for ``QueueOrder.RANKED`` (lower first): −log2(index)."""
    return -math.log2(max(index, 1e-300))


def outranks(waiting: float, running: float, margin: float) -> bool:
    """True when a waiting job of index ``waiting`` may preempt a running one of index ``running``."""
    return waiting > running * margin


@dataclass(frozen=True, slots=True)
class _Distribution:
    recent: tuple[float, ...]
    samples: np.ndarray = field(repr=False)
    prefix: np.ndarray = field(repr=False)

    @classmethod
    def of(cls, recent: tuple[float, ...]) -> _Distribution:
        samples = np.sort(np.asarray(recent, dtype=float))
        return cls(recent, samples, np.concatenate(([0.0], np.cumsum(samples))))


_EMPTY: Mapping[GroupKey, _Distribution] = MappingProxyType({})


class IndexCache:
    """Index values found before, per job, each with the groups it was read from (mutable; one per
    caller).

    A value is reused only for the same job at the same attained service while every group of its
    chain up to the one that gave it is the same object in the history asked (a history shares
    unchanged groups with the one it was made from, :meth:`ServiceHistory.with_runs`), so a reused
    value is the one a fresh computation gives."""

    def __init__(self, limit: int = 100_000) -> None:
        self.limit = limit
        # job -> (value, attained, chain, the groups it was read from, the last history it held in)
        self._values: dict[str, tuple[float, float, tuple[GroupKey, ...], tuple[object, ...],
                                      ServiceHistory]] = {}

    def get(
        self, history: ServiceHistory, job: str, chain: tuple[GroupKey, ...], attained: float
    ) -> float | None:
        """Job ``job``'s value for ``chain`` at ``attained`` if it still holds in ``history``."""
        hit = self._values.get(job)
        if hit is None or hit[1] != attained or hit[2] is not chain:
            return None
        if hit[4] is history:
            return hit[0]
        groups = history.groups
        for key, dist in zip(chain, hit[3], strict=False):
            if groups.get(key) is not dist:
                return None
        self._values[job] = (*hit[:4], history)  # checked once per history
        return hit[0]

    def known(self, history: ServiceHistory, job: str, attained: float) -> float | None:
        """Job ``job``'s value at ``attained`` if it was found or checked in ``history`` itself
        (no group to compare: a cycle's second look at the same work)."""
        hit = self._values.get(job)
        return hit[0] if hit is not None and hit[4] is history and hit[1] == attained else None

    def put(self, history: ServiceHistory, job: str, chain: tuple[GroupKey, ...], attained: float,
            value: float, depth: int) -> None:
        """Remember ``value``, read from the first ``depth`` groups of ``chain`` in ``history``."""
        if len(self._values) >= self.limit:
            self._values.clear()
        self._values[job] = (value, attained, chain, tuple(history.groups.get(k) for k in chain[:depth]),
                             history)


@dataclass(frozen=True, slots=True)
class ServiceHistory:
    """Per prediction group, the GPU-seconds of its most recent finished runs; immutable
    (:meth:`with_runs` returns a new one). ``learned``: runs seen in all."""

    model: ServiceModel = field(default_factory=ServiceModel)
    groups: Mapping[GroupKey, _Distribution] = field(default_factory=lambda: _EMPTY, repr=False)
    learned: int = 0
    _fresh: dict[GroupKey, float | None] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def learn(cls, runs: Iterable[FinishedRun], model: ServiceModel | None = None) -> ServiceHistory:
        """The history of ``runs`` (oldest first)."""
        return cls(model or ServiceModel()).with_runs(runs)

    def with_runs(self, runs: Iterable[FinishedRun]) -> ServiceHistory:
        """A new history that also knows ``runs`` (oldest first); this one is unchanged."""
        added: dict[GroupKey, list[float]] = {}
        count = 0
        for run in runs:
            if not (math.isfinite(run.duration_s) and run.duration_s >= 0):
                continue
            count += 1
            service = max(1.0, run.duration_s) * max(run.gpu_milli, 1) / MILLI
            for key in group_keys(run):
                added.setdefault(key, []).append(service)
        if not count:
            return self
        groups = dict(self.groups)
        for key, values in added.items():
            old = groups.get(key)
            groups[key] = _Distribution.of(((old.recent if old else ()) + tuple(values))[-self.model.window:])
        return replace(self, groups=MappingProxyType(groups), learned=self.learned + count, _fresh={})

    def index(self, request: GPURequest, task: str, attained_gpu_s: float) -> ServiceIndex:
        """The Gittins index of a job of ``request`` (task ``task``) that has had ``attained_gpu_s``
        GPU-seconds of service: from its most specific group with enough runs (and enough of them
        longer than that), else discretised LAS."""
        model = self.model
        for key in group_keys(FinishedRun.of(request, task, 0.0)):
            dist = self.groups.get(key)
            if dist is None or len(dist.recent) < model.min_runs:
                continue
            value = self._fresh.get(key, math.nan) if attained_gpu_s <= 0 else math.nan
            if value is not None and math.isnan(value):
                value = gittins_index(dist.samples, dist.prefix, max(0.0, attained_gpu_s), model.min_tail)
                if attained_gpu_s <= 0:
                    self._fresh[key] = value  # a cache: fresh jobs of a group share their index
            if value is not None:
                return ServiceIndex(value, str(key[0]), len(dist.recent), group_phrase(key))
        return ServiceIndex(las_index(attained_gpu_s, model.las_bounds_s), "las", 0, "")

    def index_values(
        self,
        items: Sequence[tuple[GPURequest, str, float]],
        keys: Sequence[tuple[GroupKey, ...]] | None = None,
        cache: tuple[IndexCache, Sequence[str]] | None = None,
    ) -> list[float]:
        """The index values of many ``(request, task, attained GPU-s)`` at once, as
        :meth:`index` would give them (vectorised per group: a cycle's running tasks).

        ``keys``: each item's :func:`~gpusched.durations.group_keys` if the caller has them;
        ``cache``: an :class:`IndexCache` and each item's job name: values found before for the
        same job and attained service, reused while every group they were read from is unchanged
        (a new run in any of them invalidates the value), so a waiting job's index is computed
        once per change of its groups, not once per cycle."""
        model = self.model
        out = [math.nan] * len(items)
        chains = list(keys) if keys is not None else [
            group_keys(FinishedRun.of(r, t, 0.0)) for r, t, _ in items]
        todo: list[int] = []
        for n, chain in enumerate(chains):
            hit = cache[0].get(self, cache[1][n], chain, items[n][2]) if cache is not None else None
            if hit is None:
                todo.append(n)
            else:
                out[n] = hit
        level = 0
        while todo:
            by_group: dict[GroupKey, list[int]] = {}
            later: list[int] = []
            for n in todo:
                chain = chains[n]
                if level >= len(chain):
                    out[n] = las_index(items[n][2], model.las_bounds_s)
                    if cache is not None:
                        cache[0].put(self, cache[1][n], chain, items[n][2], out[n], len(chain))
                    continue
                dist = self.groups.get(chain[level])
                if dist is None or len(dist.recent) < model.min_runs:
                    later.append(n)
                else:
                    by_group.setdefault(chain[level], []).append(n)
            for key, members in by_group.items():
                dist = self.groups[key]
                attained = [max(0.0, items[n][2]) for n in members]
                distinct = list(dict.fromkeys(attained))  # fresh jobs share attained 0: each value once
                found = gittins_indices(dist.samples, dist.prefix, np.array(distinct), model.min_tail)
                by_value = dict(zip(distinct, found.tolist(), strict=True))
                for n, value in zip(members, map(by_value.__getitem__, attained), strict=True):
                    if math.isnan(value):
                        later.append(n)
                    else:
                        out[n] = float(value)
                        if cache is not None:
                            cache[0].put(self, cache[1][n], chains[n], items[n][2], out[n], level + 1)
            todo = later
            level += 1
        return out

    def report(self) -> dict[str, Any]:
        """JSON-safe: the constants and how much history there is."""
        m = self.model
        trusted = sum(1 for d in self.groups.values() if len(d.recent) >= m.min_runs)
        return {"window": m.window, "min_runs": m.min_runs, "min_tail": m.min_tail,
                "las_bounds_s": list(m.las_bounds_s), "margin": m.margin, "learned_runs": self.learned,
                "groups": len(self.groups), "groups_trusted": trusted}
