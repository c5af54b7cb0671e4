"""The expected workload: the request shapes the fragmentation measure takes the expectation over.

:class:`Workload` digests :class:`~gpusched.placement.policy.WorkloadShape` records for the
scorer (:mod:`gpusched.placement.score`). A policy may carry its shapes (the simulators give the
trace's own); otherwise a call estimates them from its pending and running requests, blended with
:data:`DEFAULT_WORKLOAD` (:func:`estimate_workload`; :func:`workload_for` picks between the two).
:class:`SteadyWorkload` is the estimate a scheduler keeps across its cycles: it moves to a new
estimate only when the mix has drifted, so the engine built on it can stay warm
(:mod:`gpusched.placement.warm`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from gpusched.errors import ConfigurationError
from gpusched.model import MILLI
from gpusched.placement.policy import WorkloadShape
from gpusched.request import GPURequest

__all__ = [
    "DEFAULT_WORKLOAD",
    "SteadyWorkload",
    "Workload",
    "distance",
    "estimate_workload",
    "estimated_shapes",
    "workload_for",
]

DEFAULT_WORKLOAD: tuple[WorkloadShape, ...] = (
    WorkloadShape(1, MILLI, 0.40),
    WorkloadShape(1, 500, 0.15),
    WorkloadShape(1, 250, 0.10),
    WorkloadShape(2, MILLI, 0.12),
    WorkloadShape(4, MILLI, 0.12),
    WorkloadShape(8, MILLI, 0.11),
)
"""Prior over request shapes, blended with what a call actually sees."""

_MAX_SHAPES = 16


@dataclass(frozen=True, slots=True)
class Workload:
    """Request shapes, pre-digested for O(1)-per-candidate expected fragmentation.

    Whole-device shapes: ``whole_cdf[x]`` = probability of a whole shape needing ≤ x devices.
    Fractional shapes: sorted distinct ``frac_milli`` with cumulative probability ``frac_cdf``.
    """

    whole_cdf: np.ndarray
    p_whole: float
    frac_milli: np.ndarray
    frac_p: np.ndarray
    frac_cdf: np.ndarray
    p_frac: float
    host_aware: bool = False
    # Per shape (only used when host_aware): count, milli, p, cpu, memory, frac threshold column.
    s_count: np.ndarray = field(default_factory=lambda: np.zeros(0))
    s_milli: np.ndarray = field(default_factory=lambda: np.zeros(0))
    s_p: np.ndarray = field(default_factory=lambda: np.zeros(0))
    s_cpu: np.ndarray = field(default_factory=lambda: np.zeros(0))
    s_mem: np.ndarray = field(default_factory=lambda: np.zeros(0))
    s_col: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    s_models: tuple[frozenset[str], ...] = ()  # per shape; empty = any model

    @classmethod
    def of(cls, shapes: Iterable[WorkloadShape]) -> Workload:
        """Digest shapes (weights normalised to 1; empty = :data:`DEFAULT_WORKLOAD`)."""
        items = [s for s in shapes if s.weight > 0] or list(DEFAULT_WORKLOAD)
        total = sum(s.weight for s in items)
        kmax = max([s.count for s in items if s.milli >= MILLI], default=0)
        whole = np.zeros(kmax + 1)
        frac: dict[int, float] = {}
        for s in items:
            if s.count == 0:
                continue  # a CPU-only shape: every free GPU is fragment for it (FGD's XL/XR cases)
            if s.milli >= MILLI:
                whole[s.count] += s.weight / total
            else:
                frac[s.milli] = frac.get(s.milli, 0.0) + s.weight / total
        milli = np.array(sorted(frac), dtype=np.float64)
        fp = np.array([frac[int(m)] for m in milli], dtype=np.float64)
        cdf = np.cumsum(fp) if len(fp) else np.zeros(0)
        # Model-constrained shapes need the shape-by-shape form too.
        host = any(s.cpu_milli or s.host_memory_bytes or s.models or not s.count for s in items)
        col = [int(np.searchsorted(milli, s.milli)) if 0 < s.milli < MILLI and s.count else -1 for s in items]
        return cls(
            np.cumsum(whole),
            float(whole.sum()),
            milli,
            fp,
            cdf,
            float(fp.sum()),
            host,
            np.array([s.count for s in items], dtype=np.float64),
            np.array([s.milli for s in items], dtype=np.float64),
            np.array([s.weight / total for s in items], dtype=np.float64),
            np.array([s.cpu_milli for s in items], dtype=np.float64),
            np.array([s.host_memory_bytes for s in items], dtype=np.float64),
            np.array(col, dtype=np.int64),
            tuple(s.models for s in items),
        )

    def p_frac_upto(self, x: np.ndarray) -> np.ndarray:
        """Probability of a fractional shape needing ≤ ``x`` milli."""
        if not len(self.frac_milli):
            return np.zeros(len(x))
        j = np.searchsorted(self.frac_milli, x, side="right") - 1
        return np.where(j >= 0, self.frac_cdf[np.maximum(j, 0)], 0.0)

    def p_whole_fits(self, nfull: np.ndarray) -> np.ndarray:
        """Probability of a whole-device shape fitting in ``nfull`` free devices."""
        # min/max rather than np.clip: the same values, without np.clip's per-call overhead.
        k = np.minimum(np.maximum(nfull, 0), len(self.whole_cdf) - 1).astype(np.int64)
        return self.whole_cdf[k]


def estimate_workload(
    requests: Iterable[GPURequest], prior: tuple[WorkloadShape, ...] = DEFAULT_WORKLOAD
) -> Workload:
    """The :class:`Workload` of :func:`estimated_shapes` (the same shapes, the same object)."""
    return _workload_of(estimated_shapes(requests, prior))


def estimated_shapes(
    requests: Iterable[GPURequest], prior: tuple[WorkloadShape, ...] = DEFAULT_WORKLOAD
) -> tuple[WorkloadShape, ...]:
    """Shapes seen in ``requests`` (fractions rounded to 50 milli, with their allowed models),
    blended half-and-half with ``prior``."""
    seen = Counter(map(_shape_of, requests))  # counted in C; first-seen order as a loop keeps it
    total = sum(seen.values())
    shapes = [WorkloadShape(s.count, s.milli, s.weight * 0.5 if total else s.weight) for s in prior]
    for (count, milli, models), n in seen.most_common(_MAX_SHAPES):
        shapes.append(WorkloadShape(count, milli, 0.5 * n / total, models=models))
    return tuple(shapes)


def _shape_of(req: GPURequest) -> tuple[int, int, frozenset[str]]:
    milli = req.milli_per_gpu
    if milli < MILLI:
        milli = min(MILLI - 50, max(50, round(milli / 50) * 50))
    return req.count, milli, req.models


def workload_for(shapes: tuple[WorkloadShape, ...], requests: Iterable[GPURequest]) -> Workload:
    """The workload a placement call scores by: the policy's ``shapes`` when it has any, else the
    estimate from the call's ``requests`` (:func:`estimate_workload`); equal inputs give the same
    object."""
    return _workload_of(shapes) if shapes else estimate_workload(requests)


@lru_cache(maxsize=256)
def _workload_of(shapes: tuple[WorkloadShape, ...]) -> Workload:
    # The same shapes give the same Workload object, so per-snapshot caches can key on it.
    return Workload.of(shapes)


class SteadyWorkload:
    """The estimated shapes a scheduler keeps between its cycles.

    ``shapes(requests)`` estimates the shapes of this cycle's requests (:func:`estimated_shapes`)
    and returns the ones it returned before while the two differ by at most ``drift`` in total
    variation distance (half the sum of the absolute weight differences, shape by shape: 0 the
    same mix, 1 disjoint); past it, the new estimate is kept and returned. ``drift = 0`` follows
    every change of the mix.
    """

    def __init__(self, drift: float) -> None:
        if not 0.0 <= drift <= 1.0:
            raise ConfigurationError(
                f"workload drift {drift!r} is outside 0..1; give a total variation distance "
                "(0 = re-estimate the request mix every cycle, 0.1 = the default)"
            )
        self.drift = drift
        self._kept: tuple[WorkloadShape, ...] | None = None

    def shapes(self, requests: Iterable[GPURequest]) -> tuple[WorkloadShape, ...]:
        """The shapes to score this cycle by (see the class docstring)."""
        estimate = estimated_shapes(requests)
        if self._kept is None or distance(self._kept, estimate) > self.drift:
            self._kept = estimate
        return self._kept


def distance(a: Iterable[WorkloadShape], b: Iterable[WorkloadShape]) -> float:
    """Total variation distance between two shape mixes (weights normalised per mix)."""

    def mix(shapes: Iterable[WorkloadShape]) -> dict[tuple[object, ...], float]:
        weights: dict[tuple[object, ...], float] = {}
        for s in shapes:
            key = (s.count, s.milli, s.cpu_milli, s.host_memory_bytes, s.models)  # all but the weight
            weights[key] = weights.get(key, 0.0) + s.weight
        total = sum(weights.values()) or 1.0
        return {k: v / total for k, v in weights.items()}

    left, right = mix(a), mix(b)
    return 0.5 * sum(abs(left.get(k, 0.0) - right.get(k, 0.0)) for k in left.keys() | right.keys())
