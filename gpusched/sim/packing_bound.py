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

The host bound (:func:`host_packing_bound`, :func:`unallocated_host_bound_pct`) counts host CPU
and memory too. Its configurations are whole nodes. The GPU nodes are grouped by (model, GPUs,
CPU, memory); a node's content is up to its GPU count of single-GPU item sets as above plus any
CPU-only tasks, their CPU within the node's (each item's CPU rounded down to 250 milli, a
relaxation); per group at most its node count of contents and its memory in total (memory per
group, not per node); at most ``n_i`` items of each kind; and every arrived CPU-only task held
(one equality row per task kind; a CPU-only task no node can hold fails under any placement and
is left out). A GPU item carries its pod's CPU and memory (a ``k``-GPU pod's split evenly over its
``k`` items, which may land on different nodes: relaxed) and fits only groups whose nodes can hold
the whole pod (model, ``k`` GPUs, CPU, memory). So it bounds the GPU volume of every placement
that holds every arrived CPU-only task — the FGD harness places a task whenever some node has
room, and ``OpenbRun.cpu_tasks_failed`` counts the CPU-only tasks a run could not place (a run
where it is not 0 is not covered; where the host bound equals the GPU-only one it covers every
placement anyway). Arrival order and tie-breaks are relaxed as above.

Its dual bound: for any item prices ``y ≥ 0``, memory prices ``β_g ≥ 0`` per group and prices
``λ_j`` of any sign per CPU-only task kind, ``n·y + Σ_g (N_g·max(0, P_g) + R_g·β_g) + Σ_j n_j·λ_j``
bounds the LP from above (weak duality: with the node price ``max(0, P_g)`` every dual constraint
holds), ``P_g`` the best node content of group ``g`` under the values ``size − y − mem·β_g`` per
item and ``−λ_j − mem_j·β_g`` per CPU-only task: a knapsack over (milli, CPU) for one GPU, then
the node's GPUs and CPU-only tasks combined over its CPU. The master LP lets each CPU-only kind
fall short at a penalty so that it is always feasible; where a shortfall remains at the end (the
CPU-only tasks may not all fit) the GPU-only bound is returned. The value is never above the
GPU-only bound of the same arrivals (the smaller of the two is returned).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from gpusched.catalog import default_catalog
from gpusched.model import MILLI
from gpusched.sim.traces import OpenbNode, OpenbPod

__all__ = [
    "HostItem",
    "NodeGroup",
    "cpu_tasks",
    "gpu_items",
    "gpus_by_model",
    "host_gpu_items",
    "host_packing_bound",
    "node_groups",
    "packing_bound",
    "unallocated_bound_pct",
    "unallocated_host_bound_pct",
]

Item = tuple[int, frozenset[str]]  # (milli on one GPU, the GPU models allowed; empty = any)

# A GPU item with its pod's host request: (milli on one GPU, allowed models, the pod's GPU count,
# the pod's CPU milli, the pod's memory MiB); the item carries 1/count of the pod's CPU and memory.
HostItem = tuple[int, frozenset[str], int, int, int]

_MAX_ROUNDS = 2_000  # column-generation rounds; the dual bound stays valid if it stops early
_HOST_ROUNDS = 400  # the same for the host bound, whose rounds cost more
_HOST_GAP = 30.0  # milli: the host bound stops once its dual bound is within this of the master LP
_CPU_GRID = 250  # milli: the host bound rounds each item's CPU down to a multiple (a relaxation)
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


@dataclass(frozen=True, slots=True)
class NodeGroup:
    """``count`` nodes alike: GPU model (catalog name), GPUs, CPU milli and memory MiB per node."""

    model: str
    gpus: int
    cpu_milli: int
    memory_mib: int
    count: int

    def holds(self, models: frozenset[str], gpus: int, cpu_milli: int, memory_mib: int) -> bool:
        """Whether one of these nodes, empty, can hold a pod of this request."""
        return (
            (not models or self.model in models)
            and gpus <= self.gpus
            and cpu_milli <= self.cpu_milli
            and memory_mib <= self.memory_mib
        )


