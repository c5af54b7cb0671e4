"""Where a CPU-only task goes: one node with enough host CPU and RAM, chosen by the policy.

A task without devices (the openb trace's CPU-only pods) still takes host CPU and RAM that GPU
tasks need, so scoring policies place it where the expected fragmentation of GPU capacity grows
least. The measure is over ``Policy.host_task_workload`` when the policy sets one (the shapes
CPU-only decisions are judged by may leave out a resource that GPU decisions count; see
``fgd-memory`` in :mod:`gpusched.placement.policy`), else over the policy's workload.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from gpusched.model import MILLI
from gpusched.placement.choose import PlacerView, left_after
from gpusched.placement.index import FreeState
from gpusched.placement.policy import Chooser
from gpusched.placement.score import FragStats
from gpusched.placement.ties import levels_best
from gpusched.placement.types import PendingTask
from gpusched.request import GPURequest

__all__ = ["choose_host_node"]

_ANY_GPU = GPURequest()


class HostPlacerView(PlacerView, Protocol):
    """What :func:`choose_host_node` reads of the engine besides :class:`PlacerView`."""

    @property
    def state(self) -> FreeState:
        """The working free capacity."""
        ...

    @property
    def host_stats(self) -> FragStats:
        """Fragmentation statistics CPU-only tasks are scored by."""
        ...


def choose_host_node(
    placer: HostPlacerView, cpu_milli: int, host_memory_bytes: int, *, seed: int = 0
) -> str | None:
    """The node ``placer``'s policy gives a CPU-only task (None if none has room); takes nothing.

    Scoring policies pick the node whose fragmentation (over :attr:`HostPlacerView.host_stats`)
    grows least, with FGD's integer score when the policy has ``score_levels``; best-fit the
    least free share of GPU, CPU and RAM; first-fit the first; random any (seeded).
    """
    st = placer.state
    room = (st.host_cpu >= cpu_milli) & (st.host_mem >= host_memory_bytes) & ~placer.index.node_standby
    ok = np.flatnonzero(room)
    if len(ok) == 0:
        return None
    policy = placer.policy
    if policy.chooser is Chooser.FIRST_FIT:
        n = int(ok[0])
    elif policy.chooser is Chooser.RANDOM:
        n = int(np.random.default_rng(seed).choice(ok))
    elif policy.chooser is Chooser.BEST_FIT:
        probe = PendingTask("", _ANY_GPU, 0.0, cpu_milli=cpu_milli, host_memory_bytes=host_memory_bytes)
        n = int(ok[np.argmin(left_after(placer, st, ok, 0, probe))])
    else:
        stats = placer.host_stats
        delta = stats.delta_host(ok, cpu_milli, host_memory_bytes)
        if policy.score_levels:
            left = stats.total[ok] if policy.packing else None
            n = int(ok[levels_best(policy.fragmentation * delta / MILLI, policy.score_levels, left)])
        else:
            # Among equal fragmentation, the node with the least free GPU capacity, then CPU.
            n = int(ok[np.lexsort((st.host_cpu[ok], stats.total[ok], delta))[0]])
    return placer.index.nodes[n].name
