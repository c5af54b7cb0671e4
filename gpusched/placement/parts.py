"""The parts a placement profile is composed of, registered by extension point and name.

Modelled on the Kubernetes scheduler framework (a profile enables plugins at extension points —
QueueSort, Filter, Score with weights and NormalizeScore — each plugin a name in a registry of
factories): a profile (:mod:`gpusched.placement.profiles`) names one part for each of the
single-slot points ``queue``, ``chooser`` and ``tiebreak``, and any set of ``filter`` and
weighted ``score`` parts. :data:`PARTS` holds every part; a part declares its parameters
(:class:`Param`: type, bounds, default) and the :class:`~gpusched.placement.policy.Policy`
fields it sets — the frozen record the engine reads is built from a profile's parts
(:meth:`~gpusched.placement.policy.Policy.named`), and the engine dispatches on the chooser part
(``Policy.chooser``; :data:`gpusched.placement.choose.SELECTORS`).

=========  ======================================================================================
point      parts
=========  ======================================================================================
queue      fifo, shortest-first, ranked (after priority, which always comes first)
filter     devices, free, topology, host-resources (always on: hard constraints);
           partitioned-sharing, whole-devices, reservations (optional)
score      fragmentation, locality, speed, energy, degraded (weighted, lower is better)
chooser    exact, levels (read the scores); best-fit, first-fit, random (read none)
tiebreak   earliest, least-left, lookahead (the score choosers only)
=========  ======================================================================================
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType

__all__ = [
    "PARTS", "SCORE_FIELDS", "SINGLE", "Chooser", "Param", "Part", "Point", "QueueOrder", "Value",
]

Value = float | int
"""A parameter's value: a float or, for an integer parameter, an int."""


class Chooser(StrEnum):
    """How a policy picks among feasible nodes/devices (the engine's dispatch key)."""

    SCORE = "score"  # the weighted score: chooser parts exact and levels (gpusched, fgd)
    BEST_FIT = "best-fit"
    FIRST_FIT = "first-fit"
    RANDOM = "random"


class QueueOrder(StrEnum):
    """In which order ``place`` considers pending tasks (after priority, which always comes first)."""

    FIFO = "fifo"  # submission time
    SHORTEST_FIRST = "shortest-first"  # least expected GPU-time first, with aging (see Policy)
    RANKED = "ranked"  # the caller's PendingTask.rank (lower first), with the same aging


class Point(StrEnum):
    """An extension point: where in one decision a part acts."""

    QUEUE = "queue"  # the order pending tasks are considered in
    FILTER = "filter"  # which devices and nodes are feasible
    SCORE = "score"  # weighted terms of a candidate's score (lower is better)
    CHOOSER = "chooser"  # how the candidates become one choice (and how the score is normalised)
    TIEBREAK = "tiebreak"  # which of the candidates a score chooser ties picks


SINGLE = (Point.QUEUE, Point.CHOOSER, Point.TIEBREAK)
"""The points a profile has exactly one part of (the tie-break: with a score chooser only)."""

SCORE_FIELDS = ("fragmentation", "locality", "speed", "energy", "degraded_penalty")
"""The Policy fields of the score parts' weights: 0 where a score chooser's profile leaves a part out."""


@dataclass(frozen=True, slots=True)
class Param:
    """One parameter of a part: the Policy field it sets, its default and its bounds."""

    name: str
    field: str
    default: Value
    doc: str
    integer: bool = False
    minimum: float = 0.0
    above: bool = False  # strictly above ``minimum``

    def accepts(self) -> str:
        """What the parameter takes, in words, e.g. ``an integer ≥ 1 (default 16)``."""
        kind = "an integer" if self.integer else "a number"
        bound = f"> {self.minimum:g}" if self.above else f"≥ {self.minimum:g}"
        return f"{kind} {bound}, default {self.default:g}"

    def parse(self, raw: str) -> Value | None:
        """``raw`` as this parameter's value, or None when it is not one (wrong type, out of bounds)."""
        text = raw.strip()
        value: Value
        try:
            value = int(text) if self.integer else float(text)
        except ValueError:
            return None
        if not math.isfinite(value) or value < self.minimum or (self.above and value == self.minimum):
            return None
        return value


