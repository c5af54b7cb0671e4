"""The objective of the batch optimiser and its encoding (see :mod:`gpusched.placement.genetic`).

Per task, a short list of feasible device sets ranked by the objective (the genome's alphabet);
:class:`Decoder` turns a genome into a feasible joint plan (repairing collisions) and its value:

    α · latency (h, priority-weighted)  +  β · fragmentation (GPUs)  +  γ · energy (kWh)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpusched.model import MILLI, DeviceShare, FleetSnapshot
from gpusched.placement import filter as flt
from gpusched.placement.ga_ranking import FractionRanking, Lookup, smallest_k
from gpusched.placement.index import FleetIndex, fleet_index, usage_arrays
from gpusched.placement.policy import Policy
from gpusched.placement.speeds import relative_speeds, typed
from gpusched.placement.topology import node_counts, pick_in_node, pick_nodes
from gpusched.placement.types import PendingTask, PlacementPlan
from gpusched.request import Interconnect

__all__ = ["DEFAULT_DURATION_S", "NODE_OPEN_COST", "Candidate", "Decoder", "Problem", "plan_objective"]

DEFAULT_DURATION_S = 3600
NODE_OPEN_COST = 0.5  # GPUs of fragmentation charged for cutting into an untouched node


@dataclass(slots=True)
class Candidate:
    devices: tuple[int, ...]
    milli: int
    memory: tuple[int, ...]
    latency: float  # weighted hours
    energy: float  # kWh


class Problem:
    """Candidates per task and the vectorised pieces of the objective."""

    def __init__(
        self,
        index: FleetIndex,
        snapshot: FleetSnapshot,
        policy: Policy,
        now: float,
        weights: tuple[float, float, float],
        top_k: int,
        defer_s: float,
    ) -> None:
        self.index = index
        self.closed = snapshot.closed  # nodes that take no new work (as if cordoned)
        self.policy = policy
        self.now = now
        self.alpha, self.beta, self.gamma = weights
        self.top_k = top_k
        self.defer_s = defer_s
        used_milli, used_mem = usage_arrays(index, snapshot)  # cached per usage mapping
        free_milli = MILLI - used_milli
        free_mem = index.dev_mem - used_mem
        self.free_milli, self.free_mem = free_milli, free_mem
        # Per-device Python values for the decoder's inner loop, converted on first access: a
        # batch touches a few thousand devices, the fleet may hold 80,000.
        self.base_milli: dict[int, int] = Lookup(free_milli)
        self.base_mem: dict[int, int] = Lookup(free_mem)
        node_used = np.bincount(index.dev_node, weights=(free_milli < MILLI), minlength=len(index.nodes))
        self.node_empty_arr = node_used == 0
        self.node_empty: dict[int, bool] = Lookup(self.node_empty_arr)
        self._shapes: dict[tuple[Any, ...], list[tuple[tuple[int, ...], int, tuple[int, ...]]]] = {}
        # Per (eligibility, …): the fitting devices (and node counts), kept with the objects
        # their ids key on so the ids stay theirs.
        self._fits: dict[tuple[Any, ...], Any] = {}
        self.dev_node: dict[int, int] = Lookup(index.dev_node)
        self._speeds: dict[str | None, np.ndarray] = {}
        self.tdp_kw = np.array([(i.tdp_milliwatts if i else 300_000) / 1e6 for i in index.model_info])

    def speed(self, task: PendingTask) -> np.ndarray:
        """Run-time divisor per model for ``task``: the greedy chooser's speeds
        (:func:`~gpusched.placement.speeds.relative_speeds`, per job type)."""
        job_type = task.job_type if typed(self.policy, task.job_type) else None
        hit = self._speeds.get(job_type)
        if hit is None:
            hit = self._speeds[job_type] = relative_speeds(self.policy, self.index, job_type)
        return hit

    def runtime_s(self, task: PendingTask, models: np.ndarray) -> np.ndarray:
        """Expected run time on each of ``models``: the task's expected duration (else
        :data:`DEFAULT_DURATION_S`) over its relative speed there."""
        ref = task.request.expected_duration_s or DEFAULT_DURATION_S
        return ref / self.speed(task)[models]

    def _weight(self, task: PendingTask) -> float:
        return max(task.request.priority, 1) / 50.0

    def costs(
        self, task: PendingTask, models: np.ndarray, share_gpus: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """(weighted latency h, energy kWh) for a candidate running on ``models`` (one per device)."""
        run = self.runtime_s(task, models)
        wait = max(0.0, self.now - task.submitted_at)
        latency = self._weight(task) * (wait + run) / 3600.0
        energy = share_gpus * self.tdp_kw[models] * run / 3600.0
        return latency, energy

    def candidates(self, task: PendingTask, blocked: np.ndarray) -> list[Candidate]:
        """The top-K feasible device sets for ``task`` on the starting capacity, best first."""
        req = task.request
        # Tasks of one shape share their ranking (waiting time only adds a constant per task).
        key = (
            req.count,
            req.milli_per_gpu,
            req.memory_per_gpu,
            req.vendors,
            req.models,
            req.labels,
            req.min_arch,
            req.interconnect,
            req.gang,
            req.expected_duration_s,
            req.priority,
            task.job_type,
            req.isolation,
            req.profile,
        )
        sets = self._shapes.get(key)
        if sets is None:
            sets = [(c.devices, c.milli, c.memory) for c in self._rank(task, blocked)]
            self._shapes[key] = sets
        out = []
        for devices, milli, memory in sets:
            if milli < MILLI:
                lat, en = self.costs(task, self.index.dev_model[list(devices)], milli / MILLI)
                out.append(Candidate(devices, milli, memory, float(lat[0]), float(en[0])))
            else:
                out.append(self._whole(task, devices))
        return out

    def _rank(self, task: PendingTask, blocked: np.ndarray) -> list[Candidate]:
        idx, req, policy = self.index, task.request, self.policy
        milli = flt.milli_need(req, policy.round_up_fractions)
        frac = milli < MILLI
        elig = flt.eligibility(
            idx, req, fractional=frac, fractions_need_partitioning=policy.fractions_need_partitioning,
            closed=self.closed,
        )
        if frac:
            # Per (eligibility, fraction, blocked devices): the fitting devices, their models and
            # fragmentation term; per task only the per-model latency and energy change.
            frac_key = (id(elig), milli, req.memory_per_gpu, id(blocked))
            ranking: FractionRanking | None = self._fits.get(frac_key)
            if ranking is None or ranking.elig is not elig or ranking.blocked is not blocked:
                fits = ~blocked & flt.fraction_fits(
                    idx, elig.usable, self.free_milli, self.free_mem, milli, req.memory_per_gpu
                )
                devs = np.flatnonzero(fits)
                ranking = FractionRanking(elig, blocked, devs, idx, self.free_milli, milli, self.beta)
                self._fits[frac_key] = ranking
            if len(ranking.devs) == 0:
                return []
            best = ranking.top(self._model_terms(task, milli / MILLI), self.top_k)
            out = []
            for d in best.tolist():
                la, e = self.costs(task, idx.dev_model[[d]], milli / MILLI)
                take_milli, take_mem = flt.fraction_take(idx, d, milli, req.memory_per_gpu)
                out.append(Candidate((d,), take_milli, (take_mem,), float(la[0]), float(e[0])))
            return out
        k = req.count
        # Shapes that differ only in count, topology or priority share the eligible devices'
        # counts (those for k > 1 include the plain count).
        whole_key = (id(elig), id(blocked))
        hit = self._fits.get(whole_key)
        if hit is None:
            fits = elig.usable & ~blocked & (self.free_milli >= MILLI) & (self.free_mem >= idx.dev_mem)
            hit = self._fits[whole_key] = (elig, blocked, fits, node_counts(idx, fits, 2))
        fits, nc = hit[2], hit[3]
        shape_key = (id(elig), id(blocked), k, req.interconnect)
        shape = self._fits.get(shape_key)
        if shape is None:
            nodes = np.flatnonzero(nc.feasible(k, req.interconnect))
            opened = self.node_empty_arr[nodes] * NODE_OPEN_COST
            packing = 0.01 * (nc.count[nodes] - k) / idx.node_size[nodes]
            locality = policy.locality * nc.tier(k)[nodes]
            models = idx.dev_model[idx.node_start[nodes]]
            shape = (elig, blocked, nodes, models, self.beta * opened, packing, locality)
            self._fits[shape_key] = shape
        nodes = shape[2]
        out = []
        if len(nodes):
            # The same sums, in the same order, as α·latency + γ·energy + β·opened + packing +
            # locality per node; latency and energy depend on the node's model only.
            total = self._model_terms(task, float(k))[shape[3]] + shape[4] + shape[5] + shape[6]
            for n in nodes[smallest_k(total, self.top_k)].tolist():
                lo, hi = int(idx.node_start[n]), int(idx.node_start[n + 1])
                cands = (np.flatnonzero(fits[lo:hi]) + lo).tolist()
                chosen = pick_in_node(idx, cands, k, req.interconnect, local=True)
                out.append(self._whole(task, chosen))
        elif req.may_span_nodes and k > 1:
            for order in ("best", "first"):
                gang = pick_nodes(idx, nc.count, k, req.interconnect, order=order)
                if gang is None:
                    break
                chosen = []
                for n, take in gang[0]:
                    lo, hi = int(idx.node_start[n]), int(idx.node_start[n + 1])
                    chosen.extend(
                        pick_in_node(
                            idx,
                            (np.flatnonzero(fits[lo:hi]) + lo).tolist(),
                            take,
                            Interconnect.ANY,
                            local=True,
                        )
                    )
                cand = self._whole(task, chosen)
                if all(c.devices != cand.devices for c in out):
                    out.append(cand)
        return out

    def _model_terms(self, task: PendingTask, share_gpus: float) -> np.ndarray:
        """α · latency + γ · energy of ``task`` on each model (``share_gpus`` GPUs of it)."""
        lat, en = self.costs(task, np.arange(len(self.index.model_names)), share_gpus)
        return self.alpha * lat + self.gamma * en

    def _whole(self, task: PendingTask, devices: Sequence[int]) -> Candidate:
        models = self.index.dev_model[list(devices)]
        slowest = models[[int(np.argmin(self.speed(task)[models]))]]
        lat, en = self.costs(task, slowest, float(len(devices)))
        energy = float(np.sum(self.tdp_kw[models]) / self.tdp_kw[slowest[0]] * en[0]) / len(devices)
        mem = tuple(int(self.index.dev_mem[d]) for d in devices)
        return Candidate(tuple(devices), MILLI, mem, float(lat[0]), energy)

    def cand_of_shares(self, task: PendingTask, shares: Sequence[DeviceShare]) -> Candidate:
        devices = tuple(self.index.pos[s.uuid] for s in shares)
        if shares and shares[0].milli < MILLI:
            lat, en = self.costs(task, self.index.dev_model[list(devices)], shares[0].milli / MILLI)
            return Candidate(
                devices, shares[0].milli, tuple(s.memory_bytes for s in shares), float(lat[0]), float(en[0])
            )
        return self._whole(task, devices)

    def unplaced_latency(self, task: PendingTask, cands: Sequence[Candidate]) -> float:
        slowest = max((c.latency for c in cands), default=None)
        if slowest is None:
            ref = task.request.expected_duration_s or DEFAULT_DURATION_S
            wait = max(0.0, self.now - task.submitted_at)
            slowest = self._weight(task) * (wait + ref / float(self.speed(task).min())) / 3600.0
        return slowest + self._weight(task) * self.defer_s / 3600.0


def _partial(free_milli: int) -> float:
    """Stranded GPUs on a device with ``free_milli`` free (only a partly used device strands any)."""
    return free_milli / MILLI if 0 < free_milli < MILLI else 0.0


class Decoder:
    """Genome → feasible choice per task (with repair) → objective.

    Only devices that appear in candidates of two or more tasks can collide; capacity is tracked
    for those alone, and each candidate's cost on its uncontested devices is precomputed.
    """

    def __init__(self, problem: Problem, cands: list[list[Candidate]], unplaced: list[float]) -> None:
        self.p = problem
        self.cands = cands
        self.unplaced = unplaced
        owners: dict[int, set[int]] = {}
        node_owners: dict[int, set[int]] = {}
        for i, options in enumerate(cands):
            for c in options:
                for d in c.devices:
                    owners.setdefault(d, set()).add(i)
                    node_owners.setdefault(problem.dev_node[d], set()).add(i)
        contested = {d for d, who in owners.items() if len(who) > 1}
        self.contested_nodes = {n for n, who in node_owners.items() if len(who) > 1}
        base = problem.base_milli
        self.fixed: list[list[float]] = []
        self.checks: list[list[tuple[tuple[int, int, int], ...]]] = []
        for options in cands:
            fixed, checks = [], []
            for c in options:
                frag = 0.0
                nodes = set()
                for d in c.devices:
                    if d in contested:
                        continue
                    before, after = base[d], base[d] - c.milli
                    frag += _partial(after) - _partial(before)
                    nodes.add(problem.dev_node[d])
                frag += NODE_OPEN_COST * sum(
                    1 for n in nodes if problem.node_empty[n] and n not in self.contested_nodes
                )
                fixed.append(problem.alpha * c.latency + problem.gamma * c.energy + problem.beta * frag)
                checks.append(
                    tuple((d, c.milli, m) for d, m in zip(c.devices, c.memory, strict=True) if d in contested)
                )
            self.fixed.append(fixed)
            self.checks.append(checks)

    def decode(self, genome: list[int]) -> tuple[list[int], float]:
        p = self.p
        used_milli: dict[int, int] = {}
        used_mem: dict[int, int] = {}
        base_milli, base_mem = p.base_milli, p.base_mem
        total = 0.0
        repaired = list(genome)
        for i, gene in enumerate(genome):
            checks = self.checks[i]
            n = len(checks)
            chosen = -1
            for j in range(gene, gene + n) if gene < n else ():
                j %= n
                if all(
                    base_milli[d] - used_milli.get(d, 0) >= milli and base_mem[d] - used_mem.get(d, 0) >= m
                    for d, milli, m in checks[j]
                ):
                    chosen = j
                    break
            if chosen < 0:
                repaired[i] = n
                total += p.alpha * self.unplaced[i]
                continue
            repaired[i] = chosen
            for d, milli, m in checks[chosen]:
                used_milli[d] = used_milli.get(d, 0) + milli
                used_mem[d] = used_mem.get(d, 0) + m
            total += self.fixed[i][chosen]
        frag = 0.0
        opened = set()
        for d, u in used_milli.items():
            before, after = base_milli[d], base_milli[d] - u
            frag += _partial(after) - _partial(before)
        for i, gene in enumerate(repaired):
            options = self.cands[i]
            if gene < len(options):
                for d in options[gene].devices:
                    node = p.dev_node[d]
                    if node in self.contested_nodes and p.node_empty[node]:
                        opened.add(node)
        return repaired, total + p.beta * (frag + NODE_OPEN_COST * len(opened))

    def terms(self, repaired: list[int]) -> tuple[float, float, float]:
        """(latency h, fragmentation GPUs, energy kWh) of a decoded (repaired) genome, unweighted."""
        latency = energy = 0.0
        used: dict[int, int] = {}
        for i, gene in enumerate(repaired):
            options = self.cands[i]
            if gene >= len(options):
                latency += self.unplaced[i]
                continue
            c = options[gene]
            latency += c.latency
            energy += c.energy
            for d in c.devices:
                used[d] = used.get(d, 0) + c.milli
        base = self.p.base_milli
        frag = sum(_partial(base[d] - u) - _partial(base[d]) for d, u in used.items())
        nodes = {self.p.dev_node[d] for d in used}
        frag += NODE_OPEN_COST * sum(1 for n in nodes if self.p.node_empty[n])
        return latency, frag, energy


def plan_objective(
    plan: PlacementPlan,
    pending: Sequence[PendingTask],
    snapshot: FleetSnapshot,
    policy: Policy,
    *,
    now: float,
    weights: tuple[float, float, float] = (1.0, 1.0, 0.1),
    top_k: int = 6,
    defer_s: float = 4 * 3600.0,
) -> float:
    """The objective :func:`optimise` minimises, for any plan of ``pending`` (lower is better).

    Assigned tasks are charged for the devices the plan gives them; permanently rejected tasks
    are left out (no plan can place them); other unplaced tasks pay the deferral charge.
    """
    index = fleet_index(snapshot)
    problem = Problem(index, snapshot, policy, now, weights, top_k, defer_s)
    assigned = {a.key: a for a in plan.assignments}
    permanent = {r.key for r in plan.rejections if r.permanent}
    tasks = sorted(
        (t for t in {t.key: t for t in pending}.values() if t.key not in permanent),
        key=lambda t: (-t.request.priority, t.submitted_at, t.key),
    )
    blocked = np.zeros(index.n_devices, dtype=bool)
    cands, genome, unplaced = [], [], []
    for task in tasks:
        options = problem.candidates(task, blocked)
        unplaced.append(problem.unplaced_latency(task, options))
        if task.key in assigned:
            cands.append([problem.cand_of_shares(task, assigned[task.key].shares)])
            genome.append(0)
        else:
            cands.append([])
            genome.append(0)
    return Decoder(problem, cands, unplaced).decode(genome)[1]
