"""Placement profiles: every preset as a composition of named parts, and how a setting changes one.

A :class:`Profile` names its parts (:mod:`gpusched.placement.parts`): one queue order, the
optional filters it switches on (the hard constraints are always on), its weighted scores, one
chooser and — for a score chooser — one tie-break, each with its parameters. :data:`PROFILES` is
the one source of every preset; :meth:`gpusched.placement.policy.Policy.named` builds the frozen
record the engine reads from a profile's :meth:`Profile.fields`.

:meth:`Profile.with_parts` applies the ``[gpusched] policy_parts`` text: comma-separated
``key=value`` items —

* ``queue=fifo``, ``chooser=exact``, ``tiebreak=earliest``: swap the part of a single-slot point
  (its parameters start from their defaults);
* ``queue.halving_s=43200``, ``chooser.levels=50``, ``tiebreak.ties=8``: a parameter of that
  point's part;
* ``score.locality=0.5`` (or ``score.locality.weight=0.5``): a score's weight; ``on`` = its
  default weight, ``off`` or ``0`` leaves it out;
* ``filter.reservations=on|off``; ``filter.reservations.critical_priority=50``: an optional filter
  and its parameters.

Part swaps apply first, then switches and weights, then parameters, so the order of the items
does not matter. A wrong point, part or parameter, a bad value, or a combination that would do
nothing (a score under a chooser that reads none) is a one-line ConfigurationError naming what
is accepted.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from gpusched.errors import ConfigurationError
from gpusched.placement.parts import PARTS, SCORE_FIELDS, SINGLE, Part, Point, Value

__all__ = ["DEFAULT_SCORE_LEVELS", "PROFILES", "SETTING", "Profile", "Use", "profile"]

SETTING = "[gpusched] policy_parts"
"""Where :meth:`Profile.with_parts` says an error comes from, by default."""

# The ``gpusched`` preset's integer score: half FGD's 100 levels, so candidates whose scores
# differ by less than about 0.08 GPU of fragmentation near zero tie and the look-ahead, which
# judges the next request's placement, decides between them. Chosen on the development openb
# lists and checked on held-out and unseen ones (docs/benchmarks.md, "gpusched preset").
DEFAULT_SCORE_LEVELS = 50


@dataclass(frozen=True, slots=True)
class Use:
    """One part as a profile uses it: the part and its parameters' values (defaults where not given)."""

    part: Part
    values: Mapping[str, Value] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:  # every parameter's value, given or default: equal uses compare equal
        full = {p.name: self.values.get(p.name, p.default) for p in self.part.params}
        object.__setattr__(self, "values", MappingProxyType(full))

    @classmethod
    def of(cls, point: Point, name: str, **values: Value) -> Use:
        """The part ``name`` at ``point`` with ``values`` (KeyError/ValueError: not registered)."""
        part = PARTS[point][name]
        unknown = sorted(set(values) - {p.name for p in part.params})
        if unknown:
            raise ValueError(f"{point} {name} has no parameter(s) {unknown}; it accepts {part.accepts()}")
        return cls(part, MappingProxyType(dict(values)))

    @property
    def name(self) -> str:
        """The part's name."""
        return self.part.name

    def value(self, name: str) -> Value:
        """The value of parameter ``name`` (its default where not given; KeyError: no such parameter)."""
        return self.values[name]

    def given(self, name: str, value: Value) -> Use:
        """This use with parameter ``name`` set to ``value``."""
        return Use(self.part, MappingProxyType({**self.values, name: value}))

    def fields(self) -> dict[str, object]:
        """The Policy fields this use sets."""
        return self.part.fields(self.values)

    def text(self) -> str:
        """``name(param=value, ...)`` with every parameter's value, or the bare name."""
        if not self.part.params:
            return self.part.name
        return f"{self.part.name}({', '.join(f'{p.name}={self.value(p.name):g}' for p in self.part.params)})"


