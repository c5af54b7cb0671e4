"""The GPU-time a task instance's earlier tries attained, read from the ledger (``preemption = service``).

Tiresias ranks a job by all the GPU-time it has received, not only its current run: a try
requeued after a preemption must not look like a fresh job, or it would win the devices straight
back (thrashing). The simulator keeps each job's served time across its runs
(:mod:`gpusched.sim.service`); the executor reads the same from the ledger: every allocation of
an earlier try of the same task instance (dag, task, run and map index; try number lower), each
counted as GPU-seconds of its own request (:func:`~gpusched.durations.service.gpu_seconds` of
``released_at - created_at``; a still-active one until now). A move's hold that was abandoned
never ran and counts nothing.

:class:`AttainedService` caches the sum per try once every earlier try's allocation is released
(it cannot change after that), so a waiting task costs one ledger read when it is first seen.

The same ledger rows tell whether an earlier try was stopped by preemption
(:func:`preempted_before`): the preemptor does not stop such a try again before it has
checkpointed (:attr:`gpusched.placement.preemption.PreemptionRequest.restarted`); and when the
task instance was first queued (:func:`first_queued`): a later try waits in the queue as if it had
been queued then, so the queue's aging counts from the task's first try, as the simulator's
requeued job keeps its arrival. Without that a job preempted after a long wait would start over
behind newcomers, and a multi-GPU job stopped for smaller work would wait for a whole node with
no age to claim one (measured in docs/lab-notebook.md, 2026-12-03).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from gpusched.durations.service import gpu_seconds
from gpusched.scheduler.keys import KEY_PREFIX, TaskKeyParts, parse_ti_key

__all__ = [
    "PREEMPTED_REASON", "AttainedService", "attained_before", "first_queued", "identity",
    "instance_allocations", "preempted_before",
]

T = TypeVar("T")

_NEVER_RAN = "migration abandoned"  # a move's hold whose try never started (gpu_migration)
PREEMPTED_REASON = "preempted"
"""How the release reason of a preemption victim begins (written by gpusched.airflow.gpu_preemption)."""


def identity(parts: TaskKeyParts) -> tuple[str, str, str, int]:
    """The task instance of a try: (dag, task, run, map index)."""
    return parts.dag_id, parts.task_id, parts.run_id, parts.map_index


def attained_before(key: str, allocations: Iterable[Any], now: float) -> tuple[float, bool]:
    """GPU-seconds that the tries of ``key``'s task instance before ``key``'s try held devices,
    among ``allocations``, and whether all of those allocations are released (the sum is final)."""
    parts = parse_ti_key(key)
    if parts is None:
        return 0.0, True
    total, final = 0.0, True
    for alloc in allocations:
        other = parse_ti_key(alloc.key)
        if other is None or identity(other) != identity(parts) or other.try_number >= parts.try_number:
            continue
        if alloc.released_at is None:
            final = False
        elif str(alloc.release_reason or "").startswith(_NEVER_RAN):
            continue
        end = now if alloc.released_at is None else float(alloc.released_at)
        total += gpu_seconds(alloc.request, end - float(alloc.created_at))
    return total, final


def preempted_before(key: str, allocations: Iterable[Any]) -> bool:
    """True when an earlier try of ``key``'s task instance, among ``allocations``, was released
    because it was preempted."""
    parts = parse_ti_key(key)
    if parts is None:
        return False
    for alloc in allocations:
        other = parse_ti_key(alloc.key)
        if (other is not None and identity(other) == identity(parts) and other.try_number < parts.try_number
                and str(alloc.release_reason or "").startswith(PREEMPTED_REASON)):
            return True
    return False


Instance = tuple[str, str, str, int]
"""A task instance: (dag, task, run, map index)."""


def first_queued(key: str, allocations: Iterable[Any]) -> float | None:
    """When the first of the earlier tries of ``key``'s task instance among ``allocations`` was
    queued (its ``queued_at``, else its start), or None without an earlier try."""
    parts = parse_ti_key(key)
    if parts is None:
        return None
    times = [float(a.queued_at if a.queued_at is not None else a.created_at) for a in allocations
             if (o := parse_ti_key(a.key)) is not None and identity(o) == identity(parts)
             and o.try_number < parts.try_number]
    return min(times, default=None)


def instance_allocations(ledger: Any, wanted: Iterable[TaskKeyParts]) -> dict[Instance, list[Any]]:
    """Every allocation (all tries) of the task instances of ``wanted``, by (dag, task, run, map
    index), oldest first: one ledger read."""
    patterns = {(f"{KEY_PREFIX}{p.dag_id}/{p.task_id}/{p.map_index}/", f"/{p.run_id}") for p in wanted}
    by_instance: dict[Instance, list[Any]] = {}
    for alloc in ledger.history_of(patterns):
        parts = parse_ti_key(alloc.key)
        if parts is not None:
            by_instance.setdefault(identity(parts), []).append(alloc)
    return by_instance


class AttainedService:
    """Per-try cache of :func:`attained_before` over the ledger (see the module docstring)."""

    def __init__(self) -> None:
        self._final: dict[str, float] = {}
        self._preempted: dict[str, bool] = {}
        self._queued: dict[str, float | None] = {}

    def earlier_tries(self, ledger: Any, keys: Sequence[str], now: float) -> dict[str, float]:
        """Key -> GPU-seconds attained by the earlier tries of its task instance (keys that are
        not Airflow tries, or first tries, map to 0). Keeps in its cache only ``keys``."""
        out: dict[str, float] = {}
        wanted: dict[str, TaskKeyParts] = {}
        for key in keys:
            parts = parse_ti_key(key)
            if parts is None or parts.try_number <= 1:
                out[key] = 0.0
            elif key in self._final:
                out[key] = self._final[key]
            else:
                wanted[key] = parts
        self._final = {k: v for k, v in self._final.items() if k in out}
        if wanted:
            by_instance = instance_allocations(ledger, wanted.values())
            for key, parts in wanted.items():
                total, final = attained_before(key, by_instance.get(identity(parts), ()), now)
                out[key] = total
                if final:
                    self._final[key] = total
        return out

    def restarted(self, ledger: Any, keys: Sequence[str]) -> frozenset[str]:
        """Those of ``keys`` (running tries) whose task instance had an earlier try preempted
        (:func:`preempted_before`). A try's answer cannot change while it runs, so it is read from
        the ledger once; the cache keeps only ``keys``."""
        self._preempted = _once_per_try(self._preempted, ledger, keys, preempted_before, False)
        return frozenset(k for k, hit in self._preempted.items() if hit)

    def first_queued(self, ledger: Any, keys: Sequence[str]) -> dict[str, float]:
        """Key → when its task instance's first try was queued, for those of ``keys`` (later tries)
        that have an earlier try in the ledger (:func:`first_queued`); read once per try, the cache
        keeps only ``keys``."""
        self._queued = _once_per_try(self._queued, ledger, keys, first_queued, None)
        return {k: at for k, at in self._queued.items() if at is not None}


def _once_per_try(
    cache: dict[str, T], ledger: Any, keys: Sequence[str],
    answer: Callable[[str, Sequence[Any]], T], default: T,
) -> dict[str, T]:
    """``cache`` completed with ``answer(key, allocations of its task instance)`` for each later try
    among ``keys`` not in it yet (one ledger read for all of them), kept for ``keys`` only (first
    tries and keys that are not tries: ``default``). For answers that cannot change during a try."""
    wanted = {key: parts for key in keys
              if key not in cache and (parts := parse_ti_key(key)) is not None and parts.try_number > 1}
    if wanted:
        by_instance = instance_allocations(ledger, wanted.values())
        for key, parts in wanted.items():
            cache[key] = answer(key, by_instance.get(identity(parts), ()))
    return {k: cache.get(k, default) for k in keys}
