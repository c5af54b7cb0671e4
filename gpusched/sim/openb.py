"""The FGD packing experiment on the openb trace, exactly as the FGD simulator runs it.

Procedure (Weng et al., ATC '23; ``shared/traces/README.md``):

1. Cluster = the GPU nodes of the openb node list. A task fits a node only if CPU, memory and
   GPU all fit; a fractional task takes ``gpu_milli`` of one GPU; a multi-GPU task takes whole
   GPUs on one node.
2. Arrival order and workload tuning, in the FGD simulator's order: the trace's tasks are
   shuffled (seeded), then tuned to ``factor`` (1.3) × the cluster capacity — tasks drawn
   uniformly with replacement are *appended after them* while the total stays within the
   target (the first draw that would pass it ends the tuning; the simulator tests a draw with
   its *per-GPU* share while it adds its total, and so do we), or, for a list already above the
   target, uniformly random tasks are removed until it fits. So every trace task arrives, in
   random order, before any duplicate. Tasks arrive one by one and are placed at once or fail;
   there are no departures.
3. Node order: the FGD simulator renames every node ``<NNNN>-<name>`` with ``NNNN`` from a
   seeded random permutation (``rand.Perm`` in ``syncClusterResourceList``), and its scheduler
   gives equal scores to the lowest name — so ties go to a node chosen by a random order drawn
   once per seed, not to the trace's first node. We build the fleet in such a seeded random
   order (drawn after the tuning, as in the simulator); our policies break ties by inventory
   order. ``shuffle_nodes=False`` keeps the trace's (name) order.
4. After every arrival the allocation ratio 100 × allocated / capacity (rounded to 0.01) is
   logged with the arrived ratio 100 × arrived / capacity. The measure at 100 % is FGD's analysis
   step: the mean allocation ratio of the arrivals whose arrived ratio rounds to 100 (i.e. lies
   in 99.5–100.5 %; 99–101 % if none does); unallocated GPU % = 100 − that mean. Reported as the
   median of seeds. ``OpenbRun.at_crossing`` keeps the older single-point reading (right after
   the arrival that brings the arrived request to 100 %).
5. Beside it, ``OpenbRun.unallocated_bound_pct``: the lowest value any placement of the same
   arrivals could read (:mod:`gpusched.sim.packing_bound`: GPU capacity only, so a lower bound
   for every policy; it depends on the seed's arrivals, not on the policy). The arrivals it
   covers are :func:`reading_span`'s; :func:`openb_bounds` gives it without running a policy,
   with the bound that counts host CPU and memory too (``unallocated_host_bound_pct``, for the
   placements that hold every arrived CPU-only task; ``OpenbRun.cpu_tasks_failed`` counts the
   CPU-only tasks a run failed among those arrivals).

Every GPU task is one cycle of the executors' scheduler (:func:`gpusched.scheduler.cycle.decide`,
no quota) on a placement engine kept alive across arrivals (:class:`gpusched.placement.Placer`,
the engine behind :func:`~gpusched.placement.place`) with the named policy and the task's host
CPU/RAM (``PendingWork.cpu_milli`` / ``host_memory_bytes``). CPU-only tasks are no GPU work (no
executor schedules them): they go through
``Placer.choose_host_node`` + ``take_host``. For score-based presets the expected workload is the
trace's own shape distribution, with host CPU/RAM per shape, as FGD assumes.
"""

from __future__ import annotations

import random
import statistics
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from gpusched.catalog import default_catalog
from gpusched.extras import lab_module
from gpusched.model import MILLI
from gpusched.placement import Placer, Policy, WorkloadShape
from gpusched.quota.policy import QuotaState
from gpusched.request import GPURequest
from gpusched.scheduler.cycle import CycleRequest, PendingWork, decide
from gpusched.sim.fleets import MIB, openb_fleet
from gpusched.sim.packing_bound import gpus_by_model, unallocated_bound_pct, unallocated_host_bound_pct
from gpusched.sim.traces import OpenbNode, OpenbPod

__all__ = [
    "OpenbRun",
    "node_order",
    "openb_bounds",
    "openb_policy",
    "pod_request",
    "reading_span",
    "run_openb",
    "run_openb_seeds",
    "tune_workload",
    "typical_shapes",
]


@dataclass(frozen=True, slots=True)
class OpenbRun:
    """One seed of the experiment."""

    seed: int
    unallocated_gpu_pct: float
    allocated_milli: int
    arrived_milli: int
    capacity_milli: int
    tasks_arrived: int
    tasks_failed: int
    tuned_tasks: int
    at_crossing: float = 0.0
    window_arrivals: int = 0
    at: dict[str, float] = field(default_factory=dict)
    # The lowest unallocated GPU % any placement could read on the same arrivals
    # (:mod:`gpusched.sim.packing_bound`).
    unallocated_bound_pct: float = 0.0
    # CPU-only tasks that found no node among the arrivals the reading covers (the host bound,
    # :func:`openb_bounds`, covers the runs where this is 0).
    cpu_tasks_failed: int = 0