@dataclass(frozen=True, slots=True)
class Profile:
    """A preset: its parts, and a line on what it is for (docs/placement.md, "Profiles and parts").

    ``filters`` are the optional filters switched on (the ``always`` ones are implicit);
    ``scores`` and ``tiebreak`` only with a chooser that reads scores (exact, levels)."""

    name: str
    summary: str
    queue: Use
    chooser: Use
    filters: tuple[Use, ...] = ()
    scores: tuple[Use, ...] = ()
    tiebreak: Use | None = None

    def __post_init__(self) -> None:
        problem = _problem(self.queue, self.chooser, self.filters, self.scores, self.tiebreak)
        if problem is not None:
            raise ValueError(f"profile {self.name}: {problem}")

    def uses(self) -> tuple[Use, ...]:
        """Every part it uses (the always-on filters left out), in point order."""
        tail = () if self.tiebreak is None else (self.tiebreak,)
        return (self.queue, *self.filters, *self.scores, self.chooser, *tail)

    def fields(self) -> dict[str, object]:
        """The :class:`~gpusched.placement.policy.Policy` fields of this profile.

        An optional filter left out sets its ``off`` values; under a score chooser a score left
        out weighs 0. Fields no part sets keep the Policy's defaults: the data fields
        (throughput, workload, host_task_workload), and under first-fit, best-fit and random
        the score weights (which only the genetic re-planner's locality term reads there)."""
        out: dict[str, object] = {"name": self.name}
        for part in PARTS[Point.FILTER].values():
            out.update(part.off)
        if self.chooser.part.reads_scores:
            out.update(dict.fromkeys(SCORE_FIELDS, 0.0))
        for use in self.uses():
            out.update(use.fields())
        return out

    def describe(self) -> str:
        """One line: each point and its parts with their parameters."""
        always = [p.name for p in PARTS[Point.FILTER].values() if p.always]
        items = [f"queue={self.queue.text()}",
                 f"filter={', '.join([*always, *(u.text() for u in self.filters)])}"]
        if self.scores:
            weights = [f"{u.name}×{u.value('weight'):g}" for u in self.scores]
            items.append(f"score={', '.join(weights)}")
        items.append(f"chooser={self.chooser.text()}")
        if self.tiebreak is not None:
            items.append(f"tiebreak={self.tiebreak.text()}")
        return "; ".join(items)

    def with_parts(self, text: str, *, where: str = SETTING) -> Profile:
        """This profile changed by ``text`` (the ``policy_parts`` syntax, module docstring).

        Raises:
            ConfigurationError: one line naming the item, the part and what it accepts.
        """
        return _Edit(self, where).apply(_items(text, where))


def _problem(
    queue: Use, chooser: Use, filters: tuple[Use, ...], scores: tuple[Use, ...], tiebreak: Use | None
) -> str | None:
    """What is inconsistent about a profile of these parts (None: nothing)."""
    placed = ((queue, Point.QUEUE), (chooser, Point.CHOOSER), *((u, Point.FILTER) for u in filters),
              *((u, Point.SCORE) for u in scores), *(((tiebreak, Point.TIEBREAK),) if tiebreak else ()))
    for use, point in placed:
        if use.part.point is not point:
            return f"{use.name} is a {use.part.point} part, not a {point} part"
    if any(u.part.always for u in filters):
        return "the always-on filters are not listed"
    for group in (filters, scores):
        if len({u.name for u in group}) != len(group):
            return "a part is listed twice"
    name = chooser.name
    if chooser.part.reads_scores:
        if not scores:
            return f"chooser {name} needs at least one score part, e.g. score.fragmentation=1"
        if tiebreak is None:
            return f"chooser {name} needs a tiebreak part"
        if tiebreak.name == "lookahead" and name != "levels":
            return (f"tiebreak lookahead needs chooser=levels (it breaks the integer score's ties), "
                    f"the chooser is {name}; swap it too, e.g. tiebreak=earliest")
    elif scores or tiebreak is not None:
        return f"chooser {name} reads no score or tie-break parts"
    return None


