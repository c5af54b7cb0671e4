"""Waiting for a faster GPU type: earliest expected completion over the types (heterogeneity-aware).

A single-device job that would start now on a free GPU of a slow type may finish sooner if it
waits for a device of a fast type to free up (its run there is shorter by the throughput table's
ratio). :func:`hold_for_faster` decides that for the waiting jobs of one cycle as list
scheduling by earliest expected completion: in queue order (priority, then submission), each job
takes the device slot — a free device now, or a busy one at its running task's ``expected_end`` —
where it would *finish* first (slot time + its expected run there), and that slot is then the
job's until its expected end. A job whose best slot is not free now is held this cycle: its
request keeps only the types where it would finish no later than there, so the placement finds
no free device for it and the free slow device stays for a job it suits (or for nobody, when
every job would lose by taking it).

It acts only where it can compare: the policy has a throughput table, the job's type is in it,
the job asks for one whole device and has an expected duration (an author's estimate or the
executors' prediction). Busy devices whose running task has no expected end never free up as
far as this rule knows. Everything else is placed as before, so packing without a throughput
table (openb) is unchanged.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from gpusched.model import MILLI, FleetSnapshot
from gpusched.placement.filter import slice_info
from gpusched.placement.index import fleet_index, in_service, usage_arrays
from gpusched.placement.policy import Policy
from gpusched.placement.types import PendingTask, RunningTask

__all__ = ["hold_for_faster"]

_BUSY_FLOOR_S = 1.0
"""The soonest a busy device is taken to free: this long after now."""


def _expected_free(task: RunningTask, now: float) -> float:
    """When ``task`` is expected to free its devices; one past its expected end is expected to run
    as long again as it has run (run times are heavy-tailed: the longer a job has outlived its
    estimate, the longer it is likely to go on); never (inf) without an expected end."""
    if task.expected_end is None:
        return float("inf")
    if task.expected_end > now:
        return max(task.expected_end, now + _BUSY_FLOOR_S)
    return now + max(now - task.started_at, _BUSY_FLOOR_S)


def hold_for_faster(
    pending: Sequence[PendingTask], snapshot: FleetSnapshot, running: Sequence[RunningTask],
    policy: Policy, now: float,
) -> tuple[PendingTask, ...]:
    """``pending`` with each held job's request limited to the GPU models where it would finish
    no later than on its best slot (see the module); every other task unchanged, same order.

    A job's expected duration is its run on the fastest model of the fleet for its type (as the
    placement's speed term reads it, :func:`gpusched.placement.speeds.relative_speeds`).
    """
    if not policy.throughput or not pending:
        return tuple(pending)
    # Slots on the devices placement could give a whole-device job: in service (not unhealthy,
    # cordoned, closed or on a standby node: index.in_service), neither a slice nor a MIG parent.
    index = fleet_index(snapshot)
    info = slice_info(index)
    whole = in_service(index, snapshot.closed) & ~info.is_slice & ~info.mig_parent
    used, _ = usage_arrays(index, snapshot)
    free = np.bincount(index.dev_model[whole & (used <= 0)], minlength=len(index.model_names))
    slots: dict[str, list[float]] = {index.model_names[m]: [now] * int(free[m]) for m in np.flatnonzero(free)}
    ends: dict[int, float] = {}
    for busy in running:
        for share in busy.shares:
            pos = index.pos.get(share.uuid)
            if pos is not None and whole[pos]:
                end = _expected_free(busy, now)
                ends[pos] = max(ends.get(pos, end), end)
    for pos, end in ends.items():
        if end != float("inf"):
            slots.setdefault(index.model_names[index.dev_model[pos]], []).append(end)
    for times in slots.values():
        heapq.heapify(times)
    if len(slots) < 2:
        return tuple(pending)
    held: dict[str, PendingTask] = {}
    ordered = sorted(pending, key=lambda t: (-t.request.priority, t.submitted_at, t.key))
    for task in ordered:
        req = task.request
        row = policy.throughput.get(task.job_type) if task.job_type is not None else None
        if (row is None or req.count != 1 or req.milli_per_gpu < MILLI or req.gang
                or req.expected_duration_s <= 0):
            continue
        models = [m for m in slots
                  if slots[m] and row.get(m, 0.0) > 0 and (not req.models or m in req.models)]
        if len(models) < 2:
            continue
        fastest = max(row[m] for m in models)
        finish = {m: slots[m][0] + req.expected_duration_s * fastest / row[m] for m in models}
        best = min(models, key=lambda m: (finish[m], -row[m], m))
        start = heapq.heappop(slots[best])
        heapq.heappush(slots[best], finish[best])
        if start > now and any(slots[m][0] <= now for m in models if finish[m] > finish[best]):
            keep = frozenset(m for m in models if finish[m] <= finish[best])
            held[task.key] = replace(task, request=replace(req, models=keep))
    return tuple(held.get(t.key, t) for t in pending)
