"""One task's decision: feasible devices now → candidate nodes → score → devices, or a reason.

Used by :class:`gpusched.placement.engine.Placer` through the narrow :class:`PlacerView` (the
fleet index, the policy, the fragmentation statistics and per-model speeds): this module does
not import the engine, so the engine module stays about ordering, reservations and quota.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from gpusched.model import MILLI
from gpusched.placement import filter as flt
from gpusched.placement.feasible import shape_fits
from gpusched.placement.index import FleetIndex, FreeState
from gpusched.placement.policy import Chooser, Policy
from gpusched.placement.score import FragStats
from gpusched.placement.topology import NodeCounts, node_counts, pick_in_node, pick_nodes
from gpusched.placement.types import PendingTask, Rejection
from gpusched.request import GPURequest, Interconnect

__all__ = ["Choice", "PlacerView", "choose", "left_after", "levels_best"]


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
    def stats(self) -> FragStats:
        """Fragmentation statistics of the current free state."""
        ...

    def model_speed(self, job_type: str | None) -> tuple[np.ndarray, np.ndarray]:
        """Per-model (speed, energy per unit of work) for ``job_type``."""
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
    """Devices for ``task`` in ``state`` (tasks ending at ``end``; inf = unknown), or a rejection."""
    idx = placer.index
    policy = placer.policy
    req = task.request
    milli = flt.milli_need(req, policy.round_up_fractions)
    frac = milli < MILLI
    elig = flt.eligibility(
        idx, req, fractional=frac, fractions_need_partitioning=policy.fractions_need_partitioning
    )
    reason = flt.static_reason(req, elig, fractional=frac) or _never_fits(idx, req, elig, frac)
    if reason is not None:
        return Rejection(task.key, reason, True)
    if frac:
        fits = flt.fraction_fits(
            idx, elig.usable, state.free_milli, state.free_mem, milli, req.memory_per_gpu
        )
    else:
        fits = elig.usable & (state.free_milli >= MILLI) & (state.free_mem >= idx.dev_mem)
    if task.cpu_milli or task.host_memory_bytes:
        host_ok = (state.host_cpu >= task.cpu_milli) & (state.host_mem >= task.host_memory_bytes)
        gpu_fits = fits
        fits = fits & host_ok[idx.dev_node]
        if gpu_fits.any() and not fits.any():
            return Rejection(task.key, _host_reason(req, task, frac), False)
    fits_now = fits
    if end != math.inf or np.isfinite(state.res_start).any():
        fits = fits & (state.res_start >= end)
    if frac:
        return _fraction(placer, task, state, fits, fits_now, elig, milli, rng, use_stats)
    return _whole(placer, task, state, fits, fits_now, elig, rng, use_stats)


def _speed_terms(
    placer: PlacerView, task: PendingTask, models: np.ndarray, eligible_models: np.ndarray
) -> np.ndarray:
    policy = placer.policy
    speed, energy = placer.model_speed(task.job_type)
    out = np.zeros(len(models))
    known = task.job_type is not None and task.job_type in policy.throughput
    if not (known or task.request.expected_duration_s > 0) or not len(eligible_models):
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
    policy = placer.policy
    cand = np.flatnonzero(fits)
    if len(cand) == 0:
        return Rejection(task.key, _busy_reason(task.request, elig, fits, fits_now, True), False)
    info = flt.slice_info(idx)
    if info.any_slices:
        shared = cand[~info.is_slice[cand]]
        if len(shared) == 0:  # only slices: the smallest free one that holds the task
            d = int(cand[np.lexsort((cand, info.compute[cand], idx.dev_mem[cand]))[0]])
            if policy.chooser is Chooser.RANDOM:
                d = int(rng.choice(cand))
            take_milli, take_mem = flt.fraction_take(idx, d, milli, task.request.memory_per_gpu)
            return Choice([d], take_milli, [take_mem], 0.0)
        cand = shared  # "any": share a whole device while one has room; slices stay for "hard"
    free = state.free_milli[cand]
    score = 0.0
    if policy.chooser is Chooser.FIRST_FIT:
        d = int(cand[0])
    elif policy.chooser is Chooser.RANDOM:
        # A uniformly random node, then a random device of it (not a random device, which would
        # favour nodes with many fitting devices).
        node_of = idx.dev_node[cand]
        n = int(rng.choice(np.unique(node_of)))
        d = int(rng.choice(cand[node_of == n]))
    elif policy.chooser is Chooser.BEST_FIT:
        node_of = idx.dev_node[cand]
        left = left_after(placer, state, node_of, milli, task) if use_stats else free.astype(np.float64)
        d = int(cand[np.lexsort((cand, free, node_of, left))[0]])
    else:
        # Fully free devices of one node are interchangeable: score only the first of each node.
        full = free >= MILLI
        if full.any():
            node_of = idx.dev_node[cand]
            repeat = np.zeros(len(cand), dtype=bool)
            full_pos = np.flatnonzero(full)
            repeat[full_pos[1:]] = node_of[full_pos[1:]] == node_of[full_pos[:-1]]
            cand, free = cand[~repeat], free[~repeat]
        s = np.zeros(len(cand))
        if use_stats and policy.fragmentation:
            s = (
                s
                + policy.fragmentation
                * placer.stats.delta_fraction(cand, milli, free, task.cpu_milli, task.host_memory_bytes)
                / MILLI
            )
        s = s + _speed_terms(placer, task, idx.dev_model[cand], idx.dev_model[cand])
        s = s + policy.degraded_penalty * (idx.dev_health[cand] == 1)
        if policy.score_levels:
            best = levels_best(s, policy.score_levels)
        else:
            best = _tie_break(s, free - milli) if policy.packing else int(np.argmin(s))
        d, score = int(cand[best]), float(s[best])
    return Choice([d], milli, [task.request.memory_per_gpu], score)


def _whole(
    placer: PlacerView,
    task: PendingTask,
    state: FreeState,
    fits: np.ndarray,
    fits_now: np.ndarray,
    elig: flt.Eligibility,
    rng: np.random.Generator,
    use_stats: bool,
) -> Choice | Rejection:
    idx = placer.index
    policy = placer.policy
    req = task.request
    k = req.count
    nc = node_counts(idx, fits, k)
    nodes = np.flatnonzero(nc.feasible(k, req.interconnect))
    local = policy.chooser is Chooser.SCORE
    score = 0.0
    plan: list[tuple[int, int]]
    if len(nodes):
        if policy.chooser is Chooser.FIRST_FIT:
            n = int(nodes[0])
        elif policy.chooser is Chooser.RANDOM:
            n = int(rng.choice(nodes))
        elif policy.chooser is Chooser.BEST_FIT:
            left = left_after(placer, state, nodes, k * MILLI, task) if use_stats else nc.count[nodes]
            n = int(nodes[np.argmin(left)])
        else:
            s = policy.locality * nc.tier(k)[nodes].astype(np.float64)
            if use_stats and policy.fragmentation:
                s += (
                    policy.fragmentation
                    * placer.stats.delta_whole(nodes, k, task.cpu_milli, task.host_memory_bytes)
                    / MILLI
                )
            node_models = idx.dev_model[idx.node_start[nodes]]
            s += _speed_terms(placer, task, node_models, node_models)
            if policy.degraded_penalty and (fits & ~elig.healthy).any():
                n_healthy = np.bincount(idx.dev_node[fits & elig.healthy], minlength=len(idx.nodes))[nodes]
                s += policy.degraded_penalty * np.maximum(0, k - n_healthy)
            if policy.score_levels:
                best = levels_best(s, policy.score_levels)
            elif use_stats and policy.packing:
                best = _tie_break(s, (placer.stats.total[nodes] - k * MILLI) / (idx.node_size[nodes] * MILLI))
            else:
                best = int(np.argmin(s))
            n, score = int(nodes[best]), float(s[best])
        plan = [(n, k)]
    elif req.may_span_nodes and k > 1:
        order = {Chooser.FIRST_FIT: "first", Chooser.RANDOM: "random"}.get(policy.chooser, "best")
        gang = pick_nodes(idx, nc.count, k, req.interconnect, order=order, rng=rng)
        if gang is None:
            return Rejection(task.key, _gang_reason(idx, req, elig, nc, fits, fits_now), False)
        plan, tier = gang
        if local:
            score = policy.locality * tier
    else:
        return Rejection(task.key, _gang_reason(idx, req, elig, nc, fits, fits_now), False)
    chosen: list[int] = []
    for n, take in plan:
        lo, hi = int(idx.node_start[n]), int(idx.node_start[n + 1])
        in_node: list[int] = (np.flatnonzero(fits[lo:hi]) + lo).tolist()
        inter = req.interconnect if len(plan) == 1 else Interconnect.ANY
        healthy = [d for d in in_node if idx.dev_health[d] == 0]
        pool = healthy if len(healthy) >= take and _ok(idx, healthy, take, inter) else in_node
        if policy.chooser is Chooser.RANDOM:
            pool = rng.permutation(pool).tolist()
        chosen.extend(pick_in_node(idx, pool, take, inter, local=local))
    return Choice(chosen, MILLI, [int(idx.dev_mem[d]) for d in chosen], score)


def levels_best(score: np.ndarray, levels: int) -> int:
    """FGD's integer node score: ``int(levels × sigmoid(−score))``; the first of the highest."""
    q = np.floor(levels / (1.0 + np.exp(np.clip(score, -50.0, 50.0))))
    return int(np.argmax(q))


