"""How low can the openb measure go? An upper bound on what any placement can allocate.

At an arrival of the FGD procedure every placement policy — one task at a time or all at once,
with or without migration, knowing the future or not — holds some subset of the GPU requests
arrived so far, each GPU holding at most 1,000 milli. So the most GPU volume any policy can have
allocated is at most the optimum of a bin-packing problem: the GPUs are bins of 1,000, a
fractional task is an item of its ``gpu_milli``, a whole-GPU task of ``k`` GPUs is ``k`` items of
1,000, and an item pinned to GPU models (``gpu_spec``) fits only the GPUs of those models. Nodes,
host CPU and memory and the arrival order are relaxed away, so the bound is loose where those bind
(the CPU-heavy lists, and multi-GPU tasks, which need their GPUs on one node) and tight where the
fractions' sizes alone leave slivers no request can use (the GPU-sharing lists).

The packing optimum is bounded from above by the configuration LP (Gilmore–Gomory): per GPU
model ``m`` a variable per set of items allowed on ``m`` that fits one GPU, at most ``G_m`` of them,
at most ``n_i`` items of type ``i`` in all, maximise the volume. It is solved by column generation —
HiGHS for the master LP, an integer knapsack over milli per model for the pricing — and the value
returned is the *dual* bound ``n·y + Σ_m G_m·max(0, K_m(y))`` of the last duals ``y`` (``K_m`` the
best knapsack of model ``m`` under the prices ``size − y``), which bounds the LP optimum from
above whether or not the generation converged.

:func:`unallocated_bound_pct` turns it into the openb measure's unit: the lowest unallocated GPU %
any policy can read over the measurement window (scipy is imported inside :func:`packing_bound`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

import numpy as np

from gpusched.catalog import default_catalog
from gpusched.model import MILLI
from gpusched.sim.traces import OpenbNode, OpenbPod

__all__ = ["Item", "gpu_items", "gpus_by_model", "packing_bound", "unallocated_bound_pct"]

Item = tuple[int, frozenset[str]]  # (milli on one GPU, the GPU models allowed; empty = any)

_MAX_ROUNDS = 2_000  # column-generation rounds; the dual bound stays valid if it stops early
_EPS = 1e-7


def gpu_items(pods: Iterable[OpenbPod]) -> Counter[Item]:
    """``{(milli, models): count}``: a one-GPU pod below 1,000 milli is one item of its
    ``gpu_milli``, any other GPU pod of ``k`` GPUs ``k`` items of 1,000 (the harness gives a
    multi-GPU pod whole GPUs, :func:`gpusched.sim.openb.pod_request`), each allowed on the pod's
    ``gpu_spec`` models as catalog names (empty = any); CPU-only pods hold no GPU."""
    cat = default_catalog()
    items: Counter[Item] = Counter()
    for pod in pods:
        if pod.num_gpu:
            pins = frozenset(cat.get(m).name for m in pod.gpu_spec)
            if pod.num_gpu == 1 and pod.gpu_milli < MILLI:
                items[(pod.gpu_milli, pins)] += 1
            else:
                items[(MILLI, pins)] += pod.num_gpu
    return items


def gpus_by_model(nodes: Iterable[OpenbNode]) -> Counter[str]:
    """GPUs per catalog model name of an openb node list (trace names resolve through the
    catalog's aliases, as in :func:`gpusched.sim.fleets.openb_fleet`)."""
    cat = default_catalog()
    out: Counter[str] = Counter()
    for node in nodes:
        if node.gpus:
            out[cat.get(node.model or "T4").name] += node.gpus
    return out


def packing_bound(items: Mapping[Item, int], gpus: Mapping[str, int]) -> float:
    """An upper bound (milli) on the GPU volume of ``items`` that GPUs of 1,000 milli can hold at
    once, choosing which items to hold; ``gpus`` = GPUs per model. An item whose models are all
    absent from ``gpus`` fits nowhere."""
    models = sorted(m for m, g in gpus.items() if g > 0)
    kinds = sorted((size, pins) for (size, pins), n in items.items() if n > 0 and _allowed(pins, models))
    if not kinds or not models:
        return 0.0
    if any(not 0 < size <= MILLI for size, _ in kinds):
        raise ValueError(f"item sizes must lie in 1..{MILLI} milli, got {sorted(s for s, _ in kinds)}")
    from scipy.optimize import linprog

    size = np.array([k[0] for k in kinds], dtype=np.float64)
    count = np.array([items[k] for k in kinds], dtype=np.float64)
    room = np.array([gpus[m] for m in models], dtype=np.float64)
    allowed = np.array([[_allowed(pins, [m]) for _, pins in kinds] for m in models])  # models x kinds
    # Columns (model, item counts); start from one kind alone, as many as fit a GPU.
    columns = [
        (mi, np.eye(len(kinds), dtype=np.int64)[i] * (MILLI // int(size[i])))
        for mi in range(len(models))
        for i in np.flatnonzero(allowed[mi])
    ]
    bound = min(float(size @ count), float(room.sum()) * MILLI)
    for _ in range(_MAX_ROUNDS):
        a = np.array([c for _, c in columns], dtype=np.float64).T
        per_model = np.zeros((len(models), len(columns)))
        per_model[[m for m, _ in columns], np.arange(len(columns))] = 1.0
        res = linprog(
            -(size @ a), A_ub=np.vstack([a, per_model]), b_ub=np.concatenate([count, room]),
            bounds=(0, None), method="highs",
        )
        if not res.success or res.ineqlin is None:
            break  # a solver failure: the last dual bound (or everything arrived) still holds
        marginals = -res.ineqlin.marginals
        prices, gpu_price = np.maximum(0.0, marginals[: len(kinds)]), marginals[len(kinds):]
        new = []
        dual = float(count @ prices)
        for mi in range(len(models)):
            best, column = _knapsack(size, np.where(allowed[mi], size - prices, -1.0))
            dual += room[mi] * max(0.0, best)
            if best > gpu_price[mi] + _EPS:
                new.append((mi, column))
        bound = min(bound, dual)
        if not new:
            break  # no column prices out: the master LP is optimal and equals the dual bound
        columns.extend(new)
    return bound


def _allowed(pins: frozenset[str], models: Iterable[str]) -> bool:
    return not pins or any(m in pins for m in models)


def _knapsack(size: np.ndarray, value: np.ndarray) -> tuple[float, np.ndarray]:
    """The best total value of items (any number of each kind, ``size`` in milli) in one GPU, and
    the counts per kind that reach it. Kinds of equal size keep only the most valuable one; each
    kind is split into 1, 2, 4, … copies, each a 0/1 item, so every pass is one array step."""
    keep: dict[int, int] = {}
    for i in map(int, np.flatnonzero(value > 0)):
        s = int(size[i])
        if s not in keep or value[i] > value[keep[s]]:
            keep[s] = i
    best = np.zeros(MILLI + 1)
    passes: list[tuple[int, int, np.ndarray]] = []  # (kind, copies, where the pass improved)
    for s, i in keep.items():
        left, copies = MILLI // s, 1
        while left > 0:
            take = min(copies, left)
            w, v = s * take, value[i] * take
            candidate = np.full(MILLI + 1, -np.inf)
            candidate[w:] = best[: MILLI + 1 - w] + v
            better = candidate > best + _EPS
            best = np.where(better, candidate, best)
            passes.append((i, take, better))
            left -= take
            copies *= 2
    column = np.zeros(len(size), dtype=np.int64)
    c = int(np.argmax(best))
    top = float(best[c])
    for i, take, better in reversed(passes):
        if better[c]:
            column[i] += take
            c -= int(size[i]) * take
    return top, column


def unallocated_bound_pct(arrived: Iterable[OpenbPod], gpus: Mapping[str, int]) -> float:
    """The lowest unallocated GPU % any placement of the ``arrived`` pods on a fleet of ``gpus``
    GPUs per model can leave once they have all arrived: ``100 × (1 − packing_bound / capacity)``."""
    capacity = sum(gpus.values()) * MILLI
    return round(100.0 * (1.0 - packing_bound(gpu_items(arrived), gpus) / capacity), 4)
