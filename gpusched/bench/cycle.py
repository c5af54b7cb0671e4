"""What one scheduling cycle of the Airflow executors costs: the ledger read plus the decision.

    gpusched bench cycle --nodes 1000 [--sweep] [--cycles 20]

Per fleet size, a SQLite ledger holds ``nodes`` × ``gpus_per_node`` devices of the synthetic
fleet (:func:`gpusched.testing.synthetic_fleet`'s inventory) with about ``busy`` of them
allocated (a few devices per node, one allocation each). Each cycle does what
``GPUScheduling._schedule`` does around the placement: one ``Ledger.cycle_view`` (fleet snapshot
and active allocations in one read), then ``gpu_cycle.decide`` for ``pending`` newly waiting tasks
of mixed shapes; between cycles one running task ends and another starts in the ledger (usage
moves every cycle; the inventory does not). Two ways, timed in the same run on the same ledger:

- ``fresh``: what the executor did before it kept anything between cycles — a ledger that reads
  the inventory again (a new ``Ledger`` each cycle, so its nodes and the placement index are
  rebuilt) and a new placement engine per cycle scoring by the cycle's own estimate of the mix;
- ``warm``: the executor now — one ``Ledger`` (nodes reloaded only when the inventory's revision
  moves; only the allocation rows changed since the last cycle read), its allocations converted
  to running tasks once each (:class:`~gpusched.scheduler.cycle.RunningTasks`), one
  :class:`~gpusched.placement.warm.WarmPlacement` and a
  :class:`~gpusched.placement.workload.SteadyWorkload` (``[gpusched] workload_drift`` 0.1).

Reports, per size and way, wall and CPU p50/p99 of the read, the decision and the whole cycle
(the warm way's first cycle, which loads the inventory and builds the engine, apart:
``warm_first_cycle_cpu_ms``), and the warm/fresh ratio of the CPU medians (CPU time: a loaded
machine cannot fake it).
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from gpusched.extras import pyplot
from gpusched.ledger import Ledger
from gpusched.model import DeviceShare
from gpusched.placement import Policy
from gpusched.placement.warm import WarmPlacement
from gpusched.placement.workload import SteadyWorkload
from gpusched.quota.policy import QuotaState
from gpusched.request import GPURequest
from gpusched.scheduler.cycle import CycleRequest, PendingWork, RunningTasks, decide, running_tasks
from gpusched.sim.metrics import percentile
from gpusched.testing import synthetic_fleet, synthetic_requests

__all__ = ["cycle_png", "cycle_table", "run_cycle_latency"]


def run_cycle_latency(
    nodes: Sequence[int],
    *,
    gpus_per_node: int = 8,
    cycles: int = 20,
    pending: int = 8,
    busy: float = 0.4,
    seed: int = 0,
    progress: bool = False,
) -> dict[str, Any]:
    """Time ``cycles`` executor cycles per fleet size both ways (see the module docstring)."""
    sweep = []
    for n in nodes:
        with tempfile.TemporaryDirectory(prefix="gpusched-cycle-") as folder:
            sweep.append(_one_size(Path(folder), n, gpus_per_node, cycles, pending, busy, seed, progress))
    return {"gpus_per_node": gpus_per_node, "cycles": cycles, "pending": pending, "busy_fraction": busy,
            "policy": "gpusched", "sweep": sweep}


def _one_size(
    folder: Path, n: int, gpus_per_node: int, cycles: int, pending: int, busy: float, seed: int,
    progress: bool,
) -> dict[str, Any]:
    url = f"sqlite:///{folder / 'ledger.db'}"
    rng = random.Random(seed)
    inventory = synthetic_fleet(n, gpus_per_node, seed, used_fraction=0.0).nodes
    stream = synthetic_requests(cycles * pending * 2 + 64, seed=seed)
    with Ledger(url) as ledger:
        ledger.migrate()
        ledger.sync_inventory(inventory, "bench")
        running = _fill(ledger, inventory, busy, rng)
    policy = Policy.named("gpusched")
    rows: dict[str, dict[str, list[float]]] = {}
    first: dict[str, dict[str, float]] = {}
    with Ledger(url) as kept:
        warm, steady, kept_running = WarmPlacement(), SteadyWorkload(0.1), RunningTasks()
        for way in ("fresh", "warm"):
            times: dict[str, list[float]] = {k: [] for k in ("read", "decide", "cycle", "read_cpu",
                                                              "decide_cpu", "cycle_cpu")}
            for c in range(cycles):
                waiting = stream[(c * pending) % (len(stream) - pending):][:pending]
                if way == "fresh":
                    with Ledger(url) as reader:
                        _timed_cycle(reader, waiting, policy, None, None, running_tasks, times)
                else:
                    _timed_cycle(kept, waiting, policy, warm, steady, kept_running, times)
                _churn(kept, running, inventory, rng)
            if way == "warm":  # its first cycle loads the inventory and builds the engine
                first[way] = {k: v.pop(0) for k, v in times.items()}
            rows[way] = times
            if progress:
                print(f"cycle {n} nodes {way}: CPU p50 {statistics.median(times['cycle_cpu']):.1f} ms",
                      file=sys.stderr)
        reused = warm.rebased
    row: dict[str, Any] = {"nodes": n, "gpus": n * gpus_per_node, "running": len(running),
                           "warm_engine_rebased": reused, "warm_engine_built": warm.built}
    for way, times in rows.items():
        for key, values in times.items():
            row[f"{way}_{key}_p50_ms"] = round(statistics.median(values), 3)
            row[f"{way}_{key}_p99_ms"] = round(percentile(values, 99), 3)
    row["warm_first_cycle_cpu_ms"] = round(first["warm"]["cycle_cpu"], 3)
    ratio = row["warm_cycle_cpu_p50_ms"] / row["fresh_cycle_cpu_p50_ms"]
    row["warm_over_fresh_cycle_cpu_p50"] = round(ratio, 4)
    return row


def _timed_cycle(
    ledger: Any, waiting: Sequence[Any], policy: Any, warm: Any, steady: Any,
    running: Callable[[Sequence[Any]], list[Any]], times: dict[str, list[float]],
) -> None:
    wall, cpu = time.perf_counter(), time.process_time()
    snapshot, active = ledger.cycle_view()
    busy = running(active)
    read_wall, read_cpu = time.perf_counter(), time.process_time()
    now = time.time()
    work = tuple(PendingWork(f"w{i}-{now}", t.request, now) for i, t in enumerate(waiting))
    if steady is not None:
        mix = [w.request for w in work] + [r.request for r in busy]
        policy = replace(policy, workload=steady.shapes(mix))
    decide(CycleRequest(work, snapshot, policy, tuple(busy), now, QuotaState.unlimited(), engine=warm))
    end_wall, end_cpu = time.perf_counter(), time.process_time()
    for key, value in (("read", read_wall - wall), ("decide", end_wall - read_wall),
                       ("cycle", end_wall - wall),
                       ("read_cpu", read_cpu - cpu), ("decide_cpu", end_cpu - read_cpu),
                       ("cycle_cpu", end_cpu - cpu)):
        times[key].append(value * 1000)


def _fill(ledger: Any, inventory: Sequence[Any], busy: float, rng: random.Random) -> list[str]:
    """Allocate about ``busy`` of each node's devices, one whole-device allocation per node."""
    keys = []
    for node in inventory:
        take = round(busy * len(node.devices))
        if take:
            keys.append(_allocate(ledger, node, take, rng))
    return keys