def _items(text: str, where: str) -> list[tuple[str, str]]:
    """``text`` as (key, value) pairs: comma- or newline-separated ``key=value`` items."""
    out: list[tuple[str, str]] = []
    for item in (s.strip() for s in re.split(r"[,\n]", text)):
        if not item:
            continue
        key, eq, raw = item.partition("=")
        key, raw = key.strip().lower(), raw.strip()
        if not eq or not key or not raw:
            raise ConfigurationError(
                f"{where}: {item!r} is not key=value; e.g. score.locality=0.5, tiebreak=earliest"
            )
        if any(k == key for k, _ in out):
            raise ConfigurationError(f"{where}: {key} is given twice; give each key once")
        out.append((key, raw))
    return out


class _Edit:
    """The parts of a profile while ``policy_parts`` items are applied to them."""

    def __init__(self, base: Profile, where: str) -> None:
        self.base, self.where = base, where
        self.slots: dict[Point, Use | None] = {
            Point.QUEUE: base.queue, Point.CHOOSER: base.chooser, Point.TIEBREAK: base.tiebreak
        }
        self.filters = {u.name: u for u in base.filters}
        self.scores = {u.name: u for u in base.scores}

    def fail(self, message: str) -> ConfigurationError:
        return ConfigurationError(f"{self.where}: {message}")

    def apply(self, items: list[tuple[str, str]]) -> Profile:
        parsed = [(key, key.split("."), raw) for key, raw in items]
        for key, path, _ in parsed:
            self.point(path[0], key)
            if len(path) > (2 if path[0] in SINGLE else 3):
                raise self.fail(
                    f"{key} is not a part or a parameter; write point=part, point.param=value, "
                    f"score.name=weight, filter.name=on|off or filter.name.param=value"
                )
        # Swaps first (the chooser before the others: it says whether scores apply), then
        # switches and weights, then parameters: the order of the items does not matter.
        for point in SINGLE:
            for _, path, raw in parsed:
                if path == [point]:
                    self.swap(point, raw)
        for key, path, raw in parsed:
            if len(path) == 2 and path[0] == Point.FILTER:
                self.switch(key, path[1], raw)
            elif len(path) in (2, 3) and path[0] == Point.SCORE:
                self.weight(key, path[1:], raw)
        for key, path, raw in parsed:
            if len(path) == 2 and path[0] in SINGLE:
                self.set_param(key, Point(path[0]), path[1], raw)
            elif len(path) == 3 and path[0] == Point.FILTER:
                self.filter_param(key, path[1], path[2], raw)
        return self.result()

    def point(self, name: str, key: str) -> Point:
        try:
            return Point(name)
        except ValueError:
            raise self.fail(
                f"{name!r} (in {key}) is not an extension point; use {', '.join(p.value for p in Point)}"
            ) from None

    def part(self, point: Point, name: str) -> Part:
        part = PARTS[point].get(name)
        if part is None:
            raise self.fail(f"{point} {name!r} is not a part; {point} accepts: {', '.join(PARTS[point])}")
        return part

    def swap(self, point: Point, name: str) -> None:
        part = self.part(point, name.lower())
        if point is Point.CHOOSER and not part.reads_scores:
            self.scores.clear()
            self.slots[Point.TIEBREAK] = None
        elif point is Point.CHOOSER and self.slots[Point.TIEBREAK] is None:
            self.slots[Point.TIEBREAK] = Use.of(Point.TIEBREAK, "earliest")
        if point is Point.TIEBREAK:
            self.need_scores(f"tiebreak={name}")
        self.slots[point] = Use(part)

    def need_scores(self, key: str) -> None:
        chooser = self.slots[Point.CHOOSER]
        if chooser is None or not chooser.part.reads_scores:
            raise self.no_scores(key)

    def no_scores(self, key: str) -> ConfigurationError:
        chooser = self.slots[Point.CHOOSER]
        return self.fail(
            f"{key} does nothing: chooser {chooser.name if chooser else '?'} reads no score or "
            f"tie-break parts; use it with chooser=exact or chooser=levels"
        )

    def switch(self, key: str, name: str, raw: str) -> None:
        part = self.part(Point.FILTER, name)
        if part.always:
            optional = [p.name for p in PARTS[Point.FILTER].values() if not p.always]
            raise self.fail(
                f"filter {name} is always on (a hard constraint); the optional filters are: "
                f"{', '.join(optional)}"
            )
        flag = raw.lower()
        if flag not in ("on", "off"):
            raise self.fail(f"{key} = {raw!r} is not on or off; filter {name} is switched with on or off")
        if flag == "on":
            self.filters.setdefault(name, Use(part))
        else:
            self.filters.pop(name, None)

    def weight(self, key: str, path: list[str], raw: str) -> None:
        name = path[0]
        part = self.part(Point.SCORE, name)
        if len(path) == 2 and path[1] != "weight":
            raise self.fail(f"score {name} has no parameter {path[1]!r}; it accepts {part.accepts()}")
        self.need_scores(key)
        param = part.params[0]
        text = raw.lower()
        if text in ("on", "off"):
            value: Value | None = param.default if text == "on" else 0.0
        else:
            value = param.parse(raw)
        if value is None:
            raise self.fail(f"{key} = {raw!r} is not valid; the weight of score {name} takes "
                            f"{param.accepts()}, on or off")
        if value:
            self.scores[name] = Use(part).given("weight", float(value))
        else:
            self.scores.pop(name, None)

    def set_param(self, key: str, point: Point, name: str, raw: str) -> None:
        use = self.slots[point]
        if use is None:  # a tie-break under a chooser that reads no scores
            raise self.no_scores(key)
        self.slots[point] = self.given(key, point, use, name, raw)

    def filter_param(self, key: str, filter_name: str, name: str, raw: str) -> None:
        part = self.part(Point.FILTER, filter_name)
        use = self.filters.get(filter_name)
        if use is None:
            state = "always on and has no parameters" if part.always else \
                f"off in profile {self.base.name}; switch it on with filter.{filter_name}=on"
            raise self.fail(f"{key}: filter {filter_name} is {state}")
        self.filters[filter_name] = self.given(key, Point.FILTER, use, name, raw)

    def given(self, key: str, point: Point, use: Use, name: str, raw: str) -> Use:
        param = use.part.param(name)
        if param is None:
            raise self.fail(f"{point} {use.name} has no parameter {name!r}; it accepts {use.part.accepts()}")
        value = param.parse(raw)
        if value is None:
            raise self.fail(
                f"{key} = {raw!r} is not valid; {name} of {point} {use.name} takes {param.accepts()}"
            )
        return use.given(name, value)

    def result(self) -> Profile:
        queue, chooser, tiebreak = (self.slots[p] for p in SINGLE)
        assert queue is not None and chooser is not None
        filters = tuple(u for name, u in _ordered(Point.FILTER, self.filters))
        scores = tuple(u for name, u in _ordered(Point.SCORE, self.scores))
        problem = _problem(queue, chooser, filters, scores, tiebreak)
        if problem is not None:
            raise self.fail(problem)
        return replace(self.base, queue=queue, chooser=chooser, filters=filters, scores=scores,
                       tiebreak=tiebreak)


