"""Per-node aggregates a resident :class:`~gpusched.placement.Placer` keeps between decisions.

A decision that recomputes its feasibility mask, topology counts and candidate scores over every
device costs O(devices) numpy work, which is what dominates at 10,000 nodes. These caches keep
those per-node results and recompute only the nodes whose free capacity changed since, found by
the change stamps :meth:`FreeState.apply` writes (:attr:`FreeState.node_stamp`, one fresh number
per change, so a copy of a state never shares a stamp with the original once either changed).

Everything cached is a function of one node's own state, computed with the same elementwise
numpy operations as the full path (:mod:`gpusched.placement.choose`), so the decision taken from
the cache is bit-for-bit the one the full path takes (``tests/unit/test_placement_incremental.py``
compares them on seeded synthetic fleets and request streams).

- :class:`WholeCounts`: per eligibility, the fully free eligible devices per node and the largest
  such group per island / NUMA node / PCIe switch (what :func:`~gpusched.placement.topology.node_counts`
  computes from the full mask).
- :class:`WholeFits`: a whole-device task's fitting devices, one node's slice on demand and the
  full masks only when needed (a degraded device to weigh, a rejection to word).
- :class:`WholeScores`: per whole-device request signature (devices, host CPU, host RAM), each
  node's fragmentation increase (the ``score`` chooser's whole-device path).
- :class:`FractionScores`: per fractional request signature, each candidate device's
  fragmentation term (the ``score`` chooser's fractional path), ``+inf`` for devices that cannot
  take the fraction; the per-model speed and energy terms are added at decision time because
  they are normalised over the models that have a candidate.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from gpusched.model import MILLI
from gpusched.placement.filter import Eligibility
from gpusched.placement.index import FleetIndex, FreeState
from gpusched.placement.topology import NodeCounts, node_counts
from gpusched.placement.types import PendingTask

__all__ = [
    "FractionScores", "Incremental", "WholeCounts", "WholeFits", "WholeScores", "node_device_positions",
    "whole_fits",
]

_MAX_ENTRIES = 32  # per kind; a fractional entry holds two arrays over the fleet's devices
# Past this share of dirty nodes a full recomputation is cheaper than the per-node one.
_FULL_REFRESH_SHARE = 0.25


def node_device_positions(index: FleetIndex, nodes: np.ndarray) -> np.ndarray:
    """Device positions of ``nodes`` (ascending node positions), in index order."""
    starts = index.node_start[nodes]
    sizes = index.node_size[nodes]
    total = int(sizes.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.repeat(starts - np.concatenate(([0], np.cumsum(sizes)[:-1])), sizes)
    return np.arange(total, dtype=np.int64) + offsets


def whole_fits(
    index: FleetIndex, elig: Eligibility, state: FreeState, devs: np.ndarray | None = None
) -> np.ndarray:
    """Eligible devices that are entirely free (all of them, or those at positions ``devs``)."""
    if devs is None:
        return elig.usable & (state.free_milli >= MILLI) & (state.free_mem >= index.dev_mem)
    free = (state.free_milli[devs] >= MILLI) & (state.free_mem[devs] >= index.dev_mem[devs])
    return elig.usable[devs] & free


class WholeFits:
    """The devices a whole-device task may take now: the full masks (``fits``, and ``fits_now``
    before reservations) built on first use, one node's devices without them."""

    __slots__ = ("_elig", "_full", "_idx", "_state", "_task", "degraded")

    def __init__(
        self, idx: FleetIndex, elig: Eligibility, state: FreeState, task: PendingTask, degraded: bool
    ) -> None:
        self._idx, self._elig, self._state, self._task = idx, elig, state, task
        self._full: tuple[np.ndarray, np.ndarray] | None = None
        self.degraded = degraded  # whether some eligible device is DEGRADED

    @classmethod
    def of(cls, idx: FleetIndex, fits: np.ndarray, fits_now: np.ndarray) -> WholeFits:
        """Masks already computed."""
        made = cls.__new__(cls)
        made._idx = idx
        made._full = (fits, fits_now)
        made.degraded = True
        return made

    def full(self) -> tuple[np.ndarray, np.ndarray]:
        """(fits, fits_now) over all devices (equal: built only when no reservation is held)."""
        if self._full is None:
            st, task = self._state, self._task
            fits = whole_fits(self._idx, self._elig, st)
            if task.cpu_milli or task.host_memory_bytes:
                host_ok = (st.host_cpu >= task.cpu_milli) & (st.host_mem >= task.host_memory_bytes)
                fits = fits & host_ok[self._idx.dev_node]
            self._full = (fits, fits)
        return self._full

    def in_node(self, n: int) -> list[int]:
        """Fitting device positions of node position ``n``, ascending."""
        if self._full is not None:
            lo, hi = int(self._idx.node_start[n]), int(self._idx.node_start[n + 1])
            return (np.flatnonzero(self._full[0][lo:hi]) + lo).tolist()
        st, task = self._state, self._task
        if st.host_cpu[n] < task.cpu_milli or st.host_mem[n] < task.host_memory_bytes:
            return []
        devs = np.arange(int(self._idx.node_start[n]), int(self._idx.node_start[n + 1]))
        return devs[whole_fits(self._idx, self._elig, st, devs)].tolist()