def tune_workload(
    pods: Sequence[OpenbPod], capacity_milli: int, rng: random.Random, factor: float = 1.3
) -> list[OpenbPod]:
    """The arrival order of the FGD simulator: the trace's pods shuffled, then tuned to
    ``factor`` × capacity — uniform draws (with replacement) appended while the total stays
    within it (the first draw that would pass it, tested with its per-GPU share, ends the
    tuning), or, for a list above it, uniformly random pods removed until it fits."""
    tuned = list(pods)
    rng.shuffle(tuned)
    total = sum(p.total_gpu_milli for p in tuned)
    target = factor * capacity_milli
    if not any(p.total_gpu_milli for p in pods):
        return tuned
    while total > target and tuned:
        total -= tuned.pop(rng.randrange(len(tuned))).total_gpu_milli
    if total == target or len(tuned) < len(pods):
        return tuned
    while True:
        pod = rng.choice(pods)
        if total + (pod.gpu_milli if pod.num_gpu else 0) > target:
            return tuned
        tuned.append(pod)
        total += pod.total_gpu_milli


def node_order(nodes: Sequence[OpenbNode], rng: random.Random) -> list[OpenbNode]:
    """The nodes in the FGD simulator's tie-break order for one seed: a uniformly random
    permutation (the simulator prefixes each name with its index in ``rand.Perm`` and its
    scheduler breaks equal scores by the lowest name)."""
    ordered = sorted(nodes, key=lambda n: n.name)
    rng.shuffle(ordered)
    return ordered


def pod_request(pod: OpenbPod) -> GPURequest:
    """The :class:`GPURequest` for a GPU pod (memory is not a constraint in this trace)."""
    cat = default_catalog()
    models = frozenset(cat.get(m).name for m in pod.gpu_spec)
    if pod.num_gpu == 1 and pod.gpu_milli < MILLI:
        # One byte of device memory: the trace (and FGD) only constrain the compute share.
        return GPURequest(count=1, milli_per_gpu=pod.gpu_milli, memory_per_gpu=1, models=models,
                          isolation=pod.isolation)
    return GPURequest(count=pod.num_gpu, gang=pod.num_gpu > 1, models=models)


def typical_shapes(
    pods: Sequence[OpenbPod], popularity: float = 0.95, *, with_memory: bool = False
) -> tuple[WorkloadShape, ...]:
    """FGD's "typical pods": exact (host CPU, milli-GPU, GPU count, allowed models) classes, most
    frequent first, up to the first class at which ``popularity`` of all pods is covered
    (CPU-only pods included: for them every free GPU counts as fragment). Host memory is left
    out, as in the FGD simulator's fragment measure; ``with_memory`` keys the classes by it too
    and gives each shape its host RAM."""
    cat = default_catalog()
    # A class is (CPU, milli-GPU, count, the pod's GPU-type string as written in the trace).
    counts: Counter[tuple[int, int, int, str, int]] = Counter()
    for p in pods:
        spec = "|".join(p.gpu_spec) if p.num_gpu else ""
        memory_mib = p.memory_mib if with_memory else 0
        counts[(p.cpu_milli, p.gpu_milli if p.num_gpu else 0, p.num_gpu, spec, memory_mib)] += 1
    total = sum(counts.values())
    # Equal frequencies: the FGD simulator sorts its classes in decreasing order of (frequency,
    # CPU, milli-GPU, count, type string), so at the popularity cut the larger class comes first.
    ranked = sorted(counts.items(), key=lambda kv: (kv[1], kv[0]), reverse=True)
    chosen: list[tuple[tuple[int, int, int, str, int], int]] = []
    covered = 0
    for key, n in ranked:
        if covered >= popularity * total:
            break
        chosen.append((key, n))
        covered += n
    return tuple(
        WorkloadShape(
            count,
            milli if count else 0,
            n / covered,
            cpu_milli=cpu,
            host_memory_bytes=memory_mib * MIB,
            models=frozenset(cat.get(m).name for m in spec.split("|")) if spec else frozenset(),
        )
        for (cpu, milli, count, spec, memory_mib), n in chosen
    )


