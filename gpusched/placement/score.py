"""Scoring: fragmentation (FGD-style), topology tiers, heterogeneity-aware speed and energy.

Fragmentation follows the idea of Fragmentation Gradient Descent (Weng et al., USENIX ATC '23):
a node's fragmentation *for one request shape* is the free GPU capacity that shape cannot use —
all of the node's free capacity if the shape does not fit there at all, else the free share of
devices too small for it (devices with less than ``milli`` free for a fraction; partially used
devices for whole-device shapes). A shape that names its models (``WorkloadShape.models``) does
not fit a node of another model at all, so that node's free capacity is all fragment for it.
The node's fragmentation is the expectation over the workload's shapes
(:class:`~gpusched.placement.workload.Workload`),
and a placement is scored by how much it *increases* that expectation
(``delta``): packing a small task onto an already broken device costs nothing, cutting into a
fresh device that larger tasks need costs a lot.

Node statistics (:class:`FragStats`) are kept per node and refreshed only for the nodes an
assignment touches. Because whole-device shapes differ only in their count and fractional shapes
only in their threshold, the expectation over shapes reduces to cumulative-probability lookups,
so scoring one decision costs O(candidates) numpy work whatever the number of shapes.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from gpusched.model import MILLI
from gpusched.placement.index import FleetIndex, FreeState, LruCache
from gpusched.placement.workload import Workload

__all__ = ["FragStats", "cached_stats"]

_LOOP_UPTO = 2  # nodes refreshed one by one; more in one vectorised pass


class FragStats:
    """Per-node aggregates of free milli-GPU over in-service devices, for fragmentation deltas.

    ``frag`` is the free share of partially used devices; ``frac_frag[:, j]`` the free share of
    devices with less than ``frac_milli[j]`` free; ``cum[:, j]`` its probability-weighted prefix
    sum; ``expected`` the node's current expected fragmentation; ``model_ok[node, shape]`` (None
    when no shape names models) whether a shape may run on some in-service device of the node.
    """

    __slots__ = (
        "cum",
        "expected",
        "frac_frag",
        "frag",
        "in_service",
        "index",
        "max1",
        "max2",
        "maxpart",
        "model_ok",
        "nfull",
        "state",
        "total",
        "workload",
    )

    def __init__(
        self, index: FleetIndex, state: FreeState, workload: Workload, in_service: np.ndarray | None = None
    ) -> None:
        self.index = index
        self.state = state
        self.workload = workload
        # The devices that may take work (None: the index's; less closed nodes' for a call).
        self.in_service = index.in_service if in_service is None else in_service
        n = len(index.nodes)
        node = index.dev_node
        f = np.where(self.in_service, state.free_milli, 0).astype(np.float64)
        self.total: np.ndarray = np.bincount(node, weights=f, minlength=n)
        self.nfull: np.ndarray = np.bincount(node, weights=(f >= MILLI).astype(np.float64), minlength=n)
        self.frag: np.ndarray = np.bincount(node, weights=np.where(f < MILLI, f, 0.0), minlength=n)
        self.max1: np.ndarray = np.zeros(n)
        self.max2: np.ndarray = np.zeros(n)
        self.maxpart: np.ndarray = np.zeros(n)
        some = index.node_size > 0
        if some.any():
            starts = index.node_start[:-1][some]
            self.max1[some] = np.maximum.reduceat(f, starts)
            # The second largest free share: the largest again if two devices have it, else the
            # largest below it.
            top = self.max1[node]
            twice = np.bincount(node, weights=(f == top).astype(np.float64), minlength=n) >= 2
            below = np.zeros(n)
            below[some] = np.maximum.reduceat(np.where(f < top, f, -np.inf), starts)
            self.max2 = np.where(index.node_size >= 2, np.where(twice, self.max1, below), 0.0)
            self.maxpart[some] = np.maximum(np.maximum.reduceat(np.where(f < MILLI, f, 0.0), starts), 0.0)
        self.frac_frag: np.ndarray = np.zeros((n, len(workload.frac_milli)))
        for j, m in enumerate(workload.frac_milli):
            self.frac_frag[:, j] = np.bincount(node, weights=np.where(f < m, f, 0.0), minlength=n)
        self.cum: np.ndarray = np.cumsum(self.frac_frag * workload.frac_p, axis=1)
        self.model_ok: np.ndarray | None = _model_ok(index, self.in_service, workload)
        self.expected: np.ndarray = self._expected(np.arange(n), self.total, self.nfull, self.max1, self.frag)

    def copy(self, state: FreeState) -> FragStats:
        """An independent copy bound to ``state`` (which must hold the same free capacity)."""
        clone = FragStats.__new__(FragStats)
        clone.index = self.index
        clone.workload = self.workload
        clone.in_service = self.in_service
        clone.model_ok = self.model_ok  # static per (inventory, workload): shared
        clone.state = state
        for name in ("total", "nfull", "frag", "max1", "max2", "maxpart", "frac_frag", "cum", "expected"):
            setattr(clone, name, getattr(self, name).copy())
        return clone

    def set_in_service(self, in_service: np.ndarray, state: FreeState, nodes: Iterable[int]) -> None:
        """Take ``in_service`` as the devices that may take work (it differs from the current
        mask only on ``nodes``, which are recomputed in ``state``)."""
        self.in_service = in_service
        self.model_ok = _model_ok(self.index, in_service, self.workload)
        self.refresh(state, nodes)

    def refresh(self, state: FreeState, nodes: Iterable[int]) -> None:
        """Recompute the aggregates of the given node positions after their usage changed (the
        values a node's own computation gives, whatever the other nodes refreshed with it)."""
        changed = sorted(set(nodes))
        if len(changed) > _LOOP_UPTO:
            self._refresh_many(state, np.array(changed, dtype=np.int64))
            return
        idx = self.index
        w = self.workload
        for n in changed:
            lo, hi = int(idx.node_start[n]), int(idx.node_start[n + 1])
            f = np.where(self.in_service[lo:hi], state.free_milli[lo:hi], 0).astype(np.float64)
            self.total[n] = f.sum()
            self.nfull[n] = float((f >= MILLI).sum())
            s = np.sort(f)
            self.max1[n] = s[-1] if len(s) else 0.0
            self.max2[n] = s[-2] if len(s) > 1 else 0.0
            part = f[f < MILLI]
            self.maxpart[n] = part.max() if len(part) else 0.0
            self.frag[n] = part.sum()
            if len(w.frac_milli):
                self.frac_frag[n] = np.where(f[None, :] < w.frac_milli[:, None], f[None, :], 0.0).sum(axis=1)
                self.cum[n] = np.cumsum(self.frac_frag[n] * w.frac_p)
            at = np.array([n])
            self.expected[n] = self._expected(
                at, self.total[at], self.nfull[at], self.max1[at], self.frag[at]
            )[0]

    def _refresh_many(self, state: FreeState, nodes: np.ndarray) -> None:
        """:meth:`refresh` of many nodes (ascending, distinct) in one pass: the sums are of whole
        milli values (exact in any order), the expectation elementwise, or node by node where
        the workload's form sums shapes with a matrix product (whose last bits depend on the
        batch)."""
        idx, w = self.index, self.workload
        sizes = idx.node_size[nodes]
        owner = np.repeat(np.arange(len(nodes)), sizes)
        devs = np.arange(len(owner)) + np.repeat(idx.node_start[nodes] - (np.cumsum(sizes) - sizes), sizes)
        f = np.where(self.in_service[devs], state.free_milli[devs], 0).astype(np.float64)
        k = len(nodes)
        self.total[nodes] = np.bincount(owner, weights=f, minlength=k)
        self.nfull[nodes] = np.bincount(owner, weights=(f >= MILLI).astype(np.float64), minlength=k)
        ends = np.cumsum(sizes)
        top = f[np.lexsort((f, owner))] if len(f) else np.zeros(1)
        self.max1[nodes] = np.where(sizes >= 1, top[np.maximum(ends - 1, 0)], 0.0)
        self.max2[nodes] = np.where(sizes >= 2, top[np.maximum(ends - 2, 0)], 0.0)
        part = f < MILLI
        maxpart = np.full(k, -np.inf)
        np.maximum.at(maxpart, owner[part], f[part])
        self.maxpart[nodes] = np.where(np.isneginf(maxpart), 0.0, maxpart)
        self.frag[nodes] = np.bincount(owner[part], weights=f[part], minlength=k)
        if len(w.frac_milli):
            for j, m in enumerate(w.frac_milli):
                self.frac_frag[nodes, j] = np.bincount(owner, weights=np.where(f < m, f, 0.0), minlength=k)
            self.cum[nodes] = np.cumsum(self.frac_frag[nodes] * w.frac_p, axis=1)
        if not w.host_aware:
            self.expected[nodes] = self._expected(
                nodes, self.total[nodes], self.nfull[nodes], self.max1[nodes], self.frag[nodes]
            )
            return
        for n in nodes:
            at = np.array([n])
            self.expected[n] = self._expected(
                at, self.total[at], self.nfull[at], self.max1[at], self.frag[at]
            )[0]

    def _expected(
        self,
        nodes: np.ndarray,
        total: np.ndarray,
        nfull: np.ndarray,
        max1: np.ndarray,
        frag: np.ndarray,
        f: np.ndarray | None = None,
        g: np.ndarray | None = None,
        cpu: float | np.ndarray = 0.0,
        mem: float | np.ndarray = 0.0,
    ) -> np.ndarray:
        """Expected fragmentation for the given node states (see the module docstring).

        For a hypothetical fractional placement, ``f``/``g`` are the device's free share before and
        after, and the per-threshold fragment sums are corrected on the fly.
        """
        w = self.workload
        if w.host_aware:
            return self._expected_host(nodes, total, nfull, max1, frag, f, g, cpu, mem)
        pw = w.p_whole_fits(nfull)
        out = pw * frag + (w.p_whole - pw) * total
        if len(w.frac_milli):
            j = np.searchsorted(w.frac_milli, max1, side="right") - 1
            fits = j >= 0
            pf = np.where(fits, w.frac_cdf[np.maximum(j, 0)], 0.0)
            covered = np.where(fits, self.cum[nodes, np.maximum(j, 0)], 0.0)
            if f is not None and g is not None:
                covered = covered - f * np.maximum(0.0, pf - w.p_frac_upto(f))
                covered = covered + g * np.maximum(0.0, pf - w.p_frac_upto(g))
            out = out + covered + (w.p_frac - pf) * total
        return out

    def _expected_host(
        self,
        nodes: np.ndarray,
        total: np.ndarray,
        nfull: np.ndarray,
        max1: np.ndarray,
        frag: np.ndarray,
        f: np.ndarray | None,
        g: np.ndarray | None,
        cpu: float | np.ndarray,
        mem: float | np.ndarray,
    ) -> np.ndarray:
        """General form, shape by shape (candidates × shapes), with host CPU/RAM conditions."""
        w = self.workload
        cpu_free = self.state.host_cpu[nodes] - cpu
        mem_free = self.state.host_mem[nodes] - mem
        whole = w.s_milli >= MILLI
        gpu_fit = np.where(
            whole[None, :], nfull[:, None] >= w.s_count[None, :], max1[:, None] >= w.s_milli[None, :]
        )
        host_fit = (cpu_free[:, None] >= w.s_cpu[None, :]) & (mem_free[:, None] >= w.s_mem[None, :])
        if len(w.frac_milli):
            rows = self.frac_frag[nodes]
            if f is not None and g is not None:
                thr = w.frac_milli[None, :]
                rows = (
                    rows
                    - np.where(f[:, None] < thr, f[:, None], 0.0)
                    + np.where(g[:, None] < thr, g[:, None], 0.0)
                )
            part = np.where(whole[None, :], frag[:, None], rows[:, np.maximum(w.s_col, 0)])
        else:
            part = np.repeat(frag[:, None], len(w.s_p), axis=1)
        ok = gpu_fit & host_fit & (w.s_count > 0)[None, :]
        if self.model_ok is not None:
            ok &= self.model_ok[nodes]
        return np.where(ok, part, total[:, None]) @ w.s_p

    def node_fragmentation(self, nodes: np.ndarray) -> np.ndarray:
        """Expected fragmentation (milli-GPU) of the given node positions now."""
        return self.expected[nodes]

    def delta_whole(
        self,
        nodes: np.ndarray,
        k: int | np.ndarray,
        cpu: float | np.ndarray = 0.0,
        mem: float | np.ndarray = 0.0,
    ) -> np.ndarray:
        """Fragmentation increase of taking ``k`` fully free devices (and ``cpu``/``mem`` of host
        CPU/RAM) on each of ``nodes`` (scalars, or one value per node entry)."""
        nfull = self.nfull[nodes] - k
        max1 = np.where(nfull > 0, float(MILLI), self.maxpart[nodes])
        after = self._expected(
            nodes, self.total[nodes] - k * MILLI, nfull, max1, self.frag[nodes], cpu=cpu, mem=mem
        )
        return after - self.expected[nodes]

    def delta_host(self, nodes: np.ndarray, cpu: float, mem: float) -> np.ndarray:
        """Fragmentation increase of taking only host CPU/RAM (a CPU-only task) on ``nodes``."""
        after = self._expected(
            nodes, self.total[nodes], self.nfull[nodes], self.max1[nodes], self.frag[nodes], cpu=cpu, mem=mem
        )
        return after - self.expected[nodes]

    def delta_fraction(
        self,
        devices: np.ndarray,
        milli: int | np.ndarray,
        free: np.ndarray,
        cpu: float | np.ndarray = 0.0,
        mem: float | np.ndarray = 0.0,
    ) -> np.ndarray:
        """Fragmentation increase of taking ``milli`` on each of ``devices`` (``free`` = their free
        milli; ``milli``, ``cpu``, ``mem`` scalars or one value per device entry)."""
        nodes = self.index.dev_node[devices]
        f = free.astype(np.float64)
        g = f - milli
        max1 = self.max1[nodes]
        others = np.where(f < max1, max1, self.max2[nodes])
        frag = self.frag[nodes] - np.where(f < MILLI, f, 0.0) + g
        after = self._expected(
            nodes,
            self.total[nodes] - milli,
            self.nfull[nodes] - (f >= MILLI),
            np.maximum(others, g),
            frag,
            f,
            g,
            cpu,
            mem,
        )
        return after - self.expected[nodes]


def _model_ok(index: FleetIndex, in_service: np.ndarray, workload: Workload) -> np.ndarray | None:
    """``[node, shape]``: the shape may run on some in-service device of the node (None = no
    shape names models, every shape may run everywhere). Static per inventory and shapes' models:
    kept on the index (read-only)."""
    if not any(workload.s_models):
        return None
    key = ("model_ok", workload.s_models)
    own = in_service is index.in_service  # else less some closed nodes': kept per mask object
    hit: np.ndarray | None = index.masks.get(key) if own else _MODEL_OK.get(in_service, workload.s_models)
    if hit is not None:
        return hit
    allowed = np.array(
        [[not m or name in m for m in workload.s_models] for name in index.model_names], dtype=bool
    ).reshape(len(index.model_names), len(workload.s_models))
    models = len(index.model_names)
    # In-service devices per (node, model), then per shape the nodes with one of its models.
    per_model = np.bincount(index.dev_node * models + index.dev_model, weights=in_service.astype(np.float64),
                            minlength=len(index.nodes) * models).reshape(len(index.nodes), models)
    out = (per_model > 0).astype(np.float64) @ allowed.astype(np.float64) > 0
    out.flags.writeable = False
    if own:
        index.masks[key] = out
    else:
        _MODEL_OK.put(out, in_service, workload.s_models)
    return out


_MODEL_OK = LruCache()
_STATS = LruCache()


def cached_stats(
    index: FleetIndex,
    usage: object,
    state: FreeState,
    workload: Workload,
    in_service: np.ndarray | None = None,
) -> FragStats:
    """Fragmentation aggregates for a snapshot's own usage, built once per (inventory, usage
    mapping, workload, in-service mask) and handed out as copies; ``state`` must be that usage,
    unmodified."""
    service = index.in_service if in_service is None else in_service
    hit: FragStats | None = _STATS.get(index, usage, workload, service)
    if hit is not None:
        return hit.copy(state)
    stats = FragStats(index, state, workload, service)
    _STATS.put(stats.copy(state), index, usage, workload, service)
    return stats
