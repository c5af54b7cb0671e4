"""Telemetry agent benchmark: what one agent cycle costs, and how fast the alert rules act.

Runs the real ``TelemetryAgent`` (simulated backend, SQLite ledger) on a simulated clock:

1. Cycle cost: ``agent.cycle()`` (sample → store → evaluate → metrics) against the bare
   ``backend.sample()`` it wraps, on the default fleet, median and p99 over ``--cycles`` cycles;
   reported as milliseconds and as a ratio to the bare sampling measured in the same run.
2. Reaction time: from the moment a fault starts to the cycle whose actions handle it, at the
   given sampling interval — a memory leak on an allocated device at several growth rates
   (→ stop_task), an Xid 79 (→ unhealthy + cordon), an over-temperature (→ degraded + cordon).

    .venv/bin/python scripts/bench_telemetry.py [--interval 10] [--cycles 50] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from gpusched.agent.telemetry import TelemetryAgent
from gpusched.hardware.simulated import SimulatedBackend
from gpusched.ledger import Ledger
from gpusched.model import DeviceShare
from gpusched.request import GPURequest
from gpusched.sim.metrics import percentile

REPO = Path(__file__).resolve().parents[2]  # gpusched/bench/ → the repository


class Clock:
    """A settable clock shared by the backend and the agent."""

    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def _setup(folder: Path, clock: Clock) -> tuple[SimulatedBackend, Ledger, TelemetryAgent]:
    backend = SimulatedBackend(state_folder=folder, clock=clock)
    ledger = Ledger(f"sqlite:///{folder / 'ledger.db'}")
    ledger.migrate()
    agent = TelemetryAgent(backend, ledger)
    agent.sync_inventory(clock.now)
    return backend, ledger, agent


def cycle_cost(cycles: int, interval: float) -> dict[str, Any]:
    """Median/p99 ms of agent.cycle() and of backend.sample(), alternating in one run."""
    with tempfile.TemporaryDirectory() as tmp:
        clock = Clock(1_000_000.0)
        backend, ledger, agent = _setup(Path(tmp), clock)
        bare: list[float] = []
        full: list[float] = []
        for _ in range(cycles):
            clock.now += interval
            began = time.perf_counter()
            backend.sample()
            bare.append((time.perf_counter() - began) * 1000)
            began = time.perf_counter()
            agent.cycle(clock.now)
            full.append((time.perf_counter() - began) * 1000)
        devices = len(backend.sample())
        ledger.close()
    return {
        "devices_sampled": devices,
        "cycle_ms_p50": statistics.median(full), "cycle_ms_p99": percentile(full, 99),
        "sample_ms_p50": statistics.median(bare), "sample_ms_p99": percentile(bare, 99),
        "cycle_over_sample_ratio_p50": statistics.median(full) / max(statistics.median(bare), 1e-9),
    }


def reaction(kind: str, interval: float, leak_mb_per_min: float = 0.0) -> dict[str, Any]:
    """Seconds from the start of the fault to the cycle that acted on it (None: never in 15 min)."""
    with tempfile.TemporaryDirectory() as tmp:
        clock = Clock(2_000_000.0)
        backend, ledger, agent = _setup(Path(tmp), clock)
        device = next(d for n in backend.discover() if not n.standby for d in n.devices
                      if d.vendor == "nvidia")
        share = DeviceShare(device.uuid, device.node, device.index, 1000, device.memory_bytes)
        ledger.allocate("bench/task", GPURequest.build(gpus=1), [share], holder="bench", now=clock.now)
        for _ in range(3):  # a steady baseline before the fault
            clock.now += interval
            backend.set_load(device.uuid, 90, 20 * 2**30)
            agent.cycle(clock.now)
        start = clock.now
        if kind == "xid":
            backend.inject_fault(device.uuid, "xid", code=79)
        elif kind == "overtemp":
            backend.inject_fault(device.uuid, "overtemp")
        acted: float | None = None
        rule = ""
        while clock.now - start < 900:
            clock.now += interval
            if kind == "leak":
                grown = 20 * 2**30 + int(leak_mb_per_min * 1e6 * (clock.now - start) / 60)
                backend.set_load(device.uuid, 90, min(grown, device.memory_bytes))
            result = agent.cycle(clock.now)
            if result.actions:
                acted = clock.now - start
                rule = ", ".join(sorted({f"{a.rule}→{a.kind}" for a in result.actions}))
                break
        ledger.close()
    return {"fault": kind, "leak_mb_per_min": leak_mb_per_min or None, "interval_s": interval,
            "reaction_s": acted, "actions": rule}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--interval", type=float, default=10.0, help="agent interval, seconds (default 10)")
    parser.add_argument("--cycles", type=int, default=50, help="cycles for the cost figure (default 50)")
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args()
    cost = cycle_cost(args.cycles, args.interval)
    reactions = [reaction("leak", args.interval, rate) for rate in (150.0, 1000.0, 6000.0)]
    reactions += [reaction("xid", args.interval), reaction("overtemp", args.interval)]
    result = {"cycle_cost": cost, "reactions": reactions}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"agent cycle on {cost['devices_sampled']} devices: p50 {cost['cycle_ms_p50']:.1f} ms, "
          f"p99 {cost['cycle_ms_p99']:.1f} ms ({cost['cycle_over_sample_ratio_p50']:.1f}× bare sampling)")
    for r in reactions:
        what = r["fault"] + (f" {r['leak_mb_per_min']:.0f} MB/min" if r["leak_mb_per_min"] else "")
        print(f"  {what:<22} acted after {r['reaction_s']} s: {r['actions']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
