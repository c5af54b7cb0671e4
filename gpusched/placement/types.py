"""Placement vocabulary: what goes in (pending and running tasks) and what comes out (a plan).

All records are immutable. A :class:`PlacementPlan` names every pending key exactly once, either
in :attr:`PlacementPlan.assignments` or in :attr:`PlacementPlan.rejections`.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpusched.model import DeviceShare
from gpusched.request import GPURequest

__all__ = [
    "Assignment",
    "PendingTask",
    "PlacementPlan",
    "Rejection",
    "Reservation",
    "RunningTask",
]


@dataclass(frozen=True, slots=True)
class PendingTask:
    """A task waiting for devices.

    Attributes:
        key: unique task key (Airflow TaskInstanceKey string, or a trace job id).
        request: what it needs.
        submitted_at: when it started waiting, in seconds (epoch or simulation clock).
        job_type: optional workload class (e.g. ``"resnet50-bs64"``) looked up in
            ``Policy.throughput`` for heterogeneity-aware speed; ``None`` uses the catalog's
            A100-equivalent figures.
        cpu_milli / host_memory_bytes: host CPU (milli-cores) and RAM the task also needs on its
            node (0 = not checked); nodes that declare no CPU/RAM are not checked either.
    """

    key: str
    request: GPURequest
    submitted_at: float
    job_type: str | None = None
    cpu_milli: int = 0
    host_memory_bytes: int = 0


@dataclass(frozen=True, slots=True)
class RunningTask:
    """A task already holding devices (for reservations, backfill, partitions and budgets).

    ``expected_end`` is when it should release its devices (``None`` = unknown: it never frees
    capacity as far as reservations are concerned). ``cpu_milli``/``host_memory_bytes`` are the
    host resources it holds on the node of its first share.
    """

    key: str
    request: GPURequest
    shares: tuple[DeviceShare, ...]
    started_at: float
    expected_end: float | None
    cpu_milli: int = 0
    host_memory_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Assignment:
    """Devices chosen for one pending task.

    ``shares`` has one :class:`DeviceShare` per device (``milli == 1000`` for a whole device,
    below for a fraction). ``score`` is the policy's cost of this choice: lower is better.
    """

    key: str
    shares: tuple[DeviceShare, ...]
    score: float


@dataclass(frozen=True, slots=True)
class Rejection:
    """A pending task left waiting this cycle, and why.

    ``permanent`` is True when the request could never fit, even on the empty fleet (the caller
    should fail the task rather than keep it queued).
    """

    key: str
    reason: str
    permanent: bool


@dataclass(frozen=True, slots=True)
class Reservation:
    """Devices held for a critical task from ``start`` on (when running tasks free them).

    Lower-priority tasks may use these devices before ``start`` only if they are expected to end
    by then (backfill).
    """

    key: str
    shares: tuple[DeviceShare, ...]
    start: float


@dataclass(frozen=True, slots=True)
class PlacementPlan:
    """The outcome of one placement cycle."""

    assignments: tuple[Assignment, ...]
    rejections: tuple[Rejection, ...]
    reservations: tuple[Reservation, ...] = ()

    def assignment(self, key: str) -> Assignment | None:
        """The assignment for ``key``, or None."""
        for item in self.assignments:
            if item.key == key:
                return item
        return None

    def rejection(self, key: str) -> Rejection | None:
        """The rejection for ``key``, or None."""
        for item in self.rejections:
            if item.key == key:
                return item
        return None
