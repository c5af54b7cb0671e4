"""The duration predictor: finished runs in, ``predict(request, task) -> Prediction | None`` out.

Groups, most specific first (:data:`BASES`):

``task``
    the same task (an Airflow ``dag_id/task_id``, a trace's job name or type) with the same
    tenant, GPU count and model constraint — the repeated runs of one pipeline step;
``tenant+gpus``
    the tenant's runs of the same GPU count;
``tenant``
    the tenant's runs;
``fleet``
    every run.

The estimate of a group is the **median of its most recent** ``DurationModel.recent`` runs,
trusted once the group has ``DurationModel.min_runs`` of them; otherwise the next, coarser group
answers. The median because run times are heavy-tailed (one crashed-early or weeks-long run must
not move the estimate); the recent window so the estimate follows a task whose data or code
changed; three runs as the least sample in which the median outvotes one outlier. These are
fixed by those reasons, not fitted to any trace.

Everything here is pure and immutable: :meth:`DurationPredictor.with_runs` returns a new
predictor, so the executor's cache and the simulator's online learning share one implementation.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from gpusched.errors import ConfigurationError
from gpusched.model import MILLI
from gpusched.request import GPURequest

__all__ = [
    "BASES",
    "DurationModel",
    "DurationPredictor",
    "FinishedRun",
    "Prediction",
    "PredictionErrors",
    "model_label",
    "prediction_errors",
    "replay_errors",
    "with_prediction",
]

BASES = ("task", "tenant+gpus", "tenant", "fleet")
"""The groups a prediction can come from, most specific first."""

GroupKey = tuple[Any, ...]


def model_label(request: GPURequest) -> str:
    """The model constraint of ``request`` as one group label (``any`` when unconstrained)."""
    return "|".join(sorted(request.models)) or "any"


def _gpu_milli(request: GPURequest) -> int:
    return request.count * request.milli_per_gpu


@dataclass(frozen=True, slots=True)
class FinishedRun:
    """One finished run to learn from.

    ``task``: the task's identity across runs (``dag_id/task_id``; a trace's job name), empty
    when unknown; ``tenant``; ``gpu_milli``: GPUs held × 1000 (count × milli per GPU);
    ``model``: :func:`model_label` of its request; ``duration_s``: how long it ran.
    """

    task: str
    tenant: str
    gpu_milli: int
    model: str
    duration_s: float

    @classmethod
    def of(cls, request: GPURequest, task: str, duration_s: float) -> FinishedRun:
        """The run of ``request`` (task ``task``) that lasted ``duration_s``."""
        return cls(task, request.tenant, _gpu_milli(request), model_label(request), float(duration_s))


@dataclass(frozen=True, slots=True)
class DurationModel:
    """The predictor's two constants (see the module docstring for why these values)."""

    min_runs: int = 3
    recent: int = 50

    def __post_init__(self) -> None:
        if self.min_runs < 1 or self.recent < self.min_runs:
            raise ConfigurationError(
                f"duration model: min_runs={self.min_runs}, recent={self.recent}; "
                "need 1 ≤ min_runs ≤ recent, e.g. min_runs=3, recent=50"
            )


@dataclass(frozen=True, slots=True)
class Prediction:
    """A predicted run time: ``seconds``, the ``basis`` (one of :data:`BASES`), the ``runs`` it is
    the median of and the ``group`` they share (``d/train``, ``2-GPU runs of tenant vision`` …)."""

    seconds: float
    basis: str
    runs: int
    group: str

    def describe(self) -> str:
        """``expected 1.2 h, predicted from 14 past runs of d/train_resnet``."""
        return f"expected {_human(self.seconds)}, predicted from {self.runs} past {self.group}"