def openb_policy(name: str, pods: Sequence[OpenbPod] = (), **overrides: object) -> Policy:
    """The named preset, with device sharing allowed on every model (the cluster shared GPUs).

    Score-based presets also get the trace's own request shapes as the expected workload (the
    knowledge FGD itself uses: the shape distribution, no pod order). The ``fgd`` preset gets
    FGD's typical pods exactly (:func:`typical_shapes`); ``fgd-full`` and ``fgd-lookahead`` every
    exact class of the trace (the whole shape distribution, not only the 95 % most common);
    ``fgd-memory`` and ``gpusched`` the same classes keyed by host RAM too for GPU pods, and the
    classes without RAM for CPU-only pods (``Policy.host_task_workload``). Every class carries
    its host CPU (so GPUs on a node without CPU left count as fragmented, as in FGD) and its
    allowed models (so a node of a model a shape cannot use counts as fragmented for it, as in
    FGD — this is what keeps the scarce P100/V100 capacity for the pods pinned to it in the
    ``gpuspec*`` lists). ``overrides`` are further :class:`Policy` fields (for tuning
    experiments).
    """
    base = Policy.named(name)
    if not pods or base.chooser != "score":
        return Policy.named(name, fractions_need_partitioning=False, **overrides)
    if base.name in ("fgd-memory", "gpusched"):
        # Measured (docs/benchmarks.md): with RAM in the CPU-only pods' measure too, they go
        # where RAM is plentiful, use up the CPU there, and GPUs fail on CPU instead of on RAM.
        return Policy.named(
            name,
            fractions_need_partitioning=False,
            workload=typical_shapes(pods, 1.0, with_memory=True),
            host_task_workload=typical_shapes(pods, 1.0),
            **overrides,
        )
    shapes = typical_shapes(pods, popularity=0.95 if base.name == "fgd" else 1.0)
    return Policy.named(name, fractions_need_partitioning=False, workload=shapes, **overrides)


def run_openb(
    pods: Sequence[OpenbPod],
    nodes: Sequence[OpenbNode],
    policy_name: str,
    seed: int,
    *,
    factor: float = 1.3,
    stop_at: float = 1.0,
    progress: bool = False,
    overrides: dict[str, object] | None = None,
    shuffle_nodes: bool = True,
) -> OpenbRun:
    """One seed of the FGD procedure (see the module docstring); returns the measurement."""
    capacity = openb_fleet(nodes).total_devices() * MILLI
    rng = random.Random(seed)
    tasks = tune_workload(pods, capacity, rng, factor)
    fleet = openb_fleet(node_order(nodes, rng) if shuffle_nodes else nodes)
    policy = openb_policy(policy_name, pods)
    if overrides:
        policy = replace(policy, **overrides)  # type: ignore[arg-type]
    placer = Placer(fleet, policy)
    unlimited = QuotaState.unlimited()  # FGD's experiment has no quotas
    arrived = allocated = failed = count = 0
    crossing: tuple[int, int, int, int] | None = None  # allocated, arrived, count, failed
    host_failed: list[int] = []  # the arrivals of the CPU-only tasks that found no node
    window: list[float] = []
    wide: list[float] = []
    bar = None
    if progress:
        bar = lab_module("tqdm").tqdm(
            total=capacity,
            unit="mGPU",
            file=sys.stderr,
            desc=f"openb {policy_name} s{seed}",
            mininterval=1.0,
            leave=False,
        )
    for i, pod in enumerate(tasks):
        count += 1
        arrived += pod.total_gpu_milli
        if bar is not None:
            bar.update(min(pod.total_gpu_milli, max(0, capacity - bar.n)))
        cpu, mem = pod.cpu_milli, pod.memory_mib * MIB
        step_seed = seed * 1_000_003 + i
        if pod.num_gpu == 0:
            node = placer.choose_host_node(cpu, mem, seed=step_seed)
            if node is None:
                failed += 1
                host_failed.append(i)
            else:
                placer.take_host(node, cpu, mem)
        else:
            work = PendingWork(f"{pod.name}#{i}", pod_request(pod), float(i), cpu_milli=cpu,
                               host_memory_bytes=mem)
            reply = decide(CycleRequest(pending=(work,), snapshot=fleet, policy=policy, running=(),
                                        now=float(i), quota=unlimited, seed=step_seed, engine=placer))
            if reply.launches:
                allocated += sum(s.milli for s in reply.launches[0].shares)
            else:
                failed += 1
        arrived_pct = 100.0 * arrived / capacity
        if crossing is None and arrived >= stop_at * capacity:
            crossing = (allocated, arrived, count, failed)
        alloc_pct = round(100.0 * allocated / capacity, 2)
        off = round(arrived_pct) - round(100 * stop_at)  # FGD's analysis rounds the arrived ratio
        if off == 0:
            window.append(alloc_pct)
        if abs(off) <= 1:
            wide.append(alloc_pct)
        if off > 1:
            break
    if bar is not None:
        bar.close()
    if crossing is None:
        crossing = (allocated, arrived, count, failed)
    measured = window or wide or [round(100.0 * crossing[0] / capacity, 2)]
    span = reading_span(tasks, capacity, stop_at)
    return OpenbRun(
        seed=seed,
        unallocated_gpu_pct=round(100.0 - statistics.fmean(measured), 4),
        allocated_milli=crossing[0],
        arrived_milli=crossing[1],
        capacity_milli=capacity,
        tasks_arrived=crossing[2],
        tasks_failed=crossing[3],
        tuned_tasks=len(tasks),
        at_crossing=round(100.0 * (1 - crossing[0] / capacity), 4),
        window_arrivals=len(window),
        # Every reading of the measure holds at most what the arrivals up to its last one allow.
        unallocated_bound_pct=unallocated_bound_pct(tasks[:span], gpus_by_model(nodes)),
        cpu_tasks_failed=sum(i < span for i in host_failed),
    )


