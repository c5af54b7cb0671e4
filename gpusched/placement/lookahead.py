"""A one-step look-ahead that breaks the ties of FGD's integer node score.

FGD scores a placement by how much it raises the node's expected fragmentation over the
workload's request shapes, as an integer score, and many candidates tie (every empty node of a
model, for one); FGD takes the earliest. With ``Policy.lookahead_ties = K`` the first ``K`` tied
candidates (one per node) are compared by what they leave the *next* request — a shape drawn
from the same distribution and placed by the same rule:

    LA(c) = Σ_s w_s · [ h_s(min(B_s, D'_n(s))) − h_s(min(B_s, D_n(s))) ]

``D_n(s)`` is the fragmentation increase of shape ``s``'s placement on the candidate's node ``n``
now (the node's first device of its best integer score, as the rule picks), ``D'_n(s)`` the same
once the candidate is taken, ``B_s`` the best over every *other* node, and ``h_s(x) = x``, or the
shape's GPU demand when the shape fits nowhere (``x = ∞``): a request that can no longer be placed
loses all its GPUs. The lowest ``LA`` wins, ties to the earliest; the integer score itself is
never overridden. Only the candidate's node changes, so one row per candidate is computed, and
:class:`ShapeDeltas` keeps ``D`` for every node between decisions, recomputing only the nodes
whose state stamp changed. Uses the knowledge FGD itself uses (the workload's shapes), no future
requests. A new engine's first fill computes one row per distinct node state (the empty nodes of
a model, and every other repeated state, share it); the candidates' rows once taken are computed
in one pass.

Scarce models first: when some shapes are pinned to models, a tied candidate on a model whose
share of the pinned GPU demand is at least its share of the free GPU capacity is dropped while
candidates on other models tie with it. One step ahead, taking a scarce node looks harmless (its
siblings stand in); a few steps later the requests pinned to that model find none left.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import cast

import numpy as np

from gpusched.model import MILLI
from gpusched.placement.index import FleetIndex, FreeState
from gpusched.placement.score import FragStats
from gpusched.placement.ties import integer_score, levels_best, near_top
from gpusched.placement.types import PendingTask
from gpusched.placement.workload import Workload

__all__ = ["ShapeDeltas", "level_choice", "lookahead_best"]

_NEAR = 1e-9  # look-ahead values closer than this are equal: the earlier candidate stays
_MAX_ROWS = 100_000  # rows kept by node state before the cache starts over
_BATCH_FROM = 32  # changed nodes from which one vectorised pass beats row-by-row recomputation
_DISTINCT_FROM = 256  # nodes in one pass from which equal node states are computed once
_MAX_SPAN = 1 << 16  # free milli values spanning more than this: no sharing of equal states
_BITS = 62  # an exact per-node key must stay below 2**_BITS
_ALL: dict[int, np.ndarray] = {}  # arange(n) (read-only) for a pass over all n devices


class ShapeDeltas:
    """``D[n, s]``: the fragmentation increase of shape ``s``'s placement on node ``n`` (``inf``
    where it does not fit, and for CPU-only shapes, which hold no GPUs), kept per node stamp."""

    def __init__(
        self, index: FleetIndex, workload: Workload, levels: int, weight: float, ties: int,
        widen: int = 0,
    ) -> None:
        self.index = index
        self.workload = workload
        self.levels = levels
        self.ties = ties  # how many tied candidates are compared
        self.widen = widen  # levels below the top a node alone at the top is compared with
        self.weight = weight  # the policy's fragmentation weight: the score is weight × Δ / MILLI
        shapes = len(workload.s_p)
        self.gpu = workload.s_count > 0
        self.whole = self.gpu & (workload.s_milli >= MILLI)
        self.fraction = self.gpu & (workload.s_milli < MILLI)
        self.demand = np.where(self.gpu, workload.s_count * workload.s_milli, 0.0)
        # Column by column in memory: a decision reads each shape's best node (argmin per column).
        self.deltas = np.full((len(index.nodes), shapes), np.inf, order="F")
        self.stamp = np.full(len(index.nodes), -1, dtype=np.int64)
        # Rows by node state (free milli per device, host CPU/RAM, models allowed): equal nodes,
        # the empty ones above all, share one computation.
        self._rows: dict[tuple[bytes, float, float, bytes], np.ndarray] = {}
        self.pinned = _pinned_share(index, workload, self.demand)

    def scarce_models(self, stats: FragStats, state: FreeState) -> np.ndarray:
        """Per model (``index.model_names``): whether the demand pinned to it is scarce, that is
        its share of the expected GPU demand is at least its share of the free GPU capacity (a
        pinned shape's demand is split evenly over the fleet's models it allows). All False
        when no shape names models."""
        if not self.pinned.any():
            return np.zeros(len(self.pinned), dtype=bool)
        free = np.where(stats.in_service, state.free_milli, 0).astype(np.float64)
        by_model = np.bincount(self.index.dev_model, weights=free, minlength=len(self.pinned))
        return self.pinned * by_model.sum() >= by_model * float(self.demand @ self.workload.s_p)

    def current(self, stats: FragStats, state: FreeState) -> np.ndarray:
        """``D`` for ``state`` (``stats`` must describe it); recomputes the changed nodes only —
        one row at a time (through the cache by node state) when few changed, in one
        vectorised pass (:meth:`rows_of`) when many did, as on an engine's first decision."""
        stale = np.flatnonzero(self.stamp != state.node_stamp)
        if len(stale) > _BATCH_FROM:
            self.deltas[stale] = self.rows_of(stats, state, stale)
        else:
            for n in stale:
                self.deltas[n] = self.row(stats, state, int(n))
        self.stamp[stale] = state.node_stamp[stale]
        return self.deltas

    def rows_of(self, stats: FragStats, state: FreeState, nodes: np.ndarray) -> np.ndarray:
        """``D[nodes, :]`` in one pass (:meth:`row` is this for one node, kept by node state). A
        node's row does not depend on the other nodes asked with it, but the scorer's matrix
        product may add in another order for another batch shape, so rows of one pass equal
        the rows one at a time to the last bits of a sum; every decision compares to 1e-9.
        ``nodes`` are distinct; in a large batch, nodes of equal state (:meth:`_distinct`) share
        one computation."""
        if len(nodes) >= _DISTINCT_FROM:
            first, inverse = self._distinct(stats, state, nodes)
            if len(first) < len(nodes):
                return self._rows_of(stats, state, nodes[first])[inverse]
        return self._rows_of(stats, state, nodes)

    def _distinct(
        self, stats: FragStats, state: FreeState, nodes: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(first, inverse)``: positions in ``nodes`` of one node per distinct state (ascending),
        and for each node the entry of ``first`` with its state. A node's row depends on its
        device count, the multiset of its devices' free milli (in service), its distinct positive
        free values in device order (the first option of a level wins), its host CPU/RAM and
        which shapes' models it has: nodes equal in all of these have equal rows. Each is
        encoded exactly as an integer per node; where one would not fit in 62 bits, every node
        stands for itself (no sharing)."""
        everything = np.arange(len(nodes))
        owner, devices, sizes, offsets = _node_devices(self.index, nodes)
        free = _free_of(stats, state, devices)
        if not len(free):
            return everything, everything
        low = int(free.min())
        span = int(free.max()) - low + 1
        width = int(sizes.max())
        if span > _MAX_SPAN:
            return everything, everything
        shifted = free - low
        present = np.bincount(shifted, minlength=span) > 0
        values = int(present.sum())
        # The multiset as the counts of each value (digits in base width + 1), else as the node's
        # sorted values (digits in base ``values``); the distinct positive values in device order
        # as digits in base values + 1 (a value's digit is its code + 1, placed by its rank).
        if values * math.log2(width + 1) < _BITS:
            digits, base = "counts", (width + 1) ** values
        elif width * math.log2(values) < _BITS:
            digits, base = "sorted", values**width
        else:
            return everything, everything
        ranks = min(width, values)
        if ranks * math.log2(values + 1) >= _BITS:
            return everything, everything
        code = (np.cumsum(present) - 1)[shifted]
        if digits == "counts":
            multiset = _node_sums(((width + 1) ** np.arange(values, dtype=np.int64))[code], offsets, sizes)
        else:
            position = np.arange(len(code)) - np.repeat(offsets, sizes)
            multiset = _node_sums((np.sort(owner * values + code) - owner * values) * (
                values ** np.arange(width, dtype=np.int64)
            )[position], offsets, sizes)
        # Each node's first device of each value (in device order), the positive ones ranked.
        pair = owner * values + code
        first_of = np.full(len(nodes) * values, len(pair))
        np.minimum.at(first_of, pair, np.arange(len(pair)))
        new = np.flatnonzero(first_of[pair] == np.arange(len(pair)))
        new = new[free[new] > 0]
        holder = owner[new]
        rank = np.arange(len(new)) - np.searchsorted(holder, holder)
        order = np.zeros(len(nodes), dtype=np.int64)
        np.add.at(order, holder, ((values + 1) ** np.arange(ranks, dtype=np.int64))[rank] * (code[new] + 1))
        limit = (values + 1) ** ranks
        if base * limit < 2**_BITS:  # both in one column
            columns = [(multiset * limit + order, base * limit)]
        else:
            columns = [(multiset, base), (order, limit)]
        columns += [(sizes, width + 1), (state.host_cpu[nodes], 0), (state.host_mem[nodes], 0)]
        if stats.model_ok is not None:
            if stats.model_ok.shape[1] >= _BITS:
                return everything, everything
            bits = 1 << np.arange(stats.model_ok.shape[1], dtype=np.int64)
            columns.append((stats.model_ok[nodes] @ bits, 0))
        # One integer per node from the columns that vary, each a digit below its bound (0: the
        # column's distinct values numbered first); renumbered when the next would overflow.
        key, bound = np.zeros(len(nodes), dtype=np.int64), 1
        for column, limit in columns:
            if column.min() == column.max():
                continue
            if not limit:
                distinct, column = np.unique(column, return_inverse=True)
                limit = len(distinct)
            if bound * limit >= 2**_BITS:
                distinct, key = np.unique(key, return_inverse=True)
                bound = len(distinct)
            if bound * limit >= 2**_BITS:
                distinct, column = np.unique(column, return_inverse=True)
                limit = len(distinct)
            key, bound = key * limit + column.reshape(-1), bound * limit
        _, first, group = np.unique(key, return_index=True, return_inverse=True)
        ascending = np.argsort(first)
        place = np.empty_like(ascending)
        place[ascending] = np.arange(len(ascending))
        return first[ascending], place[group.reshape(-1)]

    def _rows_of(self, stats: FragStats, state: FreeState, nodes: np.ndarray) -> np.ndarray:
        w, idx = self.workload, self.index
        out = np.full((len(nodes), len(w.s_p)), np.inf)
        ok = self.gpu[None, :] & (state.host_cpu[nodes][:, None] >= w.s_cpu[None, :])
        ok &= state.host_mem[nodes][:, None] >= w.s_mem[None, :]
        if stats.model_ok is not None:
            ok &= stats.model_ok[nodes]
        # Whole shapes: one entry per (node, shape) that fits the node's fully free devices.
        room = w.s_count[None, :] <= stats.nfull[nodes][:, None]
        row, shape = np.nonzero(ok & self.whole[None, :] & room)
        if len(row):
            delta = stats.delta_whole(nodes[row], w.s_count[shape], w.s_cpu[shape], w.s_mem[shape])
            out[row, shape] = delta
        # Fractions: a node's options are its distinct positive free values, each on its first
        # device; per (node, shape) the first option (device order) of the best integer level.
        owner, devices, _, _ = _node_devices(idx, nodes)
        milli = _free_of(stats, state, devices)
        keep = milli > 0
        devices, owner, milli = devices[keep], owner[keep], milli[keep]
        if not len(devices):
            return out
        # First device of each (node, free value), in (node, free value) order.
        _, first = np.unique(owner * (int(milli.max()) + 1) + milli, return_index=True)
        devices, owner, free = devices[first], owner[first], milli[first].astype(np.float64)
        fits = ok[owner] & self.fraction[None, :] & (free[:, None] >= w.s_milli[None, :])
        option, shape = np.nonzero(fits)
        if len(option):
            delta = stats.delta_fraction(devices[option], w.s_milli[shape], free[option], w.s_cpu[shape],
                                         w.s_mem[shape])
            level = integer_score(self.weight * delta / MILLI, self.levels).astype(np.int64)
            # Per (node, shape) the least of (levels below the top, device): a unique key each.
            pair = owner[option] * len(w.s_p) + shape
            rank = (self.levels - level) * idx.n_devices + devices[option]
            least = np.full(len(nodes) * len(w.s_p), np.iinfo(np.int64).max)
            np.minimum.at(least, pair, rank)
            head = rank == least[pair]
            out[owner[option][head], shape[head]] = delta[head]
        return out

    def row(self, stats: FragStats, state: FreeState, n: int) -> np.ndarray:
        """``D[n, :]`` computed from ``stats``/``state`` as they are now (a read-only array)."""
        free = self._free(stats, state, n)
        key = self._key(stats, n, free, float(state.host_cpu[n]), float(state.host_mem[n]))
        hit = self._rows.get(key)
        if hit is None:
            if len(self._rows) >= _MAX_ROWS:
                self._rows.clear()
            hit = self._rows[key] = self.rows_of(stats, state, np.array([n]))[0]
            hit.setflags(write=False)
        return hit

    def _free(self, stats: FragStats, state: FreeState, n: int) -> np.ndarray:
        lo, hi = int(self.index.node_start[n]), int(self.index.node_start[n + 1])
        return np.where(stats.in_service[lo:hi], state.free_milli[lo:hi], 0).astype(np.float64)

    @staticmethod
    def _key(
        stats: FragStats, n: int, free: np.ndarray, cpu: float, mem: float
    ) -> tuple[bytes, float, float, bytes]:
        return free.tobytes(), cpu, mem, b"" if stats.model_ok is None else stats.model_ok[n].tobytes()

    def pick(
        self,
        stats: FragStats,
        state: FreeState,
        options: Sequence[tuple[Sequence[int], int]],
        cpu_milli: int,
        host_memory_bytes: int,
    ) -> int:
        """Index of the option with the lowest look-ahead value (the first on ties).

        ``options`` are tied candidates on distinct nodes, each the device positions it would take
        and the milli-GPU per device; ``cpu_milli``/``host_memory_bytes`` are the task's host needs.
        The state and statistics are changed for each evaluation and restored exactly."""
        deltas = self.current(stats, state)
        columns = np.arange(deltas.shape[1])
        first = deltas.argmin(axis=0)
        best = deltas[first, columns]
        # The runner-up only matters for the shapes whose best node is one of the candidates:
        # the column's second smallest value (its best once the best node's entry is left out).
        nodes = [int(self.index.dev_node[devices[0]]) for devices, _ in options]
        second = best.copy()
        mine = np.flatnonzero((first[:, None] == np.array(nodes)[None, :]).any(axis=1))
        if len(mine):
            second[mine] = (
                np.partition(deltas[:, mine], 1, axis=0)[1] if len(deltas) > 1 else np.inf
            )
        gpu = self.gpu
        p = self.workload.s_p[gpu]
        afters = np.array(self._rows_after(stats, state, options, nodes, cpu_milli, host_memory_bytes))
        # Per option (a row each), the other nodes' best for every shape and the change its
        # placement makes to the next request's cost; each row's sum is one dot product as before.
        at = np.array(nodes)
        others = np.where(first[None, :] == at[:, None], second[None, :], best[None, :])
        change = (self._cost(np.minimum(others, afters)) - self._cost(np.minimum(others, deltas[at])))[:, gpu]
        chosen, chosen_value = 0, np.inf
        for i in range(len(options)):
            value = float(change[i] @ p)
            if value < chosen_value - _NEAR:
                chosen, chosen_value = i, value
        return chosen

    def _rows_after(
        self, stats: FragStats, state: FreeState, options: Sequence[tuple[Sequence[int], int]],
        nodes: list[int], cpu: int, mem: int,
    ) -> list[np.ndarray]:
        """``D[n, :]`` of each option's node ``n`` once the option is taken (``cpu``/``mem`` of host
        CPU/RAM with it), through the cache by node state; the options not cached are taken all
        at once (their nodes are distinct), computed in one pass (:meth:`rows_of`) and given back."""
        rows: list[np.ndarray | None] = []
        for (devices, milli), n in zip(options, nodes, strict=True):
            free = self._free(stats, state, n)
            free[np.asarray(devices) - int(self.index.node_start[n])] -= milli
            key = self._key(stats, n, free, float(state.host_cpu[n] - cpu), float(state.host_mem[n] - mem))
            rows.append(self._rows.get(key))
        missing = [i for i, row in enumerate(rows) if row is None]
        if not missing:
            return cast("list[np.ndarray]", rows)
        taken = [(list(options[i][0]), options[i][1], nodes[i]) for i in missing]
        saved = [state.free_milli[devices].copy() for devices, _, _ in taken]
        for devices, take, n in taken:
            state.free_milli[devices] -= take
            state.host_cpu[n] -= cpu
            state.host_mem[n] -= mem
        changed = [n for _, _, n in taken]
        stats.refresh(state, changed)
        try:
            computed = self.rows_of(stats, state, np.array(changed))
            for i, n, row in zip(missing, changed, computed, strict=True):
                key = self._key(stats, n, self._free(stats, state, n), float(state.host_cpu[n]),
                                float(state.host_mem[n]))
                if len(self._rows) >= _MAX_ROWS:
                    self._rows.clear()
                row.setflags(write=False)
                rows[i] = self._rows[key] = row
        finally:
            for (devices, _, n), before in zip(taken, saved, strict=True):
                state.free_milli[devices] = before
                state.host_cpu[n] += cpu
                state.host_mem[n] += mem
            stats.refresh(state, changed)
        return cast("list[np.ndarray]", rows)

    def _cost(self, x: np.ndarray) -> np.ndarray:
        return np.where(np.isfinite(x), x, self.demand)


def lookahead_best(
    ahead: ShapeDeltas,
    stats: FragStats,
    state: FreeState,
    task: PendingTask,
    score: np.ndarray,
    node_of: np.ndarray,
    take: Callable[[int], list[int]],
    milli: int,
    others: np.ndarray | None = None,
    may_widen: bool = True,
) -> int:
    """The candidate (position in ``score``) the look-ahead prefers among those tied at the top
    integer score, one per node (``node_of``: each candidate's node; ``take(i)``: the devices
    candidate ``i`` takes, ``milli`` on each).

    With ``ahead.widen = w > 0``, a node alone at the top level is compared with the nodes of the
    ``w`` levels below too (best level first, then inventory order) whose score differs from its
    own only in the fragmentation term (``others``: each candidate's score less that term, equal
    to 1e-9; None = all), unless the caller says this request may not (``may_widen``
    False). Candidates on scarce models
    (:meth:`ShapeDeltas.scarce_models`) are dropped unless all are scarce; the first
    ``lookahead_ties`` of the rest are compared, and a single one is taken as it is."""
    widen = ahead.widen if may_widen else 0
    positions, q = near_top(score, ahead.levels, widen)  # the candidates of the levels looked at
    top = _first_per_node(positions[q == q.max()], node_of)
    if len(top) == 1 and widen:
        # One node alone at the top: FGD's measure prefers it by a level or two, a difference
        # the next request's placement may undo; compare it with those levels' nodes too.
        kept = q >= q.max() - widen
        near, q_near = positions[kept], q[kept]
        if others is not None:  # locality, speed and energy are never traded for fragmentation
            same = np.abs(others[near] - others[top[0]]) <= _NEAR
            near, q_near = near[same], q_near[same]
        top = _first_per_node(near[np.argsort(-q_near, kind="stable")], node_of)
    scarce_models = ahead.scarce_models(stats, state)
    if len(top) > 1 and scarce_models.any():
        # Candidates on a model whose free capacity the pinned demand needs are dropped while
        # others tie: a one-step look-ahead cannot see that the scarce model's other nodes run out
        # a few steps later, when the requests pinned to it arrive.
        idx = ahead.index
        scarce = scarce_models[idx.dev_model[idx.node_start[node_of[top]]]]
        if not scarce.all():
            top = top[~scarce]
    top = top[: ahead.ties]
    if len(top) < 2:
        return int(top[0])
    options = [(take(int(i)), milli) for i in top]
    return int(top[ahead.pick(stats, state, options, task.cpu_milli, task.host_memory_bytes)])


def _node_devices(
    index: FleetIndex, nodes: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(owner, devices, sizes, offsets)``: the device positions of ``nodes``, node after node,
    each one's entry in ``nodes``; per node its device count and its first entry in ``devices``."""
    if len(nodes) == len(index.nodes) and (nodes == np.arange(len(nodes))).all():
        devices = _ALL.get(index.n_devices)
        if devices is None:
            devices = _ALL[index.n_devices] = np.arange(index.n_devices)
            devices.flags.writeable = False
        return index.dev_node, devices, index.node_size, index.node_start[:-1]
    sizes = index.node_size[nodes]
    offsets = np.cumsum(sizes) - sizes
    owner = np.repeat(np.arange(len(nodes)), sizes)
    return owner, np.arange(len(owner)) + np.repeat(index.node_start[nodes] - offsets, sizes), sizes, offsets


