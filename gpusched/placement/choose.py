"""One task's decision: feasible devices now → candidate nodes → score → devices, or a reason.

Used by :class:`gpusched.placement.engine.Placer` through the narrow :class:`PlacerView` (the
fleet index, the policy, the fragmentation statistics and per-model speeds): this module does
not import the engine, so the engine module stays about ordering, reservations and quota.

How the candidates become one choice is the policy's chooser part (``Policy.chooser``;
:mod:`gpusched.placement.parts`): :data:`SELECTORS` holds one :class:`Selector` per chooser —
the weighted score (parts exact and levels, with their tie-breaks), best-fit, first-fit and
random — each saying how it picks a fraction's device, a whole request's node, a gang's node
order and a CPU-only task's node; the decision code dispatches on it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

import numpy as np

from gpusched.model import MILLI
from gpusched.placement import filter as flt
from gpusched.placement.incremental import Incremental, WholeFits
from gpusched.placement.index import FleetIndex, FreeState
from gpusched.placement.lookahead import ShapeDeltas, level_choice
from gpusched.placement.policy import Chooser, Policy
from gpusched.placement.reasons import busy_reason, gang_reason, host_reason, never_fits, repartition_wait
from gpusched.placement.score import FragStats
from gpusched.placement.speeds import timed
from gpusched.placement.ties import levels_best, near_top, tie_break
from gpusched.placement.topology import NodeCounts, node_counts, pick_in_node, pick_nodes
from gpusched.placement.types import PendingTask, Rejection
from gpusched.request import GPURequest, Interconnect

__all__ = [
    "SELECTORS", "Choice", "HostPlacerView", "PlacerView", "Selector", "choose", "left_after", "selector",
]


@dataclass(slots=True)
class Choice:
    """Devices chosen for one task (fleet-index positions), the share and memory taken on each."""

    devices: list[int]
    milli: int
    memory: list[int]
    score: float


class PlacerView(Protocol):
    """What :func:`choose` reads of the engine: nothing it can change."""

    @property
    def index(self) -> FleetIndex:
        """The fleet's static index."""
        ...

    @property
    def policy(self) -> Policy:
        """The placement policy."""
        ...

    @property
    def closed(self) -> frozenset[str]:
        """Nodes that take no new work this call (as if cordoned: the snapshot's ``closed``)."""
        ...

    @property
    def stats(self) -> FragStats:
        """Fragmentation statistics of the current free state."""
        ...

    @property
    def incremental(self) -> Incremental | None:
        """Per-node caches kept between decisions (None: compute everything per decision)."""
        ...

    @property
    def lookahead(self) -> ShapeDeltas | None:
        """The look-ahead tie-break's per-node shape deltas (None: the policy has none)."""
        ...

    def model_speed(self, job_type: str | None) -> tuple[np.ndarray, np.ndarray]:
        """Per-model (speed, energy per unit of work) for ``job_type``."""
        ...


class HostPlacerView(PlacerView, Protocol):
    """What a CPU-only task's choice (:meth:`Selector.host`) reads of the engine besides
    :class:`PlacerView`."""

    @property
    def state(self) -> FreeState:
        """The working free capacity."""
        ...

    @property
    def host_stats(self) -> FragStats:
        """Fragmentation statistics CPU-only tasks are scored by."""
        ...


