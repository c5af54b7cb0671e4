"""Scoring: fragmentation (FGD-style), topology tiers, heterogeneity-aware speed and energy.

Fragmentation follows the idea of Fragmentation Gradient Descent (Weng et al., USENIX ATC '23):
a node's fragmentation *for one request shape* is the free GPU capacity that shape cannot use —
all of the node's free capacity if the shape does not fit there at all, else the free share of
devices too small for it (devices with less than ``milli`` free for a fraction; partially used
devices for whole-device shapes). The node's fragmentation is the expectation over the workload's
shapes (:class:`Workload`), and a placement is scored by how much it *increases* that expectation
(``delta``): packing a small task onto an already broken device costs nothing, cutting into a
fresh device that larger tasks need costs a lot.

Node statistics (:class:`FragStats`) are kept per node and refreshed only for the nodes an
assignment touches, so one decision costs O(candidates × shapes) numpy work.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from gpusched.model import MILLI
from gpusched.placement.index import FleetIndex, FreeState
from gpusched.placement.policy import WorkloadShape
from gpusched.request import GPURequest

__all__ = ["DEFAULT_WORKLOAD", "FragStats", "Workload", "estimate_workload"]

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
    """Request shapes as arrays: ``count``, ``milli``, probability ``p`` and fragment threshold."""

    count: np.ndarray
    milli: np.ndarray
    p: np.ndarray
    thresholds: np.ndarray  # distinct thresholds
    thr_of: np.ndarray  # shape -> position in thresholds

    @classmethod
    def of(cls, shapes: Iterable[WorkloadShape]) -> Workload:
        """Arrays from shapes (weights normalised to 1)."""
        items = [s for s in shapes if s.weight > 0]
        if not items:
            items = list(DEFAULT_WORKLOAD)
        count = np.array([s.count for s in items], dtype=np.int64)
        milli = np.array([s.milli for s in items], dtype=np.int64)
        p = np.array([s.weight for s in items], dtype=np.float64)
        thr = np.where(milli < MILLI, milli, MILLI)
        thresholds, thr_of = np.unique(thr, return_inverse=True)
        return cls(count, milli, p / p.sum(), thresholds, thr_of.astype(np.int64))


def estimate_workload(
    requests: Iterable[GPURequest], prior: tuple[WorkloadShape, ...] = DEFAULT_WORKLOAD
) -> Workload:
    """Shapes seen in ``requests`` (fractions rounded to 50 milli), blended half-and-half with ``prior``."""
    seen: Counter[tuple[int, int]] = Counter()
    for req in requests:
        milli = (
            req.milli_per_gpu if req.milli_per_gpu >= MILLI else max(50, round(req.milli_per_gpu / 50) * 50)
        )
        seen[(req.count, min(milli, MILLI))] += 1
    total = sum(seen.values())
    shapes = [WorkloadShape(s.count, s.milli, s.weight * 0.5 if total else s.weight) for s in prior]
    for (count, milli), n in seen.most_common(_MAX_SHAPES):
        shapes.append(WorkloadShape(count, milli, 0.5 * n / total))
    return Workload.of(shapes)


class FragStats:
    """Per-node aggregates of free milli-GPU over in-service devices, for fragmentation deltas."""

    __slots__ = ("frag", "in_service", "index", "max1", "max2", "maxpart", "nfull", "total", "workload")

    def __init__(self, index: FleetIndex, state: FreeState, workload: Workload) -> None:
        self.index = index
        self.workload = workload
        self.in_service = (index.dev_health < 2) & ~index.dev_cordoned & ~index.dev_standby
        n = len(index.nodes)
        self.total: np.ndarray = np.zeros(n)
        self.nfull: np.ndarray = np.zeros(n)
        self.max1: np.ndarray = np.zeros(n)
        self.max2: np.ndarray = np.zeros(n)
        self.maxpart: np.ndarray = np.zeros(n)
        self.frag: np.ndarray = np.zeros((n, len(workload.thresholds)))
        if index.n_devices:
            self._compute_all(state)

    def _compute_all(self, state: FreeState) -> None:
        idx = self.index
        n = len(idx.nodes)
        f = np.where(self.in_service, state.free_milli, 0).astype(np.float64)
        node = idx.dev_node
        self.total = np.bincount(node, weights=f, minlength=n)
        self.nfull = np.bincount(node, weights=(f >= MILLI).astype(np.float64), minlength=n)
        order = np.lexsort((f, node))
        sorted_f = f[order]
        end = idx.node_start[1:]
        size = idx.node_size
        has1 = size >= 1
        has2 = size >= 2
        self.max1 = np.where(has1, sorted_f[np.maximum(end - 1, 0)], 0.0)
        self.max2 = np.where(has2, sorted_f[np.maximum(end - 2, 0)], 0.0)
        part = np.where(f < MILLI, f, 0.0)
        self.maxpart = np.zeros(n)
        np.maximum.at(self.maxpart, node, part)
        for j, thr in enumerate(self.workload.thresholds):
            self.frag[:, j] = np.bincount(node, weights=np.where(f < thr, f, 0.0), minlength=n)

    def refresh(self, state: FreeState, nodes: Iterable[int]) -> None:
        """Recompute the aggregates of the given node positions after their usage changed."""
        idx = self.index
        for n in set(nodes):
            lo, hi = int(idx.node_start[n]), int(idx.node_start[n + 1])
            f = np.where(self.in_service[lo:hi], state.free_milli[lo:hi], 0).astype(np.float64)
            self.total[n] = f.sum()
            self.nfull[n] = float((f >= MILLI).sum())
            s = np.sort(f)
            self.max1[n] = s[-1] if len(s) else 0.0
            self.max2[n] = s[-2] if len(s) > 1 else 0.0
            part = f[f < MILLI]
            self.maxpart[n] = part.max() if len(part) else 0.0
            for j, thr in enumerate(self.workload.thresholds):
                self.frag[n, j] = f[f < thr].sum()

    def _expected(
        self, total: np.ndarray, nfull: np.ndarray, max1: np.ndarray, frag: np.ndarray
    ) -> np.ndarray:
        w = self.workload
        whole = w.milli >= MILLI
        fits = np.where(whole[None, :], nfull[:, None] >= w.count[None, :], max1[:, None] >= w.milli[None, :])
        per_shape = np.where(fits, frag[:, w.thr_of], total[:, None])
        return per_shape @ w.p

    def node_fragmentation(self, nodes: np.ndarray) -> np.ndarray:
        """Expected fragmentation (milli-GPU) of the given node positions now."""
        return self._expected(self.total[nodes], self.nfull[nodes], self.max1[nodes], self.frag[nodes])

    def delta_whole(self, nodes: np.ndarray, k: int) -> np.ndarray:
        """Fragmentation increase of taking ``k`` fully free devices on each of ``nodes``."""
        before = self.node_fragmentation(nodes)
        nfull = self.nfull[nodes] - k
        max1 = np.where(nfull > 0, float(MILLI), self.maxpart[nodes])
        after = self._expected(self.total[nodes] - k * MILLI, nfull, max1, self.frag[nodes])
        return after - before

    def delta_fraction(self, devices: np.ndarray, milli: int, free: np.ndarray) -> np.ndarray:
        """Fragmentation increase of taking ``milli`` on each of ``devices`` (``free`` = their free milli)."""
        nodes = self.index.dev_node[devices]
        before = self.node_fragmentation(nodes)
        f = free.astype(np.float64)
        g = f - milli
        max1 = self.max1[nodes]
        others = np.where(f < max1, max1, self.max2[nodes])
        thr = self.workload.thresholds
        frag = (
            self.frag[nodes]
            - np.where(f[:, None] < thr, f[:, None], 0.0)
            + np.where(g[:, None] < thr, g[:, None], 0.0)
        )
        after = self._expected(
            self.total[nodes] - milli, self.nfull[nodes] - (f >= MILLI), np.maximum(others, g), frag
        )
        return after - before
