"""Placement policies: the frozen record the engine reads, built from a profile of named parts.

A :class:`Policy` is a frozen record of weights and switches; :func:`gpusched.placement.place`
reads it. ``Policy.named(name)`` builds it from the preset's profile
(:data:`gpusched.placement.profiles.PROFILES`: one queue order, filters, weighted scores, one
chooser and tie-break, each a named part of :mod:`gpusched.placement.parts`), the one source of
every preset: ``gpusched`` (the default), ``fgd``, ``fgd-full``, ``fgd-lookahead``,
``fgd-memory``, ``best-fit``, ``first-fit`` and ``random`` (their summaries are
``Profile.summary``; docs/placement.md, "Profiles and parts", tabulates them).
``Policy.configured(name, parts)`` is the same with the ``[gpusched] policy_parts`` changes (a
weight, a part swapped), as the executor reads its settings.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType

from gpusched.errors import ConfigurationError, PlacementError
from gpusched.placement.parts import Chooser, QueueOrder
from gpusched.placement.profiles import DEFAULT_SCORE_LEVELS, PROFILES, SETTING, Profile, profile

__all__ = ["DEFAULT_SCORE_LEVELS", "Chooser", "Policy", "QueueOrder", "WorkloadShape"]


@dataclass(frozen=True, slots=True)
class WorkloadShape:
    """One class of request in the expected workload, for the fragmentation measure.

    ``count`` devices of ``milli`` each (``milli < 1000`` only with ``count == 1``), seen with
    relative frequency ``weight``. With ``cpu_milli``/``host_memory_bytes`` the shape also needs
    that much host CPU/RAM on the node: GPU capacity on a node whose CPU or RAM is exhausted then
    counts as fragmented too (as in FGD). ``models`` (catalog model names; empty = any) are the
    models the shape may run on: all free capacity of a node of another model counts as fragmented
    for it, so the measure keeps scarce models for the tasks pinned to them (FGD's ``gpu_spec``).
    """

    count: int
    milli: int
    weight: float
    cpu_milli: int = 0
    host_memory_bytes: int = 0
    models: frozenset[str] = frozenset()


_EMPTY: Mapping[str, Mapping[str, float]] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class Policy:
    """Weights and switches of the placement engine (lower score is better).

    Attributes:
        name: preset name (free text for custom policies).
        chooser: how candidates are picked (see :class:`Chooser`).
        fragmentation: weight of the fragmentation increase, per GPU of fragmented capacity.
        locality: weight per topology tier (0 one island / PCIe switch, 1 one NUMA node, 2 one
            node, 3 one rack, 4 several racks).
        speed: weight of slowness (1 − speed / fastest eligible speed); applied to tasks with an
            expected duration or a throughput-table entry, where running faster matters.
        energy: weight of energy per unit of work (TDP / speed, relative to the least); like
            ``speed``, applied to tasks with an expected duration or a throughput-table entry.
        packing: when > 0, among candidates of equal score (to 1e-9) take the one leaving the
            least free capacity on its node (a best-fit tie-breaker that never outweighs the
            fragmentation, locality or speed terms).
        degraded_penalty: added per DEGRADED device chosen (they are used last).
        score_levels: when > 0, the published FGD scheduler's node score: each candidate's score
            ``s`` (fragmentation increase in GPUs plus the other terms) becomes the integer
            ``int(score_levels × sigmoid(−s))``, the highest wins and ties go to the earliest
            node (then device) in inventory order — the Kubernetes scheduler of the FGD simulator
            breaks ties by the lowest node name. 0 = the exact score, lowest wins.
        lookahead_ties: with ``score_levels``, how many of the candidates tied at the highest
            integer score (the first, one per node) a one-step look-ahead compares: the one that
            leaves the next request of the workload's shapes the least fragmentation wins
            (:mod:`gpusched.placement.lookahead`); 0 = the earliest, as FGD.
        lookahead_widen: with ``lookahead_ties``, when the candidates at the highest integer score
            are all on one node, the look-ahead also compares that node with the nodes up to this
            many levels below whose score differs from its own only in fragmentation (locality,
            speed and energy are never traded for it); 0 = the top level only, as FGD.
        throughput: optional ``{job_type: {model: speed}}`` table (any unit, per job type).
        workload: expected request shapes for the fragmentation measure; empty = estimated from
            the pending and running tasks of the call, blended with a default prior.
        host_task_workload: the shapes a CPU-only task's placement is judged by
            (:mod:`gpusched.placement.host_only`); empty = ``workload``. ``fgd-memory`` gives GPU
            tasks shapes with host RAM and CPU-only tasks the same shapes without it.
        reservations: whether critical tasks (priority ≥ ``critical_priority``) reserve devices
            that free up earliest, with backfill by shorter tasks.
        critical_priority: the priority from which a task may hold a reservation.
        aging_per_hour: priority points a waiting task gains per hour of waiting (0 = pure
            priority order, then submission time).
        queue_order: after priority, the order pending tasks are considered in (see
            :class:`QueueOrder`). ``shortest-first`` takes the least expected GPU-time
            (``expected_duration_s`` × count) first; a task without an estimate counts as
            ``unknown_service_s``; every ``service_halving_s`` of waiting halves a task's
            effective GPU-time, so a long task beats a brand-new short one after
            ``service_halving_s × log2(long / short)`` of waiting and nothing starves.
            ``ranked`` takes each task's ``PendingTask.rank`` (lower first, log2 units) with
            the same aging (``preemption = service`` ranks by the Gittins index).
        service_halving_s: the aging constant of ``shortest-first`` and ``ranked``.
        unknown_service_s: the GPU-time assumed for a task without an expected duration.
        round_up_fractions: place a fractional request on a whole device (count-based pools).
        fractions_need_partitioning: allow device sharing only on models the catalog lists with
            a partitioning mechanism (MIG, MPS, vendor partitions). Trace replays of clusters
            that shared devices anyway (openb) turn this off.
    """

    name: str = "gpusched"
    chooser: Chooser = Chooser.SCORE
    fragmentation: float = 1.0
    locality: float = 0.6
    speed: float = 1.0
    energy: float = 0.01
    packing: float = 0.0
    degraded_penalty: float = 5.0
    score_levels: int = 0
    lookahead_ties: int = 0
    lookahead_widen: int = 0
    throughput: Mapping[str, Mapping[str, float]] = field(default_factory=lambda: _EMPTY)
    workload: tuple[WorkloadShape, ...] = ()
    host_task_workload: tuple[WorkloadShape, ...] = ()
    reservations: bool = True
    critical_priority: int = 100
    aging_per_hour: float = 0.0
    queue_order: QueueOrder = QueueOrder.SHORTEST_FIRST
    service_halving_s: float = 86400.0
    unknown_service_s: float = 3600.0
    round_up_fractions: bool = False
    fractions_need_partitioning: bool = True

    @classmethod
    def named(cls, name: str, **overrides: object) -> Policy:
        """The preset called ``name`` (its profile, :data:`~gpusched.placement.profiles.PROFILES`),
        with optional field overrides.

        Raises:
            PlacementError: for an unknown name, listing the known ones, or an unknown field.
        """
        found = profile(name)
        if found is None:
            raise PlacementError(f"unknown placement policy {name!r}; use one of: {', '.join(cls.names())}")
        return cls.of(found, **overrides)

    @classmethod
    def configured(cls, name: str, parts: str = "", *, where: str = SETTING, **overrides: object) -> Policy:
        """The preset ``name`` changed by ``parts`` (the ``[gpusched] policy_parts`` text, e.g.
        ``score.locality=0.5, tiebreak=earliest``; :meth:`Profile.with_parts`), with optional
        field overrides (the executor's throughput table); ``where`` names the source of ``parts``
        in an error (``--policy-parts`` on the command line).

        Raises:
            ConfigurationError: one line, for an unknown preset or a wrong part, parameter or value.
        """
        found = profile(name)
        if found is None:
            raise ConfigurationError(
                f"[gpusched] policy = {name!r} is not a placement policy; "
                f"use one of: {', '.join(cls.names())}"
            )
        return cls.of(found.with_parts(parts, where=where), **overrides)

    @classmethod
    def of(cls, preset: Profile, **overrides: object) -> Policy:
        """The record of the profile ``preset`` (:meth:`Profile.fields`), with optional field overrides.

        Raises:
            PlacementError: for a field the record does not have.
        """
        valid = {f.name for f in fields(cls)}
        unknown = set(overrides) - valid
        if unknown:
            raise PlacementError(f"unknown Policy field(s) {sorted(unknown)}; valid fields: {sorted(valid)}")
        base = cls(**preset.fields())  # type: ignore[arg-type]
        return replace(base, **overrides) if overrides else base  # type: ignore[arg-type]

    @staticmethod
    def names() -> tuple[str, ...]:
        """Names accepted by :meth:`named`, the default first."""
        return tuple(PROFILES)

    def speed_of(self, job_type: str | None, model: str, a100_equiv_milli: int) -> float:
        """Relative speed of ``job_type`` on ``model``: the throughput table if it knows both,
        else the catalog's A100-equivalent figure."""
        if job_type is not None:
            row = self.throughput.get(job_type)
            if row is not None and model in row:
                return float(row[model])
        return a100_equiv_milli / 1000.0

