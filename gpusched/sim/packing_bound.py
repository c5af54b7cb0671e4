"""How low can the openb measure go? An upper bound on what any placement can allocate.

At an arrival of the FGD procedure every placement policy — one task at a time or all at once,
with or without migration, knowing the future or not — holds some subset of the GPU requests
arrived so far, each GPU holding at most 1,000 milli. So the most GPU volume any policy can have
allocated is at most the optimum of a bin-packing problem: the GPUs are bins of 1,000, a
fractional task is an item of its ``gpu_milli``, a whole-GPU task of ``k`` GPUs is ``k`` items of
1,000. Nodes, host CPU and memory, GPU models and the arrival order are all relaxed away, so the
bound is loose where those bind (the CPU-heavy and model-pinned lists) and tight where the
fractions' sizes alone leave slivers no request can use (the GPU-sharing lists).

The packing optimum is bounded from above by the configuration LP (Gilmore–Gomory): a variable per
set of item sizes that fits one GPU, at most ``gpus`` of them, at most ``n_i`` items of size ``i``
in all, maximise the volume. It is solved by column generation — HiGHS for the master LP, an
integer knapsack over milli for the pricing — and the value returned is the *dual* bound
``n·y + gpus·max(0, K(y))`` of the last duals ``y`` (``K`` the best knapsack under the prices
``size − y``), which bounds the LP optimum from above whether or not the generation converged.

:func:`unallocated_bound_pct` turns it into the openb measure's unit: the lowest unallocated GPU %
any policy can read over the measurement window (scipy is imported inside :func:`packing_bound`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

import numpy as np

from gpusched.model import MILLI
from gpusched.sim.traces import OpenbPod

__all__ = ["gpu_items", "packing_bound", "unallocated_bound_pct"]

_MAX_COLUMNS = 2_000  # column-generation rounds; the dual bound stays valid if it stops early
_EPS = 1e-7


def gpu_items(pods: Iterable[OpenbPod]) -> Counter[int]:
    """``{milli per item: count}``: a fractional pod is one item of its ``gpu_milli``, a pod of
    ``k`` whole GPUs ``k`` items of 1,000; CPU-only pods hold no GPU."""
    items: Counter[int] = Counter()
    for pod in pods:
        if pod.num_gpu and pod.gpu_milli >= MILLI:
            items[MILLI] += pod.num_gpu
        elif pod.num_gpu:
            items[pod.gpu_milli] += 1
    return items


def packing_bound(items: Mapping[int, int], gpus: int) -> float:
    """An upper bound (milli) on the GPU volume of ``items`` (``{milli: count}``, each 1–1,000)
    that ``gpus`` GPUs of 1,000 milli can hold at once, choosing which items to hold."""
    sizes = sorted(s for s, n in items.items() if n > 0)
    if not sizes or gpus <= 0:
        return 0.0
    if any(not 0 < s <= MILLI for s in sizes):
        raise ValueError(f"item sizes must lie in 1..{MILLI} milli, got {sizes[0]}..{sizes[-1]}")
    from scipy.optimize import linprog

    size = np.array(sizes, dtype=np.float64)
    count = np.array([items[s] for s in sizes], dtype=np.float64)
    # Start from the one-size columns (as many items of one size as fit a GPU).
    columns = [np.eye(len(sizes), dtype=np.int64)[i] * (MILLI // s) for i, s in enumerate(sizes)]
    bound = float(size @ count)  # everything arrived is the trivial bound
    for _ in range(_MAX_COLUMNS):
        a = np.array(columns, dtype=np.float64).T
        res = linprog(
            -(size @ a),
            A_ub=np.vstack([a, np.ones(len(columns))]),
            b_ub=np.append(count, gpus),
            bounds=(0, None),
            method="highs",
        )
        prices = np.maximum(0.0, -res.ineqlin.marginals[:-1])
        best, column = _knapsack(sizes, size - prices)
        bound = min(bound, float(count @ prices) + gpus * max(0.0, best))
        if best <= -res.ineqlin.marginals[-1] + _EPS:
            break  # no column prices out: the master LP is optimal and equals the dual bound
        columns.append(column)
    return min(bound, gpus * float(MILLI))


def _knapsack(sizes: list[int], values: np.ndarray) -> tuple[float, np.ndarray]:
    """The best total value of items (any number of each, ``sizes`` in milli) in one GPU, and the
    item counts that reach it; items of non-positive value are never worth taking."""
    best = np.zeros(MILLI + 1)
    last = np.full(MILLI + 1, -1, dtype=np.int64)
    for i, (s, v) in enumerate(zip(sizes, values, strict=True)):
        if v <= 0:
            continue
        for c in range(s, MILLI + 1):  # unbounded: item i may be taken again at c - s
            if best[c - s] + v > best[c] + _EPS:
                best[c], last[c] = best[c - s] + v, i
    top = int(np.argmax(best))
    column = np.zeros(len(sizes), dtype=np.int64)
    c = top
    while c > 0 and last[c] >= 0:
        column[last[c]] += 1
        c -= sizes[last[c]]
    return float(best[top]), column


def unallocated_bound_pct(arrived: Iterable[OpenbPod], gpus: int) -> float:
    """The lowest unallocated GPU % (of ``gpus`` GPUs) any placement of the ``arrived`` pods can
    leave once they have all arrived: ``100 × (1 − packing_bound / capacity)``."""
    return round(100.0 * (1.0 - packing_bound(gpu_items(arrived), gpus) / (gpus * MILLI)), 4)
