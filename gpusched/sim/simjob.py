"""The simulator's input job (:class:`SimJob`) and the checks and oracle estimates over a job list.

:func:`gpusched.sim.engine.simulate` replays these; ``gpusched.sim.engine`` re-exports them.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace

from gpusched.errors import ConfigurationError
from gpusched.gang import GangMember
from gpusched.request import GPURequest

__all__ = ["SimJob", "check_jobs", "with_expected_durations"]


@dataclass(frozen=True, slots=True)
class SimJob:
    """One job to replay: its request, arrival and run time (per catalog model if it varies).

    ``job_type`` is handed to the placement engine (``PendingTask.job_type``) so a policy with a
    throughput table can prefer the models where this job runs fastest. ``gang``: the job is one
    member (one node) of a multi-node gang; the scheduler starts all members together or none.
    """

    key: str
    request: GPURequest
    arrival_s: float
    duration_s: float
    durations: Mapping[str, float] = field(default_factory=dict)
    job_type: str | None = None
    gang: GangMember | None = None

    def duration_on(self, models: Collection[str]) -> float:
        """Run time on devices of ``models``: the slowest of them (the plain duration if unknown)."""
        return max((self.durations.get(m, self.duration_s) for m in models), default=self.duration_s)


def check_jobs(jobs: Sequence[SimJob]) -> None:
    """Raise :class:`ConfigurationError` (one line) on a duplicate key or a NaN/negative time."""
    seen: set[str] = set()
    for job in jobs:
        if job.key in seen:
            raise ConfigurationError(f"simulate: job key {job.key!r} appears twice; make the ids unique")
        seen.add(job.key)
        times = (job.arrival_s, job.duration_s, *job.durations.values())
        # Run times may be inf (a model the job cannot run on), never NaN or negative.
        if not math.isfinite(job.arrival_s) or any(math.isnan(t) or t < 0 for t in times):
            raise ConfigurationError(
                f"simulate: job {job.key!r} has arrival {job.arrival_s!r} s and run time "
                f"{job.duration_s!r} s; both must be numbers ≥ 0 (the arrival finite)"
            )


def with_expected_durations(jobs: Sequence[SimJob]) -> list[SimJob]:
    """The jobs with ``request.expected_duration_s`` set to their true run time (oracle estimates)."""
    return [
        replace(j, request=replace(j.request, expected_duration_s=max(1, math.ceil(j.duration_s))))
        for j in jobs
    ]
