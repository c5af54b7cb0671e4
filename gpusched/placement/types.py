"""Placement vocabulary: what goes in (one :class:`PlacementRequest`) and what comes out (a plan).

All records are immutable. ``place(PlacementRequest) -> PlacementPlan`` mirrors Ray autoscaler
v2's ``SchedulingRequest -> SchedulingReply``: every input of one placement call travels in the
request, so no caller can leave one out. A :class:`PlacementPlan` names every pending key exactly
once, either in :attr:`PlacementPlan.assignments` or in :attr:`PlacementPlan.rejections`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gpusched.catalog import Catalog
from gpusched.model import DeviceShare, FleetSnapshot
from gpusched.placement.policy import Policy
from gpusched.quota.policy import QuotaState
from gpusched.request import GPURequest

__all__ = [
    "Assignment",
    "PendingTask",
    "PlacementPlan",
    "PlacementRequest",
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
        rank: the queue key within a priority under ``QueueOrder.RANKED`` (lower first; log2
            units, aged like shortest-first), e.g. −log2 of the task's Gittins index
            (:func:`gpusched.durations.service.queue_rank`); ignored by the other orders.
    """

    key: str
    request: GPURequest
    submitted_at: float
    job_type: str | None = None
    cpu_milli: int = 0
    host_memory_bytes: int = 0
    rank: float = 0.0


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


@dataclass(frozen=True, slots=True, kw_only=True)
class PlacementRequest:
    """Every input of one placement call (all but the seed and catalog are required).

    Attributes:
        pending: the tasks waiting for devices.
        snapshot: the fleet now; its usage must already count every running task's shares.
        policy: how to order, filter and score.
        now: the clock (seconds, epoch or simulation), for aging, queue order and reservations.
        quota: partition and budget state; :meth:`QuotaState.unlimited` when no quota is configured
            (required, so a caller cannot drop the quota by forgetting it).
        running: the tasks holding devices (reservations from their ``expected_end``, partition
            use, committed budget, host CPU/RAM use).
        seed: seed of the random policy and random tie-breaks.
        catalog: the accelerator catalog (None = the packaged one).

    ``pending`` and ``running`` are frozen into tuples.
    """

    pending: Sequence[PendingTask]
    snapshot: FleetSnapshot
    policy: Policy
    now: float
    quota: QuotaState
    running: Sequence[RunningTask] = ()
    seed: int = 0
    catalog: Catalog | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "pending", tuple(self.pending))
        object.__setattr__(self, "running", tuple(self.running))


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
    should fail the task rather than keep it queued). ``by_quota``: devices were found, its
    tenant's budget or its partition refused them (:class:`~gpusched.placement.admission.QuotaGate`).
    """

    key: str
    reason: str
    permanent: bool
    by_quota: bool = False


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
    """The reply to one :class:`PlacementRequest`."""

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