_NONE: Mapping[str, object] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class Part:
    """A named part at one extension point: its parameters and the Policy fields it sets.

    ``sets`` are fixed field values; each :class:`Param` sets its field to the value given (or its
    default). ``off`` are the field values when a profile leaves an optional filter out. ``always``
    marks the filters every profile has (hard constraints, not switchable)."""

    point: Point
    name: str
    doc: str
    params: tuple[Param, ...] = ()
    sets: Mapping[str, object] = field(default_factory=lambda: _NONE)
    off: Mapping[str, object] = field(default_factory=lambda: _NONE)
    always: bool = False

    def param(self, name: str) -> Param | None:
        """The parameter called ``name`` (None if the part has none of that name)."""
        return next((p for p in self.params if p.name == name), None)

    def accepts(self) -> str:
        """The parameters in words, for an error message."""
        if not self.params:
            return "no parameters"
        return ", ".join(f"{p.name} ({p.accepts()})" for p in self.params)

    @property
    def reads_scores(self) -> bool:
        """Whether this chooser picks by the score parts (exact and levels); tie-breaks apply to it."""
        return self.sets.get("chooser") is Chooser.SCORE

    def fields(self, values: Mapping[str, Value]) -> dict[str, object]:
        """The Policy fields this part sets with parameter ``values`` (defaults where missing)."""
        out = dict(self.sets)
        for p in self.params:
            out[p.field] = values.get(p.name, p.default)
        return out


def _aging() -> Param:
    return Param("aging", "aging_per_hour", 0.0, "priority points a waiting task gains per hour")


def _halving() -> Param:
    return Param("halving_s", "service_halving_s", 86400.0,
                 "seconds of waiting that halve a task's effective GPU-time (aging)", above=True)


def _weight(field_name: str, default: float, doc: str) -> Param:
    return Param("weight", field_name, default, doc)