def choose(
    placer: PlacerView,
    task: PendingTask,
    state: FreeState,
    end: float,
    rng: np.random.Generator,
    *,
    use_stats: bool,
) -> Choice | Rejection:
    """Devices for ``task`` in ``state`` (tasks ending at ``end``; inf = unknown), or a rejection.

    With the engine's per-node caches (``placer.incremental``) and no reservation held, the
    fitting devices, node counts and fractional scores come from the caches, which recompute
    only the nodes that changed; the outcome is the one the full computation gives.
    """
    idx = placer.index
    policy = placer.policy
    req = task.request
    milli = flt.milli_need(req, policy.round_up_fractions)
    frac = milli < MILLI
    elig = flt.eligibility(
        idx, req, fractional=frac, fractions_need_partitioning=policy.fractions_need_partitioning,
        closed=placer.closed,
    )
    reason = flt.static_reason(req, elig, fractional=frac) or never_fits(idx, req, elig, frac)
    if reason is not None:
        wait = repartition_wait(idx, req, state, reason, placer.closed) if frac else None
        return Rejection(task.key, reason, True) if wait is None else Rejection(task.key, wait, False)
    inc = placer.incremental
    host = bool(task.cpu_milli or task.host_memory_bytes)
    if inc is not None and not np.isfinite(state.res_start).any():
        if not frac:
            nc = inc.whole_counts(elig, state)
            if host:
                host_ok = (state.host_cpu >= task.cpu_milli) & (state.host_mem >= task.host_memory_bytes)
                if nc.count.any() and not (nc.count * host_ok).any():
                    return Rejection(task.key, host_reason(req, task, frac), False)
                nc = NodeCounts(*(c * host_ok for c in (nc.count, nc.island, nc.numa, nc.switch)))
            lazy = WholeFits(idx, elig, state, task, inc.has_degraded(elig))
            return _whole(placer, task, state, lazy, elig, rng, use_stats, nc)
        if use_stats and _cached_fraction_applies(placer):
            quick = _fraction_cached(placer, inc, task, state, elig, milli)
            if quick is not None:
                return quick
    if frac:
        fits = flt.fraction_fits(
            idx, elig.usable, state.free_milli, state.free_mem, milli, req.memory_per_gpu
        )
    else:
        fits = elig.usable & (state.free_milli >= MILLI) & (state.free_mem >= idx.dev_mem)
    if host:
        host_ok = (state.host_cpu >= task.cpu_milli) & (state.host_mem >= task.host_memory_bytes)
        gpu_fits = fits
        fits = fits & host_ok[idx.dev_node]
        if gpu_fits.any() and not fits.any():
            return Rejection(task.key, host_reason(req, task, frac), False)
    fits_now = fits
    if end != math.inf or np.isfinite(state.res_start).any():
        fits = fits & (state.res_start >= end)
    if frac:
        return _fraction(placer, task, state, fits, fits_now, elig, milli, rng, use_stats)
    return _whole(placer, task, state, WholeFits.of(idx, fits, fits_now), elig, rng, use_stats, None)


def _cached_fraction_applies(placer: PlacerView) -> bool:
    """Whether the fractional decision can come from the per-node cache: the ``score`` chooser
    without the best-fit tie-break, no slices, and a workload without host or model conditions
    (whose shape-by-shape form sums with a matrix product)."""
    policy = placer.policy
    return (
        selector(policy).scored
        and not policy.packing
        and not flt.slice_info(placer.index).any_slices
        and not placer.stats.workload.host_aware
    )


def _fraction_cached(
    placer: PlacerView,
    inc: Incremental,
    task: PendingTask,
    state: FreeState,
    elig: flt.Eligibility,
    milli: int,
) -> Choice | None:
    """:func:`_fraction`'s ``score`` choice with the fragmentation terms from the per-node cache;
    None when the cache is not filled yet or nothing fits (the full path then decides and
    explains)."""
    idx = placer.index
    policy = placer.policy
    stats = placer.stats
    memory = task.request.memory_per_gpu
    cpu, host_mem = task.cpu_milli, task.host_memory_bytes

    def term_of(devices: np.ndarray, free: np.ndarray) -> np.ndarray:
        term = np.zeros(len(devices))
        if policy.fragmentation:
            delta = stats.delta_fraction(devices, milli, free, cpu, host_mem)
            term = term + policy.fragmentation * delta / MILLI
        return term

    entry = inc.fraction_scores((milli, cpu, host_mem), state, term_of)
    if entry is None:
        return None
    fits = elig.usable & (state.free_milli >= milli) & (state.free_mem >= memory)
    if cpu or host_mem:
        fits &= ((state.host_cpu >= cpu) & (state.host_mem >= host_mem))[idx.dev_node]
    mixed = inc.mixed_devices
    if len(mixed):  # as _fraction: one fully free device per node stands for the others
        full = mixed[fits[mixed] & (state.free_milli[mixed] >= MILLI)]
        node_of = idx.dev_node[full]
        fits[full[1:][node_of[1:] == node_of[:-1]]] = False
    present = inc.models_present(fits)
    if not len(present):
        return None
    speed = inc.per_device(
        (task.job_type, timed(policy, task), tuple(present.tolist())),
        lambda: _speed_terms(placer, task, np.arange(len(idx.model_names)), present),
    )
    others = speed + policy.degraded_penalty * (idx.dev_health == 1) if inc.any_degraded else speed
    s = entry.term + others
    if not policy.score_levels:
        best = int(np.argmin(np.where(fits, s, np.inf)))
        return Choice([best], milli, [memory], float(s[best]))
    # Only the candidates within the levels the choice looks at matter (in order): found
    # without gathering every fitting device first.
    cand, _ = near_top(np.where(fits, s, np.inf), policy.score_levels, policy.lookahead_widen)
    cand = cand[fits[cand]]  # (unfit devices come back only when every level is looked at)
    at = level_choice(placer.lookahead, stats, state, task, s[cand], idx.dev_node[cand],
                      lambda i: [int(cand[i])], milli, levels=policy.score_levels, packing=False,
                      others=others[cand])
    return Choice([int(cand[at])], milli, [memory], float(s[cand[at]]))


