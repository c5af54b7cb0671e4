"""Where a CPU-only task goes: one node with enough host CPU and RAM, chosen by the policy.

A task without devices (the openb trace's CPU-only pods) still takes host CPU and RAM that GPU
tasks need, so scoring policies place it where the expected fragmentation of GPU capacity grows
least. The measure is over ``Policy.host_task_workload`` when the policy sets one (the shapes
CPU-only decisions are judged by may leave out a resource that GPU decisions count; see
``fgd-memory`` in :mod:`gpusched.placement.policy`), else over the policy's workload.
"""

from __future__ import annotations

import numpy as np

from gpusched.placement.choose import HostPlacerView, selector

__all__ = ["choose_host_node"]


def choose_host_node(
    placer: HostPlacerView, cpu_milli: int, host_memory_bytes: int, *, seed: int = 0
) -> str | None:
    """The node ``placer``'s policy gives a CPU-only task (None if none has room); takes nothing.

    The policy's chooser decides (:meth:`gpusched.placement.choose.Selector.host`): scoring
    policies pick the node whose fragmentation (over :attr:`HostPlacerView.host_stats`) grows
    least, with FGD's integer score when the policy has ``score_levels``; best-fit the least free
    share of GPU, CPU and RAM; first-fit the first; random any (seeded).
    """
    st = placer.state
    room = (st.host_cpu >= cpu_milli) & (st.host_mem >= host_memory_bytes) & ~placer.index.node_standby
    ok = np.flatnonzero(room)
    if len(ok) == 0:
        return None
    n = selector(placer.policy).host(placer, ok, cpu_milli, host_memory_bytes, seed)
    return placer.index.nodes[n].name