def _free_of(stats: FragStats, state: FreeState, devices: np.ndarray) -> np.ndarray:
    """Free milli of ``devices`` (from :func:`_node_devices`), 0 for those out of service."""
    if len(devices) == len(state.free_milli) and devices is _ALL.get(len(devices)):
        return np.where(stats.in_service, state.free_milli, 0)
    return np.where(stats.in_service[devices], state.free_milli[devices], 0)


def _node_sums(values: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Per node, the exact (integer) sum of its entries of ``values`` (node after node: ``sizes``
    entries from ``offsets``); 0 for a node without any."""
    out = np.zeros(len(sizes), dtype=np.int64)
    some = sizes > 0
    if some.any():
        out[some] = np.add.reduceat(values.astype(np.int64, copy=False), offsets[some])
    return out


def _first_per_node(candidates: np.ndarray, node_of: np.ndarray) -> np.ndarray:
    """``candidates`` (positions) keeping only the first of each node, in their order."""
    _, first = np.unique(node_of[candidates], return_index=True)
    return candidates[np.sort(first)]


def level_choice(
    ahead: ShapeDeltas | None,
    stats: FragStats | None,
    state: FreeState,
    task: PendingTask,
    score: np.ndarray,
    node_of: np.ndarray,
    take: Callable[[int], list[int]],
    milli: int,
    *,
    levels: int,
    packing: bool,
    others: np.ndarray | None = None,
    may_widen: bool = True,
) -> int:
    """Position of the candidate an integer score of ``levels`` picks among the top level: with
    ``packing`` the one on the node (``node_of``) with the least free capacity, with ``ahead`` the
    look-ahead's (:func:`lookahead_best`), else the first. Without ``stats`` (a decision that
    reads no fragmentation statistics) neither tie-break applies."""
    if stats is not None and packing:
        return levels_best(score, levels, stats.total[node_of])
    if stats is not None and ahead is not None:
        return lookahead_best(ahead, stats, state, task, score, node_of, take, milli, others, may_widen)
    return levels_best(score, levels)


def _pinned_share(index: FleetIndex, workload: Workload, demand: np.ndarray) -> np.ndarray:
    """Per model of the fleet: the expected GPU demand (milli per request) of the shapes pinned to
    models, each split evenly over the fleet's models it allows."""
    out = np.zeros(len(index.model_names))
    for s, models in enumerate(workload.s_models):
        allowed = [m for m, name in enumerate(index.model_names) if name in models]
        if models and allowed and demand[s]:
            out[allowed] += workload.s_p[s] * demand[s] / len(allowed)
    return out