class _Entry:
    """Common part: the state stamps the cached rows were computed at."""

    def __init__(self, index: FleetIndex) -> None:
        self.index = index
        self.stamp = np.full(len(index.nodes), -1, dtype=np.int64)  # -1: never computed

    def dirty(self, state: FreeState) -> np.ndarray:
        """Positions of nodes whose state changed since they were cached."""
        return np.flatnonzero(self.stamp != state.node_stamp)


class WholeCounts(_Entry):
    """Fully free eligible devices per node and per topology group, for one eligibility."""

    def __init__(self, index: FleetIndex, elig: Eligibility) -> None:
        super().__init__(index)
        self.elig = elig
        n = len(index.nodes)
        self.count = np.zeros(n, dtype=np.int64)
        self.island = np.zeros(n, dtype=np.int64)
        self.numa = np.zeros(n, dtype=np.int64)
        self.switch = np.zeros(n, dtype=np.int64)

    def counts(self, state: FreeState) -> NodeCounts:
        """The per-node counts (as :func:`node_counts` gives for ``k > 1``) in ``state``."""
        dirty = self.dirty(state)
        if len(dirty) > _FULL_REFRESH_SHARE * len(self.stamp):
            full = node_counts(self.index, whole_fits(self.index, self.elig, state), 2)
            self.count[:], self.island[:], self.numa[:], self.switch[:] = (
                full.count, full.island, full.numa, full.switch
            )
        elif len(dirty):
            self._refresh(state, dirty)
        self.stamp[dirty] = state.node_stamp[dirty]
        return NodeCounts(self.count, self.island, self.numa, self.switch)

    def _refresh(self, state: FreeState, nodes: np.ndarray) -> None:
        idx = self.index
        devs = node_device_positions(idx, nodes)
        fits = whole_fits(idx, self.elig, state, devs).astype(np.int64)
        self.count[nodes] = 0
        if len(devs):
            np.add.at(self.count, idx.dev_node[devs], fits)
        for out, groups, owner in (
            (self.island, idx.dev_island, idx.island_node),
            (self.numa, idx.dev_numa, idx.numa_node),
            (self.switch, idx.dev_switch, idx.switch_node),
        ):
            out[nodes] = 0
            g = groups[devs]
            keep = g >= 0
            if not keep.any():
                continue
            ids, inverse = np.unique(g[keep], return_inverse=True)
            per_group = np.bincount(inverse, weights=fits[keep], minlength=len(ids)).astype(np.int64)
            np.maximum.at(out, owner[ids], per_group)