_ALL: tuple[Part, ...] = (
    # ---- queue (QueueSort) --------------------------------------------------------------------
    Part(Point.QUEUE, "fifo", "submission order within a priority",
         (_aging(),), MappingProxyType({"queue_order": QueueOrder.FIFO})),
    Part(Point.QUEUE, "shortest-first",
         "least expected GPU-time (expected duration × GPUs) first within a priority, aged so that "
         "nothing starves",
         (_halving(),
          Param("unknown_s", "unknown_service_s", 3600.0,
                "GPU-seconds assumed for a task without an expected duration", above=True),
          _aging()),
         MappingProxyType({"queue_order": QueueOrder.SHORTEST_FIRST})),
    Part(Point.QUEUE, "ranked", "the caller's PendingTask.rank (lower first; preemption = service "
         "ranks by the Gittins index), aged as shortest-first",
         (_halving(), _aging()), MappingProxyType({"queue_order": QueueOrder.RANKED})),
    # ---- filter (Filter) ----------------------------------------------------------------------
    Part(Point.FILTER, "devices", "vendor, model, architecture, labels and memory of the request; "
         "healthy, uncordoned, not on a standby node; slices only for hard isolation", always=True),
    Part(Point.FILTER, "free", "the share asked for is free now (devices under a reservation only "
         "for tasks that end before it starts)", always=True),
    Part(Point.FILTER, "topology", "the request's interconnect: one island, NUMA node, node or rack "
         "(gangs all-or-nothing)", always=True),
    Part(Point.FILTER, "host-resources", "the task's host CPU and RAM are free on the node",
         always=True),
    Part(Point.FILTER, "partitioned-sharing", "a fraction only on a model with a partitioning "
         "mechanism (MIG, MPS, vendor partitions); trace replays of clusters that shared anyway "
         "turn it off", sets=MappingProxyType({"fractions_need_partitioning": True}),
         off=MappingProxyType({"fractions_need_partitioning": False})),
    Part(Point.FILTER, "whole-devices", "a fractional request takes a whole free device (a pool "
         "slot)", sets=MappingProxyType({"round_up_fractions": True}),
         off=MappingProxyType({"round_up_fractions": False})),
    Part(Point.FILTER, "reservations", "a critical task that cannot fit reserves the devices that "
         "free up earliest; later tasks use them only if they end before (backfill)",
         (Param("critical_priority", "critical_priority", 100,
                "the priority from which a task may hold a reservation", integer=True),),
         MappingProxyType({"reservations": True}), MappingProxyType({"reservations": False})),
    # ---- score (Score, with weights) ----------------------------------------------------------
    Part(Point.SCORE, "fragmentation", "the expected fragmentation the placement adds over the "
         "workload's request shapes (FGD), per GPU",
         (_weight("fragmentation", 1.0, "per GPU of fragmented capacity"),)),
    Part(Point.SCORE, "locality", "topology tier: 0 one island or PCIe switch, 1 one NUMA node, "
         "2 one node, 3 one rack, 4 several racks",
         (_weight("locality", 0.6, "per tier"),)),
    Part(Point.SCORE, "speed", "slowness, 1 − speed / fastest eligible speed (throughput table or "
         "catalog), for tasks of known run time",
         (_weight("speed", 1.0, "per unit of slowness"),)),
    Part(Point.SCORE, "energy", "TDP per unit of speed relative to the most efficient eligible "
         "model, for tasks of known run time",
         (_weight("energy", 0.01, "per unit of relative energy"),)),
    Part(Point.SCORE, "degraded", "DEGRADED devices chosen (used last)",
         (_weight("degraded_penalty", 5.0, "per DEGRADED device"),)),
    # ---- chooser (NormalizeScore and selection) -----------------------------------------------
    Part(Point.CHOOSER, "exact", "the lowest weighted score wins",
         sets=MappingProxyType({"chooser": Chooser.SCORE, "score_levels": 0})),
    Part(Point.CHOOSER, "levels", "the FGD scheduler's integer node score int(levels · "
         "sigmoid(−score)); the highest level wins",
         (Param("levels", "score_levels", 100, "integer score levels", integer=True, minimum=2),),
         MappingProxyType({"chooser": Chooser.SCORE})),
    Part(Point.CHOOSER, "best-fit", "the node (and device) with the least free capacity left; "
         "for a task with host CPU, the published BestFit key in whole hundredths",
         sets=MappingProxyType({"chooser": Chooser.BEST_FIT, "score_levels": 0})),
    Part(Point.CHOOSER, "first-fit", "the first fitting node in inventory order, no topology or "
         "model preference", sets=MappingProxyType({"chooser": Chooser.FIRST_FIT, "score_levels": 0})),
    Part(Point.CHOOSER, "random", "a uniformly random fitting node, then a random device of it "
         "(seeded)", sets=MappingProxyType({"chooser": Chooser.RANDOM, "score_levels": 0})),
    # ---- tiebreak -----------------------------------------------------------------------------
    Part(Point.TIEBREAK, "earliest", "the earliest candidate in inventory order (FGD: the lowest "
         "node name)",
         sets=MappingProxyType({"packing": 0.0, "lookahead_ties": 0, "lookahead_widen": 0})),
    Part(Point.TIEBREAK, "least-left", "the candidate leaving its node the least free capacity "
         "(among scores equal to 1e-9, or at the top level)",
         sets=MappingProxyType({"packing": 1.0, "lookahead_ties": 0, "lookahead_widen": 0})),
    Part(Point.TIEBREAK, "lookahead", "a one-step look-ahead: the candidate that leaves the next "
         "request of the workload's shapes the least fragmentation (chooser levels only)",
         (Param("ties", "lookahead_ties", 16, "tied candidates compared (one per node)",
                integer=True, minimum=1),
          Param("widen", "lookahead_widen", 0, "levels below the top a lone top node is compared "
                "with (for fractions and tasks of unknown run time)", integer=True)),
         MappingProxyType({"packing": 0.0})),
)

PARTS: Mapping[Point, Mapping[str, Part]] = MappingProxyType({
    point: MappingProxyType({p.name: p for p in _ALL if p.point is point}) for point in Point
})
"""Every part, by extension point and name (in the order the docs list them)."""
