"""Batch re-planning with a genetic algorithm (DEAP), warm-started from the greedy plan.

:func:`optimise` takes a batch of pending tasks (one :class:`PlacementRequest`) and minimises

    α · latency  +  β · fragmentation  +  γ · energy

over joint assignments, where, per task, *latency* is its waiting time plus its expected
runtime on the chosen model (hours, weighted by priority; a task left unplaced is charged its
slowest runtime plus ``defer_s``), *fragmentation* is the capacity stranded on partly used
devices plus a charge for breaking into an untouched node (GPUs), and *energy* is TDP × runtime
× share (kWh).

Encoding: per task, an index into a short list of feasible device sets (the top-K by the same
objective, computed once on the starting free capacity with the placement filter and topology
helpers), or "unplaced". Decoding walks the tasks in priority order and repairs: a set that
collides with capacity already taken falls through to the task's next candidate that fits, so
every decoded plan respects memory, architecture, topology and never double-books. The
repaired genome is written back (Lamarckian repair).

Tasks greedy placed stay placed (the GA may move them to other devices); tasks greedy left
waiting may be placed when the batch leaves room. The greedy plan is evaluated with the same
objective and seeds the population; the result is never worse than it — greedy is returned
when the GA found nothing better. With quotas in force the GA neither places a task the quota
refused in the greedy plan nor returns a plan the quota would refuse (a device of another model
costs its tenant another number of A100-hours): such a plan yields to greedy. The GA stops at
``budget_ms`` (wall clock, counted from the call) or after ``max_generations``. With a seed and
a generation cap that binds before the budget, the result is deterministic.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpusched.errors import ConfigurationError
from gpusched.model import DeviceShare
from gpusched.placement.admission import QuotaGate
from gpusched.placement.engine import place
from gpusched.placement.ga_objective import Candidate, Decoder, Problem, plan_objective
from gpusched.placement.index import fleet_index
from gpusched.placement.types import Assignment, PendingTask, PlacementPlan, PlacementRequest, Rejection
from gpusched.quota.policy import physical_milli

__all__ = ["OptimiseResult", "optimise", "optimise_with_report", "parse_weights", "plan_objective"]


def parse_weights(text: str, *, where: str) -> tuple[float, float, float]:
    """The objective weights (α latency, β fragmentation, γ energy) from ``"1,1,0.1"``.

    Raises:
        ConfigurationError: naming ``where`` the text came from and the expected form.
    """
    try:
        alpha, beta, gamma = (float(part.strip()) for part in text.split(","))
    except ValueError:
        raise ConfigurationError(
            f"{where} = {text!r} is not three numbers; "
            "write latency,fragmentation,energy weights such as '1,1,0.1'"
        ) from None
    return alpha, beta, gamma


@dataclass(frozen=True, slots=True)
class OptimiseResult:
    """The chosen plan and how the search went (objective values: lower is better)."""

    plan: PlacementPlan
    greedy: PlacementPlan
    greedy_objective: float
    objective: float
    improved: bool
    generations: int
    evaluations: int
    elapsed_ms: float
    greedy_ms: float
    greedy_terms: tuple[float, float, float] = (0.0, 0.0, 0.0)
    terms: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """(latency h, fragmentation GPUs, energy kWh), unweighted, of greedy's plan and of the result."""
    refused_by_quota: bool = False
    """The search found a better plan that the quota refused; greedy's plan stands."""

    def describe(self) -> str:
        """The change against greedy in words, e.g. ``fragmentation 3.0 → 1.0 GPUs, energy 0.42 →
        0.40 kWh (objective -23%)``: the terms that moved, then the weighted gain."""
        names = (("latency", "h", 2), ("fragmentation", "GPUs", 1), ("energy", "kWh", 2))
        pairs = zip(names, self.greedy_terms, self.terms, strict=True)
        moved = [f"{name} {before:.{digits}f} → {after:.{digits}f} {unit}"
                 for (name, unit, digits), before, after in pairs
                 if round(before, digits) != round(after, digits)]
        return f"{', '.join(moved) or 'same terms'} (objective -{self.gain_pct:.0f}% against greedy)"

    @property
    def gain_pct(self) -> float:
        """Objective reduction against greedy, in percent (0 when greedy was kept)."""
        if not self.greedy_objective:
            return 0.0
        return 100.0 * (self.greedy_objective - self.objective) / abs(self.greedy_objective)


def optimise(
    request: PlacementRequest,
    *,
    budget_ms: float = 100.0,
    weights: tuple[float, float, float] = (1.0, 1.0, 0.1),
    greedy: PlacementPlan | None = None,
    **kwargs: Any,
) -> PlacementPlan:
    """The best plan for ``request`` found within ``budget_ms``; never worse than the greedy plan.

    ``weights`` = (α latency, β fragmentation, γ energy). Pass ``greedy`` when the caller
    already has this cycle's greedy plan (``place(request)``: it is then not recomputed and not
    counted against the budget). With ``request.quota.enforced`` the result also passes the
    quota (see the module's docstring). Other keywords go to :func:`optimise_with_report`.
    """
    return optimise_with_report(request, budget_ms=budget_ms, weights=weights, greedy=greedy, **kwargs).plan