def _speed_terms(
    placer: PlacerView, task: PendingTask, models: np.ndarray, eligible_models: np.ndarray
) -> np.ndarray:
    policy = placer.policy
    speed, energy = placer.model_speed(task.job_type)
    out = np.zeros(len(models))
    if not timed(policy, task) or not len(eligible_models):
        return out  # speed and energy matter for work that runs a known while
    if policy.speed:
        out += policy.speed * (1.0 - speed[models] / speed[eligible_models].max())
    if policy.energy:
        out += policy.energy * np.minimum(energy[models] / energy[eligible_models].min() - 1.0, 2.0)
    return out


def _fraction(
    placer: PlacerView,
    task: PendingTask,
    state: FreeState,
    fits: np.ndarray,
    fits_now: np.ndarray,
    elig: flt.Eligibility,
    milli: int,
    rng: np.random.Generator,
    use_stats: bool,
) -> Choice | Rejection:
    idx = placer.index
    picker = selector(placer.policy)
    cand = np.flatnonzero(fits)
    if len(cand) == 0:
        return Rejection(task.key, busy_reason(task.request, elig, fits, fits_now, True), False)
    info = flt.slice_info(idx)
    if info.any_slices:
        shared = cand[~info.is_slice[cand]]
        if len(shared) == 0:  # only slices: the smallest free one that holds the task
            d = int(cand[np.lexsort((cand, info.compute[cand], idx.dev_mem[cand]))[0]])
            d = picker.slice(cand, d, rng)
            take_milli, take_mem = flt.fraction_take(idx, d, milli, task.request.memory_per_gpu)
            return Choice([d], take_milli, [take_mem], 0.0)
        cand = shared  # "any": share a whole device while one has room; slices stay for "hard"
    d, score = picker.fraction(placer, task, state, cand, milli, rng, use_stats)
    return Choice([d], milli, [task.request.memory_per_gpu], score)


def _whole(
    placer: PlacerView,
    task: PendingTask,
    state: FreeState,
    fits: WholeFits,
    elig: flt.Eligibility,
    rng: np.random.Generator,
    use_stats: bool,
    counts: NodeCounts | None,
) -> Choice | Rejection:
    idx = placer.index
    policy = placer.policy
    req = task.request
    k = req.count
    nc = counts if counts is not None else node_counts(idx, fits.full()[0], k)
    nodes = np.flatnonzero(nc.feasible(k, req.interconnect))
    picker = selector(policy)
    score = 0.0
    plan: list[tuple[int, int]]
    if len(nodes):
        n, score = picker.node(placer, task, state, nodes, nc, fits, elig, rng, use_stats)
        plan = [(n, k)]
    elif req.may_span_nodes and k > 1:
        gang = pick_nodes(idx, nc.count, k, req.interconnect, order=picker.gang_order, rng=rng)
        if gang is None:
            return Rejection(task.key, gang_reason(idx, req, elig, nc, *fits.full()), False)
        plan, tier = gang
        if picker.scored:
            score = policy.locality * tier
    else:
        return Rejection(task.key, gang_reason(idx, req, elig, nc, *fits.full()), False)
    chosen: list[int] = []
    for n, take in plan:
        in_node = fits.in_node(n)
        inter = req.interconnect if len(plan) == 1 else Interconnect.ANY
        healthy = [d for d in in_node if idx.dev_health[d] == 0]
        pool = healthy if len(healthy) >= take and _ok(idx, healthy, take, inter) else in_node
        pool = picker.pool(pool, rng)
        chosen.extend(pick_in_node(idx, pool, take, inter, local=picker.scored))
    return Choice(chosen, MILLI, [int(idx.dev_mem[d]) for d in chosen], score)