def _ordered(point: Point, uses: Mapping[str, Use]) -> list[tuple[str, Use]]:
    """``uses`` in the registry's order of ``point``'s parts."""
    return [(name, uses[name]) for name in PARTS[point] if name in uses]


def _score(name: str, weight: float) -> Use:
    return Use.of(Point.SCORE, name, weight=weight)


_FIFO = Use.of(Point.QUEUE, "fifo")
_SHARING = Use.of(Point.FILTER, "partitioned-sharing")
_FGD_SCORES = (_score("fragmentation", 1.0), _score("degraded", 5.0))
_FGD_LEVELS = Use.of(Point.CHOOSER, "levels", levels=100)

_FGD = Profile(
    "fgd", "fragmentation only (Weng et al., ATC '23), with the published scheduler's integer node "
    "score; ties to the earliest node. To compare with the published FGD (the openb harness gives "
    "it FGD's 95 % typical pods).",
    queue=_FIFO, chooser=_FGD_LEVELS, filters=(_SHARING,), scores=_FGD_SCORES,
    tiebreak=Use.of(Point.TIEBREAK, "earliest"),
)
_FGD_LOOKAHEAD = replace(
    _FGD, name="fgd-lookahead", summary="fgd-full whose ties at the top integer score go to a "
    "one-step look-ahead (16 tied candidates bound its work per decision).",
    tiebreak=Use.of(Point.TIEBREAK, "lookahead", ties=16, widen=0),
)