def _tie_break(score: np.ndarray, left: np.ndarray) -> int:
    """Position of the lowest score; among scores equal to 1e-9, the one with the least ``left``."""
    tied = np.flatnonzero(score <= score.min() + 1e-9)
    return int(tied[np.argmin(left[tied])])


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


def _never_fits(idx: FleetIndex, req: GPURequest, elig: flt.Eligibility, frac: bool) -> str | None:
    """A reason when even the empty fleet (all devices in service) cannot hold the request."""
    k = req.count
    if frac or k == 1:
        return None
    key = (
        "never",
        req.vendors,
        req.models,
        req.labels,
        req.min_arch,
        req.memory_per_gpu,
        k,
        req.interconnect,
    )
    if key in idx.masks:
        cached: str | None = idx.masks[key]
        return cached
    reason = None
    if not shape_fits(idx, elig.hardware, req):
        nc = node_counts(idx, elig.hardware, k)
        what = req.describe()
        if req.may_span_nodes:
            per_rack = np.bincount(idx.node_rack, weights=nc.count, minlength=len(idx.racks))
            total = int(nc.count.sum())
            if req.interconnect is Interconnect.SAME_RACK and per_rack.max() < k:
                reason = f"needs {what}; the largest rack has only {int(per_rack.max())} matching devices"
            elif total < k:
                reason = f"needs {what}; the whole fleet has only {total} matching devices"
        elif req.interconnect is Interconnect.ISLAND:
            reason = f"needs {what}; the largest matching island in the fleet has {int(nc.island.max())}"
        elif req.interconnect is Interconnect.SAME_NUMA:
            reason = f"needs {what}; the largest matching NUMA node in the fleet has {int(nc.numa.max())}"
        else:
            reason = f"needs {what}; the largest matching node in the fleet has {int(nc.count.max())}"
    idx.masks[key] = reason
    return reason