def node_groups(nodes: Iterable[OpenbNode]) -> list[NodeGroup]:
    """The GPU nodes of an openb node list grouped by (catalog model, GPUs, CPU, memory)."""
    cat = default_catalog()
    counts: Counter[tuple[str, int, int, int]] = Counter()
    for node in nodes:
        if node.gpus:
            counts[(cat.get(node.model or "T4").name, node.gpus, node.cpu_milli, node.memory_mib)] += 1
    return [NodeGroup(m, g, c, r, n) for (m, g, c, r), n in sorted(counts.items())]


def host_gpu_items(pods: Iterable[OpenbPod]) -> Counter[HostItem]:
    """``{(milli, models, gpus, cpu, memory): items}``: as :func:`gpu_items` (a ``k``-GPU pod is
    ``k`` items), each keyed by its pod's GPU count and host request too."""
    cat = default_catalog()
    items: Counter[HostItem] = Counter()
    for pod in pods:
        if pod.num_gpu:
            pins = frozenset(cat.get(m).name for m in pod.gpu_spec)
            milli = pod.gpu_milli if pod.num_gpu == 1 and pod.gpu_milli < MILLI else MILLI
            items[(milli, pins, pod.num_gpu, pod.cpu_milli, pod.memory_mib)] += pod.num_gpu
    return items


def cpu_tasks(pods: Iterable[OpenbPod]) -> Counter[tuple[int, int]]:
    """``{(cpu milli, memory MiB): count}`` of the CPU-only pods."""
    return Counter((p.cpu_milli, p.memory_mib) for p in pods if not p.num_gpu)