def _churn(ledger: Any, running: list[str], inventory: Sequence[Any], rng: random.Random) -> None:
    """One running task ends and another starts (on the freed node): usage moves, inventory not."""
    if not running:
        return
    key = running.pop(rng.randrange(len(running)))
    node = ledger.get(key).shares[0].node
    ledger.release(key, reason="bench: ended")
    running.append(_allocate(ledger, next(n for n in inventory if n.name == node), rng.randint(1, 3), rng))


def _allocate(ledger: Any, node: Any, take: int, rng: random.Random) -> str:
    # Each node holds at most one bench allocation at a time, so the devices are free.
    devices = rng.sample(list(node.devices), take)
    key = f"run-{node.name}-{rng.getrandbits(40):x}"
    shares = [DeviceShare(d.uuid, d.node, d.index, 1000, d.memory_bytes) for d in devices]
    ledger.allocate(key, GPURequest.build(gpus=take), shares, holder="bench", lease_s=86400)
    return key


def cycle_table(result: dict[str, Any]) -> str:
    """Markdown: per size, CPU p50/p99 of read, decision and cycle, fresh and warm, and the ratio."""
    lines = [
        "| nodes (GPUs) | fresh: read / decide / cycle, CPU p50 ms | warm: read / decide / cycle, CPU p50 ms "
        "| cycle CPU p99 ms, fresh → warm | warm first cycle, CPU ms | warm / fresh (cycle CPU p50) |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["sweep"]:
        fresh = " / ".join(f"{row[f'fresh_{k}_cpu_p50_ms']:.1f}" for k in ("read", "decide", "cycle"))
        warm = " / ".join(f"{row[f'warm_{k}_cpu_p50_ms']:.1f}" for k in ("read", "decide", "cycle"))
        lines.append(
            f"| {row['nodes']:,} ({row['gpus']:,}) | {fresh} | {warm} | "
            f"{row['fresh_cycle_cpu_p99_ms']:.1f} → {row['warm_cycle_cpu_p99_ms']:.1f} | "
            f"{row['warm_first_cycle_cpu_ms']:.1f} | "
            f"{row['warm_over_fresh_cycle_cpu_p50']:.3f} |"
        )
    return "\n".join(lines)


def cycle_png(result: dict[str, Any], path: Path) -> Path:
    """Plot the CPU time of one cycle (p50 solid, p99 dashed) against fleet size, both ways."""
    plt = pyplot()
    sweep = sorted(result["sweep"], key=lambda r: r["nodes"])
    nodes = [r["nodes"] for r in sweep]
    fig, ax = plt.subplots(figsize=(6, 4))
    for way, label in (("fresh", "inventory re-read, new engine"), ("warm", "kept inventory and engine")):
        ax.plot(nodes, [r[f"{way}_cycle_cpu_p50_ms"] for r in sweep], "-o", label=f"{label}, p50")
        ax.plot(nodes, [r[f"{way}_cycle_cpu_p99_ms"] for r in sweep], "--o", label=f"{label}, p99")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(f"nodes ({result['gpus_per_node']} GPUs each)")
    ax.set_ylabel("executor cycle (ledger read + decision), CPU ms")
    busy = f"{result['busy_fraction']:.0%}"
    ax.set_title(f"{result['pending']} waiting tasks per cycle, {busy} of devices busy", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