def _held(fits: np.ndarray, fits_now: np.ndarray) -> str:
    held = int((fits_now & ~fits).sum())
    return f", {held} held for a reservation" if held else ""


def _busy_reason(
    req: GPURequest, elig: flt.Eligibility, fits: np.ndarray, fits_now: np.ndarray, frac: bool
) -> str:
    what = req.describe(fractional=frac)
    busy = elig.n_usable - int(fits_now.sum())
    note = flt.operational_note(elig)
    extra = f"; {note}" if note else ""
    held = _held(fits, fits_now)
    return f"waiting for {what}: {elig.n_usable} matching devices in service, {busy} busy{held}{extra}"


def _gang_reason(
    idx: FleetIndex,
    req: GPURequest,
    elig: flt.Eligibility,
    nc: NodeCounts,
    fits: np.ndarray,
    fits_now: np.ndarray,
) -> str:
    k = req.count
    if k == 1:
        return _busy_reason(req, elig, fits, fits_now, False)
    what = req.describe()
    note = flt.operational_note(elig)
    extra = f"; {note}" if note else ""
    free = int(nc.count.sum())
    if req.interconnect is Interconnect.ISLAND:
        head = f"largest free island: {int(nc.island.max(initial=0))}"
    elif req.interconnect is Interconnect.SAME_NUMA:
        head = f"largest free set in one NUMA node: {int(nc.numa.max(initial=0))}"
    elif req.may_span_nodes:
        per_rack = np.bincount(idx.node_rack, weights=nc.count, minlength=len(idx.racks))
        head = f"{free} free in the fleet, at most {int(per_rack.max(initial=0))} in one rack"
    else:
        best = int(np.argmax(nc.count)) if len(nc.count) else 0
        most = int(nc.count.max(initial=0))
        head = f"largest free set on one node: {most}" + (f" ({idx.nodes[best].name})" if most else "")
    return f"needs {what}; {head} ({free} matching free{_held(fits, fits_now)}){extra}"


def _host_reason(req: GPURequest, task: PendingTask, frac: bool) -> str:
    what = req.describe(fractional=frac)
    return (
        f"{what}: devices are free, but no node holding them has {task.cpu_milli / 1000:g} CPU cores and "
        f"{task.host_memory_bytes / 2**30:.1f} GiB of host memory free"
    )