def reading_span(tasks: Sequence[OpenbPod], capacity_milli: int, stop_at: float = 1.0) -> int:
    """How many leading arrivals the measure of :func:`run_openb` covers: up to the last one
    whose arrived ratio rounds to ``stop_at`` (else to within 1 point of it, else up to the one
    that reaches it, else all). It depends on the arrivals only, not on the placements."""
    arrived = 0
    window = wide = crossing = -1
    for i, pod in enumerate(tasks):
        arrived += pod.total_gpu_milli
        if crossing < 0 and arrived >= stop_at * capacity_milli:
            crossing = i
        off = round(100.0 * arrived / capacity_milli) - round(100 * stop_at)
        if off == 0:
            window = i
        if abs(off) <= 1:
            wide = i
        if off > 1:
            break
    if crossing < 0:
        crossing = len(tasks) - 1
    return 1 + (window if window >= 0 else wide if wide >= 0 else crossing)


def openb_bounds(
    pods: Sequence[OpenbPod],
    nodes: Sequence[OpenbNode],
    seed: int,
    *,
    factor: float = 1.3,
    stop_at: float = 1.0,
    host: bool = True,
) -> dict[str, Any]:
    """Both bounds of one seed without running a policy: the same arrivals as
    :func:`run_openb` (:func:`tune_workload` with the seed's generator, :func:`reading_span`).
    ``unallocated_bound_pct`` counts GPU capacity only (every placement);
    ``unallocated_host_bound_pct`` host CPU and memory too (every placement that holds every
    arrived CPU-only task, :func:`gpusched.sim.packing_bound.host_packing_bound`)."""
    capacity = openb_fleet(nodes).total_devices() * MILLI
    tasks = tune_workload(pods, capacity, random.Random(seed), factor)
    span = reading_span(tasks, capacity, stop_at)
    arrived = tasks[:span]
    out: dict[str, Any] = {
        "seed": seed,
        "arrivals": span,
        "cpu_tasks": sum(not p.num_gpu for p in arrived),
        "unallocated_bound_pct": unallocated_bound_pct(arrived, gpus_by_model(nodes)),
    }
    if host:  # ``host=False``: the GPU-only bound alone (the host bound's LP costs seconds)
        out["unallocated_host_bound_pct"] = unallocated_host_bound_pct(arrived, nodes)
    return out


def run_openb_seeds(
    pods: Sequence[OpenbPod],
    nodes: Sequence[OpenbNode],
    policy_name: str,
    seeds: Sequence[int],
    *,
    factor: float = 1.3,
    progress: bool = False,
) -> dict[str, Any]:
    """The experiment over ``seeds``: median unallocated GPU % plus every seed's figures."""
    runs = [run_openb(pods, nodes, policy_name, s, factor=factor, progress=progress) for s in seeds]
    values = [r.unallocated_gpu_pct for r in runs]
    return {
        "policy": policy_name,
        "seeds": list(seeds),
        "unallocated_gpu_pct_median": round(statistics.median(values), 4) if values else None,
        "unallocated_gpu_pct": values,
        "unallocated_gpu_pct_at_crossing": [r.at_crossing for r in runs],
        # No placement of the same arrivals can read lower (GPU capacity only; see packing_bound).
        "unallocated_gpu_pct_bound": [r.unallocated_bound_pct for r in runs],
        "measure": "mean allocation over arrivals at 99.5-100.5 % of capacity (FGD's analysis)",
        "tasks_failed": [r.tasks_failed for r in runs],
        # CPU-only tasks that found no node among the arrivals the bounds cover
        "cpu_tasks_failed": [r.cpu_tasks_failed for r in runs],
        "tasks_arrived": [r.tasks_arrived for r in runs],
        "capacity_milli": runs[0].capacity_milli if runs else 0,
    }