def _human(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _keys(task: str, tenant: str, gpu_milli: int, model: str) -> tuple[GroupKey | None, ...]:
    return (
        ("task", task, tenant, gpu_milli, model) if task else None,
        ("tenant+gpus", tenant, gpu_milli),
        ("tenant", tenant),
        ("fleet",),
    )


def _group_phrase(key: GroupKey) -> str:
    basis = key[0]
    if basis == "task":
        return f"runs of {key[1]}"
    if basis == "tenant+gpus":
        return f"{key[2] / MILLI:g}-GPU runs of tenant {key[1]}"
    if basis == "tenant":
        return f"runs of tenant {key[1]}"
    return "runs on this fleet"


@dataclass(frozen=True, slots=True)
class _Group:
    recent: tuple[float, ...]
    estimate: float


_EMPTY: Mapping[GroupKey, _Group] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class DurationPredictor:
    """An immutable index of finished runs by group; build with :meth:`learn` or :meth:`with_runs`.

    ``learned``: how many runs it has seen in all.
    """

    model: DurationModel = field(default_factory=DurationModel)
    groups: Mapping[GroupKey, _Group] = field(default_factory=lambda: _EMPTY, repr=False)
    learned: int = 0

    @classmethod
    def learn(cls, runs: Iterable[FinishedRun], model: DurationModel | None = None) -> DurationPredictor:
        """A predictor of ``runs`` (oldest first: the most recent ones form each group's window)."""
        return cls(model or DurationModel()).with_runs(runs)

    def with_runs(self, runs: Iterable[FinishedRun]) -> DurationPredictor:
        """A new predictor that also knows ``runs`` (oldest first); this one is unchanged."""
        window = self.model.recent
        added: dict[GroupKey, list[float]] = {}
        count = 0
        for run in runs:
            if not (math.isfinite(run.duration_s) and run.duration_s >= 0):
                continue
            count += 1
            for key in _keys(run.task, run.tenant, run.gpu_milli, run.model):
                if key is not None:
                    added.setdefault(key, []).append(run.duration_s)
        if not count:
            return self
        groups = dict(self.groups)
        for key, durations in added.items():
            old = groups.get(key)
            recent = ((old.recent if old else ()) + tuple(durations))[-window:]
            groups[key] = _Group(recent, statistics.median(recent))
        return replace(self, groups=MappingProxyType(groups), learned=self.learned + count)

    def predict(self, request: GPURequest, task: str = "") -> Prediction | None:
        """The run time of ``request`` (task ``task``) from its most specific trusted group, or None."""
        return self.predict_run(FinishedRun.of(request, task, 0.0))

    def predict_run(self, run: FinishedRun) -> Prediction | None:
        """What this predictor would have said of ``run`` before it ran (its duration is not read)."""
        for key in _keys(run.task, run.tenant, run.gpu_milli, run.model):
            if key is None:
                continue
            group = self.groups.get(key)
            if group is not None and len(group.recent) >= self.model.min_runs:
                return Prediction(group.estimate, key[0], len(group.recent), _group_phrase(key))
        return None


def with_prediction(
    request: GPURequest, task: str, predictor: DurationPredictor | None
) -> tuple[GPURequest, Prediction | None]:
    """``request`` with the predicted ``expected_duration_s`` when its author gave none.

    Returns the request unchanged (and None) when it has an estimate already, when there is no
    predictor, or when no group has enough runs yet.
    """
    if predictor is None or request.expected_duration_s > 0:
        return request, None
    prediction = predictor.predict(request, task)
    if prediction is None:
        return request, None
    seconds = max(1, math.ceil(prediction.seconds))
    return replace(request, expected_duration_s=seconds), prediction


def replay_errors(
    runs: Sequence[FinishedRun], model: DurationModel | None = None
) -> tuple[int, PredictionErrors]:
    """Replay ``runs`` (oldest first) as they happened: predict each from the runs before it, then
    learn it. Returns (runs that got no prediction, the errors of those that did)."""
    predictor = DurationPredictor(model or DurationModel())
    pairs: list[tuple[Prediction, float]] = []
    missed = 0
    for run in runs:
        prediction = predictor.predict_run(run)
        if prediction is None:
            missed += 1
        else:
            pairs.append((prediction, run.duration_s))
        predictor = predictor.with_runs((run,))
    return missed, prediction_errors(pairs)


@dataclass(frozen=True, slots=True)
class PredictionErrors:
    """How far predictions were from the runs they were made for.

    ``predicted``: runs with a prediction; ``median_ape_pct``: median of |predicted − actual| /
    actual × 100; ``within_2x_pct``: share of predictions within a factor of two of the actual
    run time; ``by_basis``: per basis, the count and its median APE.
    """

    predicted: int
    median_ape_pct: float
    within_2x_pct: float
    by_basis: Mapping[str, Mapping[str, float]]

    def as_dict(self) -> dict[str, Any]:
        """JSON-safe."""
        return {
            "predicted": self.predicted,
            "median_ape_pct": self.median_ape_pct,
            "within_2x_pct": self.within_2x_pct,
            "by_basis": {k: dict(v) for k, v in self.by_basis.items()},
        }


def prediction_errors(pairs: Sequence[tuple[Prediction, float]]) -> PredictionErrors:
    """Error figures of ``(prediction, actual run time)`` pairs (runs of 0 s count as 1 s)."""

    def ape(p: Prediction, actual: float) -> float:
        return abs(p.seconds - actual) / max(actual, 1.0) * 100.0

    def within(p: Prediction, actual: float) -> bool:
        a, s = max(actual, 1.0), max(p.seconds, 1.0)
        return 0.5 <= s / a <= 2.0

    by_basis: dict[str, dict[str, float]] = {}
    for basis in BASES:
        mine = [ape(p, a) for p, a in pairs if p.basis == basis]
        if mine:
            by_basis[basis] = {"count": len(mine), "median_ape_pct": round(statistics.median(mine), 1)}
    errors = [ape(p, a) for p, a in pairs]
    close = sum(within(p, a) for p, a in pairs)
    return PredictionErrors(
        predicted=len(pairs),
        median_ape_pct=round(statistics.median(errors), 1) if errors else math.nan,
        within_2x_pct=round(100.0 * close / len(pairs), 1) if pairs else math.nan,
        by_basis=MappingProxyType(by_basis),
    )
