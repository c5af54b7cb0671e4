"""What a replay returns: the started jobs' records, the usage timeline and the run's counters.

Made by :func:`gpusched.sim.engine.simulate` (which re-exports these types); read by
:mod:`gpusched.sim.metrics`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpusched.model import DeviceShare, FleetSnapshot

__all__ = ["JobRecord", "RunSegment", "SimResult", "TimelinePoint"]

RunSegment = tuple[float, float, tuple[DeviceShare, ...]]
"""One run of a job: ``(start, end, shares)``; a job that was stopped and restarted has several."""


@dataclass(frozen=True, slots=True)
class JobRecord:
    """What happened to one started job.

    ``start_s`` is its first start, ``end_s`` its final end and ``shares`` the devices of its last
    run. A job stopped and restarted (preempted, or stopped at its tenant's budget) held devices
    only in its ``runs``, not while it waited in between: count its GPU use with :attr:`segments`.
    """

    key: str
    arrival_s: float
    start_s: float
    end_s: float
    shares: tuple[DeviceShare, ...]
    models: tuple[str, ...]
    preemptions: int = 0
    runs: tuple[RunSegment, ...] = ()  # every run, the last included; () = one run start_s–end_s

    @property
    def segments(self) -> tuple[RunSegment, ...]:
        """The job's runs ``(start, end, shares)``: the time it held devices."""
        return self.runs or ((self.start_s, self.end_s, self.shares),)

    @property
    def queue_delay_s(self) -> float:
        """Time from arrival to start."""
        return self.start_s - self.arrival_s

    @property
    def jct_s(self) -> float:
        """Job completion time: end − arrival."""
        return self.end_s - self.arrival_s


@dataclass(frozen=True, slots=True)
class TimelinePoint:
    """Fleet state from ``t`` until the next point: milli-GPU in use and jobs waiting."""

    t: float
    used_milli: int
    waiting: int


@dataclass
class SimResult:
    """Outcome of one replay.

    Attributes:
        records: started jobs (finished ones have ``end_s`` ≤ ``end_time``).
        rejected: key → reason for jobs the engine said can never fit.
        unstarted: keys of arrived jobs still waiting when the run stopped.
        not_arrived: jobs whose arrival lies after the stop (``stop_after`` runs).
        timeline: piecewise-constant usage, one point per change.
        capacity_milli: total milli-GPU of the fleet.
        end_time: simulated time when the run stopped.
        place_calls / place_seconds: how often and how long :func:`place` ran (wall clock,
            including the genetic re-plans).
        replans / replans_improved: genetic re-plans run, and those that beat the greedy plan.
    """

    policy: str
    fleet: FleetSnapshot
    records: list[JobRecord]
    rejected: dict[str, str]
    unstarted: list[str]
    timeline: list[TimelinePoint]
    capacity_milli: int
    end_time: float
    not_arrived: int = 0
    place_calls: int = 0
    place_seconds: float = 0.0
    replans: int = 0
    replans_improved: int = 0
    quota: dict[str, Any] | None = None
    durations: dict[str, Any] | None = None
    preemption: dict[str, Any] | None = None