def optimise_with_report(
    request: PlacementRequest,
    *,
    budget_ms: float = 100.0,
    weights: tuple[float, float, float] = (1.0, 1.0, 0.1),
    greedy: PlacementPlan | None = None,
    population: int = 24,
    max_generations: int = 200,
    top_k: int = 6,
    defer_s: float = 4 * 3600.0,
) -> OptimiseResult:
    """:func:`optimise` with the search statistics (see :class:`OptimiseResult`)."""
    from deap import base, creator, tools

    began = time.perf_counter()
    greedy_ms = 0.0
    pending, snapshot, policy, now, seed = (
        request.pending, request.snapshot, request.policy, request.now, request.seed
    )
    if greedy is None:
        greedy = place(request)
        greedy_ms = (time.perf_counter() - began) * 1000.0
        began = time.perf_counter()
    deadline = began + 0.92 * budget_ms / 1000.0  # leave room to build the plan and for jitter
    index = fleet_index(snapshot)
    problem = Problem(index, snapshot, policy, now, weights, top_k, defer_s)
    by_key = {t.key: t for t in pending}
    assigned = {a.key: a for a in greedy.assignments}
    rejected = {r.key: r for r in greedy.rejections}
    blocked = np.zeros(index.n_devices, dtype=bool)
    for res in greedy.reservations:
        blocked[[index.pos[s.uuid] for s in res.shares if s.uuid in index.pos]] = True
    # Tasks the GA may move: greedy's assigned ones, and waiting ones that could fit at all and
    # that no quota refused.
    tasks = [
        by_key[k]
        for k in dict.fromkeys(t.key for t in pending)
        if k in assigned or (k in rejected and not rejected[k].permanent and not rejected[k].by_quota)
    ]
    tasks.sort(key=lambda t: (-t.request.priority, t.submitted_at, t.key))
    cands: list[list[Candidate]] = []
    start_genome: list[int] = []
    unplaced: list[float] = []
    # Candidate lists are the non-interruptible part of the setup: past half the budget, the
    # remaining tasks keep greedy's choice only, so the search still gets its share of the budget.
    setup_deadline = began + 0.5 * budget_ms / 1000.0
    for task in tasks:
        options = problem.candidates(task, blocked) if time.perf_counter() < setup_deadline else []
        unplaced.append(problem.unplaced_latency(task, options))
        if task.key in assigned:
            own = problem.cand_of_shares(task, assigned[task.key].shares)
            match = next(
                (i for i, c in enumerate(options) if c.devices == own.devices and c.milli == own.milli), None
            )
            if match is None:
                options.insert(0, own)
                match = 0
            start_genome.append(match)
        else:
            start_genome.append(len(options))
        cands.append(options)
    decoder = Decoder(problem, cands, unplaced)
    _, greedy_value = decoder.decode(start_genome)
    if not any(cands):  # nothing can move (a full fleet): no search, greedy stands
        terms = decoder.terms(decoder.decode(start_genome)[0])
        elapsed = (time.perf_counter() - began) * 1000.0
        return OptimiseResult(greedy, greedy, greedy_value, greedy_value, False, 0, 1, elapsed, greedy_ms,
                              terms, terms)

    state = random.getstate()
    random.seed(seed)
    try:
        best_genome, best_value, generations, evaluations = _search(
            decoder, start_genome, deadline, population, max_generations, base, creator, tools
        )
    finally:
        random.setstate(state)
    improved = best_value < greedy_value - 1e-9
    plan = _to_plan(greedy, tasks, cands, best_genome, problem) if improved else greedy
    refused = improved and request.quota.enforced and not _quota_admits(plan, request)
    if refused:
        plan, improved = greedy, False
    elapsed = (time.perf_counter() - began) * 1000.0
    greedy_terms = decoder.terms(decoder.decode(start_genome)[0])
    return OptimiseResult(
        plan,
        greedy,
        greedy_value,
        best_value if improved else greedy_value,
        improved,
        generations,
        evaluations,
        elapsed,
        greedy_ms,
        greedy_terms,
        decoder.terms(decoder.decode(best_genome)[0]) if improved else greedy_terms,
        refused,
    )


def _quota_admits(plan: PlacementPlan, request: PlacementRequest) -> bool:
    """Whether every assignment of ``plan`` passes the quota, the batch admitted in priority
    order (then submission), as the greedy engine admits its own."""
    gate = QuotaGate(request.snapshot, request.quota, request.running, request.pending, request.now)
    shares = {a.key: a.shares for a in plan.assignments}
    order = sorted({t.key: t for t in request.pending}.values(),
                   key=lambda t: (-t.request.priority, t.submitted_at, t.key))
    for task in order:
        if task.key not in shares:
            gate.done(task.request)
        elif gate.admit(task, shares[task.key], physical_milli(shares[task.key], request.snapshot),
                        request.now) is not None:
            return False
    return True