def host_packing_bound(
    items: Mapping[HostItem, int],
    tasks: Mapping[tuple[int, int], int],
    groups: Sequence[NodeGroup],
    *,
    cpu_grid: int = _CPU_GRID,
    max_rounds: int = _HOST_ROUNDS,
) -> float:
    """An upper bound (milli) on the GPU volume of ``items`` that the ``groups``' nodes can hold
    at once while they also hold every CPU-only task of ``tasks`` that some node can hold (see
    the module docstring). When not even those tasks fit together, no such placement exists and
    the GPU-only bound of the same items is returned (it holds for every placement)."""
    gpus: Counter[str] = Counter()
    for g in groups:
        gpus[g.model] += g.gpus * g.count
    plain: Counter[Item] = Counter()
    for (milli, pins, _, _, _), n in items.items():
        plain[(milli, pins)] += n
    cap = packing_bound(plain, gpus)
    groups = [g for g in groups if g.count > 0 and g.gpus > 0]
    kinds_n: Counter[tuple[int, int, int, tuple[int, ...]]] = Counter()  # size, CPU, MiB, where
    for (milli, pins, k, cpu, mem), n in items.items():
        where = tuple(gi for gi, g in enumerate(groups) if g.holds(pins, k, cpu, mem))
        if n > 0 and where:
            if not 0 < milli <= MILLI:
                raise ValueError(f"item sizes must lie in 1..{MILLI} milli, got {milli}")
            # a k-GPU pod's share of CPU per item, rounded down to the grid (a relaxation)
            kinds_n[(milli, cpu // k // cpu_grid, mem // k, where)] += n
    task_n: Counter[tuple[int, int, tuple[int, ...]]] = Counter()
    for (c, r), n in tasks.items():
        where = tuple(gi for gi, g in enumerate(groups) if g.holds(frozenset(), 0, c, r))
        if n > 0 and where:  # a task no node can hold fails under every placement
            task_n[(c // cpu_grid, r, where)] += n
    if not kinds_n or cap <= 0:
        return 0.0
    if any(c == 0 for c, _, _ in task_n):
        raise ValueError(f"CPU-only tasks below {cpu_grid} milli CPU are not supported")
    from scipy.optimize import linprog

    kinds, tkinds = sorted(kinds_n), sorted(task_n)
    nk, nt, ng = len(kinds), len(tkinds), len(groups)
    size = np.array([k[0] for k in kinds], dtype=np.float64)
    kcpu = np.array([k[1] for k in kinds], dtype=np.int64)
    kgib = np.array([k[2] / 1024.0 for k in kinds])
    count = np.array([kinds_n[k] for k in kinds], dtype=np.float64)
    tcpu = np.array([t[0] for t in tkinds], dtype=np.int64)
    tgib = np.array([t[1] / 1024.0 for t in tkinds])
    tcount = np.array([task_n[t] for t in tkinds], dtype=np.float64)
    allowed = np.zeros((ng, nk), dtype=bool)
    for i, kind in enumerate(kinds):
        allowed[list(kind[3]), i] = True
    tallowed = np.zeros((ng, nt), dtype=bool)
    for j, t in enumerate(tkinds):
        tallowed[list(t[2]), j] = True
    nodes = np.array([g.count for g in groups], dtype=np.float64)
    gib = np.array([g.memory_mib * g.count / 1024.0 for g in groups])
    unit = math.gcd(MILLI, *map(int, size))
    pricers = [_NodePricer(g, size, kcpu, unit, cpu_grid) for g in groups]
    # Columns: (group, item counts, CPU-only counts) of one node; start from one kind alone.
    columns: list[tuple[int, np.ndarray, np.ndarray]] = []
    for gi, pr in enumerate(pricers):
        for i in map(int, np.flatnonzero(allowed[gi])):
            per_gpu = 1 if kinds[i][0] == MILLI else MILLI // int(size[i])
            n = min(per_gpu * groups[gi].gpus, pr.cpu_cap // max(1, int(kcpu[i])))
            if n > 0:
                columns.append((gi, np.eye(nk, dtype=np.int64)[i] * n, np.zeros(nt, dtype=np.int64)))
        for j in map(int, np.flatnonzero(tallowed[gi])):
            n = pr.cpu_cap // int(tcpu[j])
            if n > 0:
                columns.append((gi, np.zeros(nk, dtype=np.int64), np.eye(nt, dtype=np.int64)[j] * n))
    penalty = float(MILLI * max(1, max(groups, key=lambda g: g.gpus).gpus))  # per missing task
    bound, short = cap, np.inf
    b_ub = np.concatenate([count, nodes, gib])
    for _ in range(max_rounds):
        a = np.array([c for _, c, _ in columns], dtype=np.float64).T
        b = np.array([t for _, _, t in columns], dtype=np.float64).T.reshape(nt, len(columns))
        at = np.array([gi for gi, _, _ in columns])
        ub = np.zeros((nk + 2 * ng, len(columns)))
        ub[:nk] = a
        ub[nk + at, np.arange(len(columns))] = 1.0
        ub[nk + ng + at, np.arange(len(columns))] = kgib @ a + tgib @ b
        # an artificial shortfall per CPU-only kind keeps the master feasible (penalised)
        res = linprog(
            np.concatenate([-(size @ a), np.full(nt, penalty)]),
            A_ub=np.hstack([ub, np.zeros((nk + 2 * ng, nt))]), b_ub=b_ub,
            A_eq=np.hstack([b, np.eye(nt)]) if nt else None, b_eq=tcount if nt else None,
            bounds=(0, None), method="highs",
        )
        if not res.success or res.ineqlin is None:
            break  # a solver failure: the last dual bound (or the GPU-only one) still holds
        short = float(res.x[len(columns):].sum()) if nt else 0.0
        duals = np.maximum(0.0, -res.ineqlin.marginals)
        prices, node_price, beta = duals[:nk], duals[nk: nk + ng], duals[nk + ng:]
        lam = -res.eqlin.marginals if nt else np.zeros(0)
        dual = float(count @ prices + gib @ beta + tcount @ lam)
        new = []
        for gi, pr in enumerate(pricers):
            value = np.where(allowed[gi], size - prices - kgib * beta[gi], -1.0)
            tvalue = np.where(tallowed[gi], -lam - tgib * beta[gi], -1.0)
            best, column, tcolumn = pr.best(value, tvalue, tcpu)
            dual += nodes[gi] * max(0.0, best)
            if best > node_price[gi] + _EPS:
                new.append((gi, column, tcolumn))
        bound = min(bound, dual)
        held = float(size @ a @ res.x[: len(columns)])  # the master's value: a lower end
        if not new or (short <= 1e-6 and bound - held <= _HOST_GAP):
            break
        columns.extend(new)
    # A shortfall left: the CPU-only tasks may not all fit; no such placement to bound.
    return cap if short > 1e-6 else bound


class _NodePricer:
    """The best node of a group under prices: up to ``gpus`` GPUs, each any set of items within
    1,000 milli, and CPU-only tasks, their CPU (rounded down to the grid) within the node's."""

    def __init__(self, group: NodeGroup, size: np.ndarray, cpu: np.ndarray, unit: int, grid: int):
        self.gpus = group.gpus
        self.cpu_cap = group.cpu_milli // grid
        self.msize = (size // unit).astype(np.int64)
        self.mcap = MILLI // unit
        self.cpu = cpu

    def best(
        self, value: np.ndarray, tvalue: np.ndarray, tcpu: np.ndarray
    ) -> tuple[float, np.ndarray, np.ndarray]:
        """(best value, item counts, CPU-only counts) of one node."""
        cc, mc = self.cpu_cap, self.mcap
        keep: dict[tuple[int, int], int] = {}
        for i in map(int, np.flatnonzero(value > _EPS)):
            key = (int(self.msize[i]), int(self.cpu[i]))
            if key[1] <= cc and (key not in keep or value[i] > value[keep[key]]):
                keep[key] = i
        gpu = np.zeros((mc + 1, cc + 1))  # best of one GPU within (milli, CPU)
        passes: list[tuple[int, int, np.ndarray]] = []  # (kind, copies, where it improved)
        for (w, c), i in keep.items():
            left = mc // w if c == 0 else min(mc // w, cc // c)
            copies = 1
            while left > 0:
                take = min(copies, left)
                dw, dc = w * take, c * take
                cand = gpu[: mc + 1 - dw, : cc + 1 - dc] + value[i] * take
                better = cand > gpu[dw:, dc:] + _EPS
                np.copyto(gpu[dw:, dc:], cand, where=better)
                passes.append((i, take, better))
                left -= take
                copies *= 2
        f = gpu[mc]  # best of one GPU within CPU c (non-decreasing)
        # CPU-only tasks: an unbounded knapsack over CPU.
        host = np.zeros(cc + 1)
        hchoice = np.full(cc + 1, -1)
        worth = [(int(tcpu[j]), float(tvalue[j]), int(j)) for j in np.flatnonzero(tvalue > _EPS)]
        for c in range(1, cc + 1):
            for w, v, j in worth:
                if w <= c and host[c - w] + v > host[c] + _EPS:
                    host[c], hchoice[c] = host[c - w] + v, j
        # Add the GPUs one at a time: h[c] = max over c' of h[c - c'] + f[c'].
        idx = np.arange(cc + 1)
        diff = idx[:, None] - idx[None, :]  # c - c'
        splits = []
        h = host
        for _ in range(self.gpus):
            table = np.where(diff >= 0, h[np.clip(diff, 0, None)] + f[None, :], -np.inf)
            arg = np.argmax(table, axis=1)
            h = table[idx, arg]
            splits.append(arg)
        column = np.zeros(len(value), dtype=np.int64)
        tcolumn = np.zeros(len(tvalue), dtype=np.int64)
        c = cc
        for arg in reversed(splits):
            share = int(arg[c])
            m, k = mc, share
            for i, take, better in reversed(passes):
                dw, dc = int(self.msize[i]) * take, int(self.cpu[i]) * take
                if m >= dw and k >= dc and better[m - dw, k - dc]:
                    column[i] += take
                    m -= int(self.msize[i]) * take
                    k -= int(self.cpu[i]) * take
            c -= share
        while c > 0:
            j = int(hchoice[c])
            if j >= 0:
                tcolumn[j] += 1
                c -= int(tcpu[j])
            else:
                c -= 1
        return float(h[cc]), column, tcolumn


def unallocated_host_bound_pct(arrived: Iterable[OpenbPod], nodes: Iterable[OpenbNode]) -> float:
    """As :func:`unallocated_bound_pct` with host CPU and memory counted
    (:func:`host_packing_bound`): the lowest unallocated GPU % a placement of the ``arrived`` pods
    on the GPU nodes of ``nodes`` that holds every arrived CPU-only task can leave."""
    arrived, groups = list(arrived), node_groups(nodes)
    capacity = sum(g.gpus * g.count for g in groups) * MILLI
    held = host_packing_bound(host_gpu_items(arrived), cpu_tasks(arrived), groups)
    return round(100.0 * (1.0 - held / capacity), 4)