def left_after(
    placer: PlacerView, state: FreeState, nodes: np.ndarray, milli: int, task: PendingTask
) -> np.ndarray:
    """Best-fit key (lower is better): the share of each node's GPU capacity left free after the
    placement; for a task that asks for host CPU, the published BestFit's key instead —
    ``0.5 × CPU left / 128 cores + 0.5 × GPU left / 8 GPUs`` in whole hundredths (the FGD
    simulator's integer node score), so near-equal nodes tie and go to the earliest node."""
    idx = placer.index
    if task.cpu_milli:
        raw = 0.5 * (state.host_cpu[nodes] - task.cpu_milli) / _MAX_SPEC_CPU
        raw = raw + 0.5 * (placer.stats.total[nodes] - milli) / _MAX_SPEC_GPU
        return -np.floor((1.0 - raw) * 100.0)
    return (placer.stats.total[nodes] - milli) / (idx.node_size[nodes] * MILLI)


_MAX_SPEC_CPU = 128_000.0
_MAX_SPEC_GPU = 8_000.0


def _ok(idx: FleetIndex, devs: list[int], k: int, inter: Interconnect) -> bool:
    if k <= 1 or inter not in (Interconnect.ISLAND, Interconnect.SAME_NUMA):
        return True
    groups = idx.dev_island if inter is Interconnect.ISLAND else idx.dev_numa
    values = [int(groups[d]) for d in devs if groups[d] >= 0]
    return any(values.count(v) >= k for v in set(values))


class Selector:
    """How one chooser part picks among the candidates (:data:`SELECTORS`, by ``Policy.chooser``).

    ``scored``: the chooser reads the score parts (then devices inside a node are picked by
    topology, a gang across nodes is scored by its locality, and fractions may come from the
    engine's per-node cache); ``gang_order``: how a gang across nodes takes its nodes
    (:func:`~gpusched.placement.topology.pick_nodes`)."""

    scored = False
    gang_order = "best"

    def slice(self, cand: np.ndarray, smallest: int, rng: np.random.Generator) -> int:
        """The slice (device position) for a fraction that only slices hold; ``smallest`` is the
        smallest that holds it."""
        return smallest

    def pool(self, pool: list[int], rng: np.random.Generator) -> list[int]:
        """The devices of the chosen node in the order they are picked from."""
        return pool

    def fraction(
        self, placer: PlacerView, task: PendingTask, state: FreeState, cand: np.ndarray, milli: int,
        rng: np.random.Generator, use_stats: bool,
    ) -> tuple[int, float]:
        """The device (position) for a fraction of ``milli`` among the fitting ``cand``, and its score."""
        raise NotImplementedError

    def node(
        self, placer: PlacerView, task: PendingTask, state: FreeState, nodes: np.ndarray, nc: NodeCounts,
        fits: WholeFits, elig: flt.Eligibility, rng: np.random.Generator, use_stats: bool,
    ) -> tuple[int, float]:
        """The node (position) for a whole-device request among the feasible ``nodes``, and its score."""
        raise NotImplementedError

    def host(
        self, placer: HostPlacerView, ok: np.ndarray, cpu_milli: int, host_memory_bytes: int, seed: int
    ) -> int:
        """The node (position) for a CPU-only task among the nodes ``ok`` with room for it."""
        raise NotImplementedError


class _FirstFit(Selector):
    """The first fitting device or node in inventory order."""

    gang_order = "first"

    def fraction(
        self, placer: PlacerView, task: PendingTask, state: FreeState, cand: np.ndarray, milli: int,
        rng: np.random.Generator, use_stats: bool,
    ) -> tuple[int, float]:
        return int(cand[0]), 0.0

    def node(
        self, placer: PlacerView, task: PendingTask, state: FreeState, nodes: np.ndarray, nc: NodeCounts,
        fits: WholeFits, elig: flt.Eligibility, rng: np.random.Generator, use_stats: bool,
    ) -> tuple[int, float]:
        return int(nodes[0]), 0.0

    def host(
        self, placer: HostPlacerView, ok: np.ndarray, cpu_milli: int, host_memory_bytes: int, seed: int
    ) -> int:
        return int(ok[0])


