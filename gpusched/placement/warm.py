"""The placement engine kept warm between scheduling cycles: :class:`WarmPlacement`.

:func:`~gpusched.placement.place` builds a new :class:`~gpusched.placement.Placer` for every
call, and a new engine pays for what it has not seen yet: the per-node aggregates of the
fragmentation measure and, under the ``gpusched`` preset, the look-ahead's best placement of
every expected shape on every node (a decision of about 3 ms of CPU at 1,000 nodes, 12 ms at
10,000; ``docs/benchmarks.md``, "Decision latency"). A scheduler that decides every few seconds on a new
snapshot of the same fleet (the Airflow executors' cycles) keeps one engine instead:
``WarmPlacement.place(request)`` rebases the engine it kept on the request's snapshot —
:meth:`Placer.rebase` recomputes only the nodes whose free capacity (devices, host CPU/RAM)
differs from what the engine last held, whether a task started or ended elsewhere or a planned
launch did not happen, or that were closed or opened for this call (the snapshot's ``closed``
nodes: GPU hosts whose worker slots are all busy, placed as if cordoned) — and plans there.

The plan is the one ``place(request)`` gives (``tests/unit/test_placement_warm.py`` replays
seeded cycles both ways). The engine is rebuilt when what it was built from changes: the
inventory (another nodes tuple, see :func:`~gpusched.placement.index.fleet_index`), the policy,
the catalog, or the workload the call scores by (the policy's shapes, else the estimate from
the call's pending and running tasks: a change in the mix of requests means a new engine).
"""

from __future__ import annotations

import threading

from gpusched.catalog import Catalog
from gpusched.placement.engine import Placer, running_host
from gpusched.placement.index import FreeState, fleet_index
from gpusched.placement.policy import Policy
from gpusched.placement.types import PlacementPlan, PlacementRequest
from gpusched.placement.workload import Workload, workload_for

__all__ = ["WarmPlacement"]


class WarmPlacement:
    """``place(request)`` with one engine kept between calls (see the module docstring).

    ``built`` and ``rebased`` count the calls that built a new engine and those that reused the
    kept one. Thread-safe (one call at a time).
    """

    def __init__(self) -> None:
        self._placer: Placer | None = None
        self._built_from: tuple[Policy, Catalog | None, Workload] | None = None
        self._lock = threading.Lock()
        self.built = 0
        self.rebased = 0

    def place(self, request: PlacementRequest) -> PlacementPlan:
        """Plan ``request`` as :func:`~gpusched.placement.place` does, on the kept engine when
        it was built from the same inventory, policy, catalog and workload."""
        requests = [t.request for t in request.pending] + [r.request for r in request.running]
        workload = workload_for(request.policy.workload, requests)
        index = fleet_index(request.snapshot, request.catalog)
        target = FreeState(index, request.snapshot)
        for node, cpu_milli, memory_bytes in running_host(index, request.running):
            target.host_cpu[node] -= cpu_milli
            target.host_mem[node] -= memory_bytes
        with self._lock:
            placer, built_from = self._placer, self._built_from
            same = (
                placer is not None
                and built_from is not None
                and placer.index is index
                and built_from[1] is request.catalog
                and built_from[2] is workload
                and built_from[0] == request.policy
            )
            if placer is None or not same:
                placer = Placer(request.snapshot, request.policy, workload=workload, catalog=request.catalog)
                self._placer, self._built_from = placer, (request.policy, request.catalog, workload)
                self.built += 1
            else:
                self.rebased += 1
            # A new engine holds the snapshot's usage, a kept one the last call's: either way
            # the rebase brings it to this call's (devices and the running tasks' host CPU/RAM).
            placer.rebase(request.snapshot, target)
            # The assignments stay in the engine's state: the next call's snapshot either holds
            # them (launched) or not (held back), and the rebase makes the state agree either way.
            return placer.place(request)
