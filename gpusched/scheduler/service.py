"""Mode ``service`` (Tiresias-style): the queue ordered, and victims chosen, by expected remaining service.

Every driver runs the same two rules over its cycle's request; only where the run-time history
comes from is the driver's (:class:`ServiceIndex`: the executors read the ledger's finished runs,
:attr:`gpusched.scheduler.durations.DurationHistory.service`; the simulator learns from the jobs
finished so far in the replay, :mod:`gpusched.sim.service`):

- :func:`service_ranked`: each pending work's queue rank is −log2 of its Gittins index
  (:func:`gpusched.durations.service.queue_rank`) at the service its task attained in earlier
  runs (``CycleRequest.attained_gpu_s``), and the queue order is ``QueueOrder.RANKED`` (the
  placement engine ages the ranks, so nothing starves);
- :func:`service_indices`: the indices a victim selection compares — of the waiting work, aged
  by its wait (:func:`~gpusched.durations.service.aged_index`), and of the running work at the
  service attained by its earlier runs plus its current run.

Attained service is GPU-time (GPUs × share × seconds), counting every earlier run in full, the
work lost since a checkpoint included, as Tiresias counts it: counting only the checkpointed
work would rank a victim that lost its last half hour as fresh again, and it would take the
devices straight back.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from gpusched.durations.service import ServiceHistory, aged_index, gpu_seconds, queue_rank
from gpusched.placement.policy import QueueOrder
from gpusched.request import GPURequest
from gpusched.scheduler.cycle import CycleRequest

__all__ = ["NamedHistory", "ServiceIndex", "service_indices", "service_ranked"]


class ServiceIndex(Protocol):
    """A driver's run-time history, asked for Gittins index values (unaged)."""

    def index_values(self, work: Sequence[tuple[str, GPURequest, float]]) -> list[float]:
        """The index value of each ``(key, request, attained GPU-s)``."""
        ...


@dataclass(frozen=True, slots=True)
class NamedHistory:
    """A :class:`ServiceIndex` over ``history``, each work's prediction group named from its key
    by ``name_of`` (the executors: ``dag_id/task_id``, :func:`gpusched.scheduler.durations.task_name`)."""

    history: ServiceHistory
    name_of: Callable[[str], str]

    def index_values(self, work: Sequence[tuple[str, GPURequest, float]]) -> list[float]:
        named = [(request, self.name_of(key), attained) for key, request, attained in work]
        return self.history.index_values(named)


def service_ranked(request: CycleRequest, index: ServiceIndex) -> CycleRequest:
    """``request`` with its queue ordered by the Gittins index of each pending work at the service
    its task attained in earlier runs (``QueueOrder.RANKED``)."""
    if not request.pending:
        return request
    before = request.attained_gpu_s
    values = index.index_values([(w.key, w.request, before.get(w.key, 0.0)) for w in request.pending])
    pending = tuple(w.with_rank(queue_rank(v)) for w, v in zip(request.pending, values, strict=True))
    ranked = request.policy
    if ranked.queue_order is not QueueOrder.RANKED:
        ranked = replace(ranked, queue_order=QueueOrder.RANKED)
    return replace(request, pending=pending, policy=ranked)


def service_indices(request: CycleRequest, index: ServiceIndex,
                    waiting: Collection[str] | None = None) -> dict[str, float]:
    """Key → Gittins index of the pending work (of the keys in ``waiting``; None: all of it),
    aged by its wait, and of the running work at its attained service now (earlier runs plus the
    current one)."""
    before = request.attained_gpu_s
    now = request.now
    pending = [w for w in request.pending if waiting is None or w.key in waiting]
    items = [(w.key, w.request, before.get(w.key, 0.0)) for w in pending]
    items += [(r.key, r.request, before.get(r.key, 0.0) + gpu_seconds(r.request, now - r.started_at))
              for r in request.running]
    values = index.index_values(items)
    halving = request.policy.service_halving_s
    out = {w.key: aged_index(v, now - w.submitted_at, halving) for w, v in zip(pending, values, strict=False)}
    out.update({r.key: v for r, v in zip(request.running, values[len(pending):], strict=True)})
    return out