class _Random(Selector):
    """A uniformly random fitting node, then a random device of it (seeded)."""

    gang_order = "random"

    def slice(self, cand: np.ndarray, smallest: int, rng: np.random.Generator) -> int:
        return int(rng.choice(cand))

    def pool(self, pool: list[int], rng: np.random.Generator) -> list[int]:
        return rng.permutation(pool).tolist()

    def fraction(
        self, placer: PlacerView, task: PendingTask, state: FreeState, cand: np.ndarray, milli: int,
        rng: np.random.Generator, use_stats: bool,
    ) -> tuple[int, float]:
        # A uniformly random node, then a random device of it (not a random device, which would
        # favour nodes with many fitting devices).
        node_of = placer.index.dev_node[cand]
        n = int(rng.choice(np.unique(node_of)))
        return int(rng.choice(cand[node_of == n])), 0.0

    def node(
        self, placer: PlacerView, task: PendingTask, state: FreeState, nodes: np.ndarray, nc: NodeCounts,
        fits: WholeFits, elig: flt.Eligibility, rng: np.random.Generator, use_stats: bool,
    ) -> tuple[int, float]:
        return int(rng.choice(nodes)), 0.0

    def host(
        self, placer: HostPlacerView, ok: np.ndarray, cpu_milli: int, host_memory_bytes: int, seed: int
    ) -> int:
        return int(np.random.default_rng(seed).choice(ok))


class _BestFit(Selector):
    """The node (then device) left with the least free capacity (:func:`left_after`)."""

    def fraction(
        self, placer: PlacerView, task: PendingTask, state: FreeState, cand: np.ndarray, milli: int,
        rng: np.random.Generator, use_stats: bool,
    ) -> tuple[int, float]:
        free = state.free_milli[cand]
        node_of = placer.index.dev_node[cand]
        left = left_after(placer, state, node_of, milli, task) if use_stats else free.astype(np.float64)
        return int(cand[np.lexsort((cand, free, node_of, left))[0]]), 0.0

    def node(
        self, placer: PlacerView, task: PendingTask, state: FreeState, nodes: np.ndarray, nc: NodeCounts,
        fits: WholeFits, elig: flt.Eligibility, rng: np.random.Generator, use_stats: bool,
    ) -> tuple[int, float]:
        k = task.request.count
        left = left_after(placer, state, nodes, k * MILLI, task) if use_stats else nc.count[nodes]
        return int(nodes[np.argmin(left)]), 0.0

    def host(
        self, placer: HostPlacerView, ok: np.ndarray, cpu_milli: int, host_memory_bytes: int, seed: int
    ) -> int:
        probe = PendingTask("", _ANY_GPU, 0.0, cpu_milli=cpu_milli, host_memory_bytes=host_memory_bytes)
        return int(ok[np.argmin(left_after(placer, placer.state, ok, 0, probe))])


