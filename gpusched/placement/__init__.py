"""Placement: pure functions that decide which devices each pending GPU task gets.

``place(PlacementRequest(...))`` → :class:`PlacementPlan` (one request in, one reply out). See
``docs/placement.md`` for the scoring and how to read rejection reasons.
"""

from gpusched.placement.engine import Placer, place
from gpusched.placement.policy import Chooser, Policy, QueueOrder, WorkloadShape
from gpusched.placement.types import (
    Assignment,
    PendingTask,
    PlacementPlan,
    PlacementRequest,
    Rejection,
    Reservation,
    RunningTask,
)

__all__ = [
    "Assignment",
    "Chooser",
    "PendingTask",
    "PlacementPlan",
    "PlacementRequest",
    "Placer",
    "Policy",
    "QueueOrder",
    "Rejection",
    "Reservation",
    "RunningTask",
    "WorkloadShape",
    "place",
]
