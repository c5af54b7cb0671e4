"""Per-model speed of a job type: the one rule the greedy chooser and the genetic optimiser share.

:func:`model_speeds` reads ``Policy.speed_of`` (the throughput table when it knows the job type
and the model, else the catalog's A100-equivalent figure) for every model of a fleet index;
:func:`relative_speeds` turns it into the run-time divisor the optimiser's objective uses.
"""

from __future__ import annotations

import numpy as np

from gpusched.model import MILLI
from gpusched.placement.index import FleetIndex
from gpusched.placement.policy import Policy
from gpusched.placement.types import PendingTask

__all__ = ["MIN_RELATIVE_SPEED", "model_speeds", "relative_speeds", "timed", "typed"]

MIN_RELATIVE_SPEED = 1e-3
"""Floor of a relative speed: a model the table gives 0 for counts as 1,000× slower, not infinitely."""


def typed(policy: Policy, job_type: str | None) -> bool:
    """Whether ``policy``'s throughput table knows ``job_type`` (its speeds then rule)."""
    return job_type is not None and job_type in policy.throughput


def timed(policy: Policy, task: PendingTask) -> bool:
    """Whether the task's speed matters to the score: the throughput table knows its job type or
    it has an expected duration (its speed and energy terms apply)."""
    return typed(policy, task.job_type) or task.request.expected_duration_s > 0


def model_speeds(policy: Policy, index: FleetIndex, job_type: str | None) -> np.ndarray:
    """Speed of ``job_type`` on each model of ``index`` (``index.model_names`` order), > 0.

    Units are the throughput table's for a job type it knows (steps/s, say), else A100 = 1.0.
    """
    return np.array([
        max(policy.speed_of(job_type, name, info.a100_equiv_milli if info else MILLI), 1e-9)
        for name, info in zip(index.model_names, index.model_info, strict=True)
    ])


def relative_speeds(policy: Policy, index: FleetIndex, job_type: str | None) -> np.ndarray:
    """Run-time divisor per model: a task of expected duration ``d`` runs ``d / s[m]`` on model m.

    For a job type the table knows, the speed over the fastest model of the fleet (so ``d`` is the
    run time on the fastest GPU the fleet has for it, as the oracle durations of the simulator
    are); otherwise the A100-equivalent figure (``d`` is the run time on an A100). Floored at
    :data:`MIN_RELATIVE_SPEED`.
    """
    speed = model_speeds(policy, index, job_type)
    if typed(policy, job_type) and len(speed):
        speed = speed / float(speed.max())
    return np.maximum(speed, MIN_RELATIVE_SPEED)