class _Scored(Selector):
    """The weighted score of the policy's score parts: the lowest (chooser exact) or the highest
    integer level (chooser levels), ties to the policy's tie-break (earliest, least capacity left,
    or the look-ahead)."""

    scored = True

    def fraction(
        self, placer: PlacerView, task: PendingTask, state: FreeState, cand: np.ndarray, milli: int,
        rng: np.random.Generator, use_stats: bool,
    ) -> tuple[int, float]:
        idx, policy = placer.index, placer.policy
        free = state.free_milli[cand]
        # Fully free devices of one node are interchangeable: score only the first of each node.
        full = free >= MILLI
        if full.any():
            node_of = idx.dev_node[cand]
            repeat = np.zeros(len(cand), dtype=bool)
            full_pos = np.flatnonzero(full)
            repeat[full_pos[1:]] = node_of[full_pos[1:]] == node_of[full_pos[:-1]]
            cand, free = cand[~repeat], free[~repeat]
        others = _speed_terms(placer, task, idx.dev_model[cand], idx.dev_model[cand])
        others = others + policy.degraded_penalty * (idx.dev_health[cand] == 1)
        s = others
        if use_stats and policy.fragmentation:
            delta = placer.stats.delta_fraction(cand, milli, free, task.cpu_milli, task.host_memory_bytes)
            s = policy.fragmentation * delta / MILLI + others
        if policy.score_levels:
            best = level_choice(placer.lookahead if use_stats else None, placer.stats if use_stats else None,
                                state, task, s, idx.dev_node[cand], lambda i: [int(cand[i])], milli,
                                levels=policy.score_levels, packing=bool(policy.packing), others=others)
        else:
            best = tie_break(s, free - milli) if policy.packing else int(np.argmin(s))
        return int(cand[best]), float(s[best])

    def node(
        self, placer: PlacerView, task: PendingTask, state: FreeState, nodes: np.ndarray, nc: NodeCounts,
        fits: WholeFits, elig: flt.Eligibility, rng: np.random.Generator, use_stats: bool,
    ) -> tuple[int, float]:
        idx, policy = placer.index, placer.policy
        k = task.request.count
        others = policy.locality * nc.tier(k)[nodes].astype(np.float64)
        node_models = idx.dev_model[idx.node_start[nodes]]
        others += _speed_terms(placer, task, node_models, node_models)
        if policy.degraded_penalty and fits.degraded and (fits.full()[0] & ~elig.healthy).any():
            mask = fits.full()[0]
            n_healthy = np.bincount(idx.dev_node[mask & elig.healthy], minlength=len(idx.nodes))[nodes]
            others += policy.degraded_penalty * np.maximum(0, k - n_healthy)
        s = others
        if use_stats and policy.fragmentation:
            delta = _whole_delta(placer, task, state, nodes, k)
            s = policy.fragmentation * delta / MILLI + others
        if policy.score_levels:
            best = level_choice(placer.lookahead if use_stats else None,
                                placer.stats if use_stats else None, state, task, s, nodes,
                                lambda i: fits.in_node(int(nodes[i]))[:k], MILLI,
                                levels=policy.score_levels, packing=bool(policy.packing), others=others,
                                may_widen=not timed(policy, task))
        elif use_stats and policy.packing:
            best = tie_break(s, (placer.stats.total[nodes] - k * MILLI) / (idx.node_size[nodes] * MILLI))
        else:
            best = int(np.argmin(s))
        return int(nodes[best]), float(s[best])

    def host(
        self, placer: HostPlacerView, ok: np.ndarray, cpu_milli: int, host_memory_bytes: int, seed: int
    ) -> int:
        policy, st = placer.policy, placer.state
        stats = placer.host_stats
        delta = stats.delta_host(ok, cpu_milli, host_memory_bytes)
        if policy.score_levels:
            left = stats.total[ok] if policy.packing else None
            return int(ok[levels_best(policy.fragmentation * delta / MILLI, policy.score_levels, left)])
        # Among equal fragmentation, the node with the least free GPU capacity, then CPU.
        return int(ok[np.lexsort((st.host_cpu[ok], stats.total[ok], delta))[0]])


def _whole_delta(
    placer: PlacerView, task: PendingTask, state: FreeState, nodes: np.ndarray, k: int
) -> np.ndarray:
    """The fragmentation increase of taking ``k`` whole devices (and the task's host CPU/RAM) on
    each of ``nodes``: from the engine's per-node cache where it keeps one (the same values)."""
    stats, cpu, mem = placer.stats, task.cpu_milli, task.host_memory_bytes
    inc = placer.incremental
    if inc is not None and not stats.workload.host_aware:
        entry = inc.whole_scores((k, cpu, mem), state, lambda at: stats.delta_whole(at, k, cpu, mem))
        if entry is not None:
            return entry.delta[nodes]
    return stats.delta_whole(nodes, k, cpu, mem)


_ANY_GPU = GPURequest()

SELECTORS: Mapping[Chooser, Selector] = MappingProxyType({
    Chooser.SCORE: _Scored(),
    Chooser.BEST_FIT: _BestFit(),
    Chooser.FIRST_FIT: _FirstFit(),
    Chooser.RANDOM: _Random(),
})
"""The engine's dispatch on the chooser part: one :class:`Selector` per ``Policy.chooser``."""


def selector(policy: Policy) -> Selector:
    """How ``policy``'s chooser picks."""
    return SELECTORS[policy.chooser]