class FractionScores(_Entry):
    """Fragmentation term of taking one fraction (``milli``, with the task's host CPU/RAM) on
    each device, whatever the request's eligibility and memory (applied at decision time).

    ``term[d]`` is ``0 + fragmentation × delta / 1000`` for devices with at least ``milli``
    free, ``+inf`` for the others. The increase depends only on the device's node and its free
    share, so the fully free devices of a node share the value computed for the first of them.
    """

    def __init__(self, index: FleetIndex, milli: int) -> None:
        super().__init__(index)
        self.milli = milli
        self.term = np.full(index.n_devices, np.inf)

    def refresh(self, state: FreeState, term_of: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> None:
        """Bring the terms up to date with ``state``; ``term_of(devices, their free milli)`` gives
        the terms of devices in ``state``."""
        dirty = self.dirty(state)
        if len(dirty) > _FULL_REFRESH_SHARE * len(self.stamp):
            self._compute(state, None, term_of)
        elif len(dirty):
            self._compute(state, node_device_positions(self.index, dirty), term_of)
        self.stamp[dirty] = state.node_stamp[dirty]

    def _compute(
        self,
        state: FreeState,
        devs: np.ndarray | None,
        term_of: Callable[[np.ndarray, np.ndarray], np.ndarray],
    ) -> None:
        """Recompute the terms of ``devs`` (whole nodes' devices; None = all)."""
        node = self.index.dev_node
        if devs is None:
            free = state.free_milli
            self.term[:] = np.inf
            part = np.flatnonzero((free >= self.milli) & (free < MILLI))
            full = np.flatnonzero(free >= MILLI)
        else:
            free = state.free_milli[devs]
            self.term[devs] = np.inf
            part = devs[(free >= self.milli) & (free < MILLI)]
            full = devs[free >= MILLI]
        is_first = np.ones(len(full), dtype=bool)
        is_first[1:] = node[full[1:]] != node[full[:-1]]
        cand = np.concatenate((part, full[is_first]))
        term = term_of(cand, state.free_milli[cand])
        self.term[part] = term[: len(part)]
        self.term[full] = term[len(part) :][np.cumsum(is_first) - 1]


class WholeScores(_Entry):
    """Fragmentation increase of taking ``k`` fully free devices (and the task's host CPU/RAM) on
    each node, for one (k, host CPU, host RAM): :meth:`FragStats.delta_whole
    <gpusched.placement.score.FragStats.delta_whole>` per node, whose elementwise operations give
    a node the same value whatever other nodes are computed with it (kept only for workloads
    without the shape-by-shape form, which sums with a matrix product)."""

    def __init__(self, index: FleetIndex) -> None:
        super().__init__(index)
        self.delta = np.zeros(len(index.nodes))

    def refresh(self, state: FreeState, delta_of: Callable[[np.ndarray], np.ndarray]) -> None:
        """Bring the values up to date with ``state``; ``delta_of(nodes)`` gives them in ``state``."""
        dirty = self.dirty(state)
        if len(dirty) > _FULL_REFRESH_SHARE * len(self.stamp):
            self.delta[:] = delta_of(np.arange(len(self.stamp)))
        elif len(dirty):
            self.delta[dirty] = delta_of(dirty)
        self.stamp[dirty] = state.node_stamp[dirty]


def _facts(index: FleetIndex) -> tuple[bool, np.ndarray, list[np.ndarray]]:
    """Static facts of an inventory the caches need (cached on the index): whether any device is
    DEGRADED; the devices of nodes whose fully free devices may score differently (several
    models, or a DEGRADED device: there only the first fully free fitting device is a
    candidate, as on the full path); one mask per model."""
    n_nodes = len(index.nodes)
    first_model = index.dev_model[index.node_start[index.dev_node]]
    other = np.bincount(index.dev_node, weights=index.dev_model != first_model, minlength=n_nodes)
    degraded = np.bincount(index.dev_node, weights=index.dev_health == 1, minlength=n_nodes)
    mixed = (other > 0) | (degraded > 0)
    models = [index.dev_model == m for m in range(len(index.model_names))]
    return bool((index.dev_health == 1).any()), np.flatnonzero(mixed[index.dev_node]), models


class Incremental:
    """The caches of one resident engine (bounded: least recently used entries go first).

    ``fill_on_first_use`` False leaves a fractional signature on the full path until it is
    asked for a second time (a one-call engine, :func:`~gpusched.placement.place`, would pay
    for filling a cache it never reuses).
    """

    def __init__(self, index: FleetIndex, *, fill_on_first_use: bool = True) -> None:
        self.index = index
        self.fill_on_first_use = fill_on_first_use
        self._whole: OrderedDict[Any, Any] = OrderedDict()
        self._fraction: OrderedDict[Any, Any] = OrderedDict()
        self._whole_scores: OrderedDict[Any, Any] = OrderedDict()
        self._degraded: dict[int, tuple[Eligibility, bool]] = {}
        self._seen: set[Any] = set()
        facts: tuple[bool, np.ndarray, list[np.ndarray]] | None = index.masks.get("incremental")
        if facts is None:
            facts = _facts(index)
            index.masks["incremental"] = facts
        self.any_degraded, self.mixed_devices, self.model_devices = facts
        self._speed: OrderedDict[Any, np.ndarray] = OrderedDict()

    def models_present(self, devices: np.ndarray) -> np.ndarray:
        """Positions of the models that have a device in the mask ``devices``."""
        present = [m for m, mine in enumerate(self.model_devices) if (devices & mine).any()]
        return np.array(present, dtype=np.int64)

    def per_device(self, key: Any, per_model: Callable[[], np.ndarray]) -> np.ndarray:
        """``per_model()[dev_model]``, cached under ``key`` (which must determine it)."""
        hit = self._get(self._speed, key)
        if hit is None:
            hit = per_model()[self.index.dev_model]
            self._put(self._speed, key, hit)
        return hit

    def has_degraded(self, elig: Eligibility) -> bool:
        """Whether some device ``elig`` allows is DEGRADED (chosen last)."""
        hit = self._degraded.get(id(elig))
        if hit is None or hit[0] is not elig:
            hit = (elig, bool((elig.usable & ~elig.healthy).any()))
            self._degraded[id(elig)] = hit
        return hit[1]

    @staticmethod
    def _get(entries: OrderedDict[Any, Any], key: Any) -> Any:
        hit = entries.get(key)
        if hit is not None:
            entries.move_to_end(key)
        return hit

    @staticmethod
    def _put(entries: OrderedDict[Any, Any], key: Any, value: Any) -> None:
        entries[key] = value
        while len(entries) > _MAX_ENTRIES:
            entries.popitem(last=False)

    def whole_counts(self, elig: Eligibility, state: FreeState) -> NodeCounts:
        """Per-node counts of ``elig``'s entirely free devices in ``state``.

        Kept per inventory eligibility (``elig.base`` when some nodes are closed): another
        closed set changes ``usable`` only on the nodes closed or opened, which the engine's
        rebase stamps anew, so the kept counts are recomputed there alone."""
        own = elig.base or elig
        key = id(own)
        entry: WholeCounts | None = self._get(self._whole, key)
        if entry is None or (entry.elig.base or entry.elig) is not own:
            entry = WholeCounts(self.index, elig)
            self._put(self._whole, key, entry)
        entry.elig = elig
        return entry.counts(state)

    def whole_scores(
        self,
        signature: tuple[int, int, int],
        state: FreeState,
        delta_of: Callable[[np.ndarray], np.ndarray],
    ) -> WholeScores | None:
        """The whole-device fragmentation increases for ``signature`` = (devices, host CPU, host
        RAM), brought up to date with ``state`` (see :meth:`WholeScores.refresh`); None the first
        time they are asked for and ``fill_on_first_use`` is off."""
        entry: WholeScores | None = self._get(self._whole_scores, signature)
        if entry is None:
            if not self.fill_on_first_use and ("whole", signature) not in self._seen:
                if len(self._seen) >= 64 * _MAX_ENTRIES:
                    self._seen.clear()
                self._seen.add(("whole", signature))
                return None
            entry = WholeScores(self.index)
            self._put(self._whole_scores, signature, entry)
        entry.refresh(state, delta_of)
        return entry

    def fraction_scores(
        self,
        signature: tuple[int, int, int],
        state: FreeState,
        term_of: Callable[[np.ndarray, np.ndarray], np.ndarray],
    ) -> FractionScores | None:
        """The fraction terms for ``signature`` = (milli, host CPU, host RAM), brought up to date
        with ``state`` (see :meth:`FractionScores.refresh`); None the first time they are asked
        for and ``fill_on_first_use`` is off."""
        entry: FractionScores | None = self._get(self._fraction, signature)
        if entry is None:
            if not self.fill_on_first_use and signature not in self._seen:
                if len(self._seen) >= 64 * _MAX_ENTRIES:
                    self._seen.clear()
                self._seen.add(signature)
                return None
            entry = FractionScores(self.index, signature[0])
            self._put(self._fraction, signature, entry)
        entry.refresh(state, term_of)
        return entry