def _search(
    decoder: Decoder,
    start: list[int],
    deadline: float,
    size: int,
    max_gen: int,
    base: Any,
    creator: Any,
    tools: Any,
) -> tuple[list[int], float, int, int]:
    if not hasattr(creator, "GpuschedFitness"):
        creator.create("GpuschedFitness", base.Fitness, weights=(-1.0,))
        creator.create("GpuschedIndividual", list, fitness=creator.GpuschedFitness)
    n = len(start)
    if n == 0:
        return start, decoder.decode(start)[1], 0, 1
    limits = [len(c) for c in decoder.cands]
    # Only tasks greedy left waiting may be drawn "unplaced": deferring work greedy could start
    # trades a certain start now for an uncertain one later, which one batch cannot judge.
    deferrable = [start[i] >= limits[i] for i in range(n)]
    cache: dict[tuple[int, ...], tuple[list[int], float]] = {}
    evaluations = 0

    def evaluate(ind: Any) -> None:
        nonlocal evaluations
        key = tuple(ind)
        hit = cache.get(key)
        if hit is None:
            evaluations += 1
            genome, value = decoder.decode(list(ind))
            if any(genome[i] >= limits[i] and not deferrable[i] for i in range(n)):
                # Repair can push a task greedy placed out of the plan when others took its
                # capacity; such a plan delays work that could start now, so it never wins.
                value = math.inf
            hit = (genome, value)
            cache[key] = hit
        ind[:] = hit[0]
        ind.fitness.values = (hit[1],)

    def mutate(ind: Any, rate: float) -> None:
        for i in range(n):
            if random.random() < rate and limits[i]:
                defer = deferrable[i] and random.random() < 0.05
                ind[i] = limits[i] if defer else random.randrange(limits[i])
        del ind.fitness.values

    toolbox = base.Toolbox()
    toolbox.register("select", tools.selTournament, tournsize=3)
    toolbox.register("mate", tools.cxTwoPoint)
    pop = [creator.GpuschedIndividual(start), creator.GpuschedIndividual([0] * n)]
    while len(pop) < size:
        ind = creator.GpuschedIndividual(start)
        mutate(ind, 2.0 / n)
        pop.append(ind)
    evaluated: list[Any] = []
    for ind in pop:  # the start genome first: it is always evaluated, even past the deadline
        if evaluated and time.perf_counter() >= deadline:
            break
        evaluate(ind)
        evaluated.append(ind)
    pop = evaluated
    best = tools.selBest(pop, 1)[0]
    generation = 0
    last = 0.0  # duration of the latest generation: do not start one that would overrun
    while generation < max_gen and time.perf_counter() + last < deadline:
        began = time.perf_counter()
        generation += 1
        elite = [creator.GpuschedIndividual(b) for b in tools.selBest(pop, 2)]
        for e, src in zip(elite, tools.selBest(pop, 2), strict=True):
            e.fitness.values = src.fitness.values
        offspring = [creator.GpuschedIndividual(o) for o in toolbox.select(pop, len(pop) - 2)]
        for a, b in zip(offspring[::2], offspring[1::2], strict=False):
            if random.random() < 0.7 and n > 1:
                toolbox.mate(a, b)
        for ind in offspring:
            mutate(ind, 1.5 / n)
            evaluate(ind)
        pop = elite + offspring
        challenger = tools.selBest(pop, 1)[0]
        if challenger.fitness.values[0] < best.fitness.values[0]:
            best = challenger
        last = time.perf_counter() - began
    return list(best), float(best.fitness.values[0]), generation, evaluations


def _to_plan(
    greedy: PlacementPlan,
    tasks: list[PendingTask],
    cands: list[list[Candidate]],
    genome: list[int],
    problem: Problem,
) -> PlacementPlan:
    devices = problem.index.devices
    moved = {t.key for t in tasks}
    assignments = [a for a in greedy.assignments if a.key not in moved]
    rejections = [r for r in greedy.rejections if r.key not in moved]
    greedy_rej = {r.key: r for r in greedy.rejections}
    for task, options, gene in zip(tasks, cands, genome, strict=True):
        if gene >= len(options):
            earlier = greedy_rej.get(task.key)
            rejections.append(
                earlier
                or Rejection(
                    task.key,
                    "deferred by the batch optimiser: its capacity serves the batch better this "
                    "cycle; it is planned again next cycle",
                    False,
                )
            )
            continue
        c = options[gene]
        shares = tuple(
            DeviceShare(devices[d].uuid, devices[d].node, devices[d].index, c.milli, m)
            for d, m in zip(c.devices, c.memory, strict=True)
        )
        score = problem.alpha * c.latency + problem.gamma * c.energy
        assignments.append(Assignment(task.key, shares, float(score) if math.isfinite(score) else 0.0))
    return PlacementPlan(tuple(assignments), tuple(rejections), greedy.reservations)