PROFILES: Mapping[str, Profile] = MappingProxyType({
    "gpusched": Profile(
        "gpusched", "topology locality + fragmentation (FGD-style, model-aware) + heterogeneity-"
        "aware speed + energy as a coarse integer score, ties broken by a one-step look-ahead "
        "(widened by two levels for fractions and tasks of unknown run time); reservations for "
        "critical tasks with backfill; shortest expected GPU-time first with aging.",
        queue=Use.of(Point.QUEUE, "shortest-first"),
        chooser=Use.of(Point.CHOOSER, "levels", levels=DEFAULT_SCORE_LEVELS),
        filters=(_SHARING, Use.of(Point.FILTER, "reservations", critical_priority=100)),
        scores=(_score("fragmentation", 1.0), _score("locality", 0.6), _score("speed", 1.0),
                _score("energy", 0.01), _score("degraded", 5.0)),
        tiebreak=Use.of(Point.TIEBREAK, "lookahead", ties=16, widen=2),
    ),
    "random": Profile("random", "a uniformly random feasible node and devices (seeded).",
                      queue=_FIFO, chooser=Use.of(Point.CHOOSER, "random"), filters=(_SHARING,)),
    "first-fit": Profile(
        "first-fit", "count-based like Airflow pools: the first node in inventory order with enough "
        "free devices; a fractional request takes a whole device (a pool slot).",
        queue=_FIFO, chooser=Use.of(Point.CHOOSER, "first-fit"),
        filters=(_SHARING, Use.of(Point.FILTER, "whole-devices")),
    ),
    "best-fit": Profile("best-fit", "the node (and device) with the least free capacity that still "
                        "fits (for tasks with host CPU, the published BestFit's CPU+GPU key).",
                        queue=_FIFO, chooser=Use.of(Point.CHOOSER, "best-fit"), filters=(_SHARING,)),
    "fgd": _FGD,
    # The same rule as ``fgd``; the openb harness hands it every exact pod class, not FGD's
    # typical ones (gpusched.sim.openb).
    "fgd-full": replace(_FGD, name="fgd-full", summary="the fgd rule scored against the workload's "
                        "whole shape distribution (the openb harness gives it every exact class)."),
    "fgd-lookahead": _FGD_LOOKAHEAD,
    # ``fgd-lookahead`` whose harness shapes carry host RAM for GPU tasks only (gpusched.sim.openb).
    "fgd-memory": replace(_FGD_LOOKAHEAD, name="fgd-memory", summary="fgd-lookahead whose expected "
                          "shapes carry host RAM for GPU tasks (the openb harness's); CPU-only "
                          "tasks are judged by the shapes without RAM."),
})
"""Every preset, the default first (``Policy.names()`` lists them in this order)."""


def profile(name: str) -> Profile | None:
    """The profile called ``name`` (any case, surrounding blanks ignored), or None."""
    return PROFILES.get(name.strip().lower())
