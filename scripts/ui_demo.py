"""Fill a ledger with a realistic demo state for the "GPU fleet" page (docs screenshot, manual checks).

The default simulated fleet is recorded as inventory; a batch of GPU requests is placed by the
real placement engine (``gpusched`` policy) and the assignments are written as allocations, the
rejections as queue entries with the engine's own reasons; one device is marked faulty, one
cordoned; telemetry samples are added; a demand forecast (statsmodels, on a synthetic series) is
recorded as a ``forecast`` event; tenant budgets go to ``state_dir()/quota.yaml`` unless one exists.

    AIRFLOW_HOME=/tmp/ui-demo python scripts/ui_demo.py            # ledger under $AIRFLOW_HOME/gpusched
    python scripts/ui_demo.py --db-url sqlite:////tmp/x/ledger.db
"""

from __future__ import annotations

import argparse
import random
import time

from gpusched.fleetfile import load_fleet
from gpusched.ledger import Ledger
from gpusched.model import DeviceSample, Health
from gpusched.paths import include_dir, state_dir
from gpusched.placement import PendingTask, PlacementRequest, Policy, place
from gpusched.quota.policy import QuotaState
from gpusched.request import GPURequest

GIB = 1024**3

DEMO_JOBS: list[tuple[str, dict[str, object]]] = [
    ("llm_pretrain.train.r42.1", {"gpus": 8, "memory": "70GiB", "interconnect": "island", "tenant": "llm",
                                  "models": ["H100-SXM-80GB"], "priority": "high"}),
    ("vision.resnet.r7.1", {"gpus": 4, "memory": "40GiB", "interconnect": "island", "tenant": "vision"}),
    ("vision.vit.r7.1", {"gpus": 2, "memory": "40GiB", "interconnect": "island", "tenant": "vision"}),
    ("nlp.finetune.r3.1", {"gpus": 0.5, "memory": "20GiB", "tenant": "nlp", "partition": "dev"}),
    ("nlp.eval.r3.1", {"gpus": 0.25, "memory": "8GiB", "tenant": "nlp", "partition": "dev"}),
    ("recsys.train.r11.1", {"gpus": 4, "vendor": "amd", "memory": "128GiB", "tenant": "recsys"}),
    ("speech.ascend.r2.1", {"gpus": 2, "vendor": "ascend", "tenant": "speech", "partition": "burst"}),
    ("llm_pretrain.train.r43.1", {"gpus": 8, "memory": "70GiB", "interconnect": "island",
                                  "tenant": "llm", "models": ["H100-SXM-80GB"]}),
    ("vision.big.r8.1", {"gpus": 16, "memory": "40GiB", "interconnect": "same_rack", "gang": True,
                         "tenant": "vision"}),
    ("infer.bench.r1.1", {"gpus": 1, "models": ["L40S"], "tenant": "infer", "partition": "burst"}),
    ("infer.bench.r2.1", {"gpus": 4, "models": ["L40S"], "tenant": "infer", "partition": "burst"}),
    # Hard-isolated fractions: MIG instances of the A100 in MIG mode, partitions of the CPX MI300X.
    ("infer.serve.r5.1", {"gpus": 0.4, "memory": "30GiB", "profile": "3g.40gb", "tenant": "infer"}),
    ("infer.embed.r5.1", {"gpus": 0.1, "memory": "8GiB", "isolation": "hard", "vendor": "nvidia",
                          "tenant": "infer", "partition": "burst"}),
    ("infer.rerank.r5.1", {"gpus": 0.1, "memory": "16GiB", "profile": "CPX", "tenant": "infer"}),
    ("infer.rerank.r6.1", {"gpus": 0.1, "memory": "16GiB", "profile": "CPX", "tenant": "infer"}),
]


def populate(ledger: Ledger, now: float, *, with_forecast: bool = True) -> None:
    """Write the demo state described in the module docstring into ``ledger``."""
    quota = state_dir() / "quota.yaml"
    if not quota.exists():  # budgets in A100-equivalent GPU-hours per 30-day period
        quota.parent.mkdir(parents=True, exist_ok=True)
        quota.write_text("budgets: {llm: 60, vision: 20, nlp: 5, recsys: 40}\ndefault_budget: 10\n")
    ledger.sync_inventory(load_fleet(include_dir() / "fleets" / "default.yaml"), "simulated:default", now=now)
    snap = ledger.snapshot(now)
    a100 = sorted((d for d in snap.devices() if d.node == "a-a100-1"), key=lambda d: d.index)
    ledger.set_health(a100[7].uuid, Health.UNHEALTHY, "Xid 79: GPU has fallen off the bus", now=now)
    ledger.cordon(a100[6].uuid, "ECC page retirement pending", now=now)
    t4 = sorted((d for d in snap.devices() if d.node == "b-t4-1"), key=lambda d: d.index)
    ledger.set_health(t4[3].uuid, Health.DEGRADED, "temperature 88 °C", now=now)
    pending = [
        PendingTask(key, GPURequest.build(**spec), now - 60 * (len(DEMO_JOBS) - i))
        for i, (key, spec) in enumerate(DEMO_JOBS)
    ]
    plan = place(PlacementRequest(pending=pending, snapshot=ledger.snapshot(now),
                                  policy=Policy.named("gpusched"), now=now, quota=QuotaState.unlimited()))
    requests = {p.key: p.request for p in pending}
    for a in plan.assignments:
        ledger.allocate(a.key, requests[a.key], a.shares, holder="demo", lease_s=3600,
                        now=now - random.Random(a.key).randint(120, 7200))
    for r in plan.rejections:
        ledger.record_queue(r.key, requests[r.key], r.reason, now - 600)
    # One finished preemption, worded as the executor words it (gpusched/airflow/gpu_preemption.py).
    ledger.record_event("preempted", "vision.vit.r6.1", now=now - 900, by="llm_pretrain.train.r42.1",
                        reason="preempted for llm_pretrain.train.r42.1 (priority 10 < 80); "
                               "1260 GPU-s since its last checkpoint", lost_gpu_s=1260.0, grace_s=30.0)
    rng = random.Random(7)
    samples = []
    fleet = ledger.snapshot(now)
    for device in fleet.devices():
        used = fleet.used(device.uuid).used_milli
        util = min(100, used // 10 + rng.randint(0, 8)) if used else rng.randint(0, 3)
        samples.append(DeviceSample(device.uuid, now - 3, util, fleet.used(device.uuid).used_memory_bytes,
                                    device.memory_bytes, 35_000 + util * 400, 60_000 + util * 6_000))
    ledger.record_samples(samples)
    if with_forecast:
        from gpusched.capacity.forecast import fit_forecast, synthetic_demand

        series = synthetic_demand(24 * 14, start=now - 24 * 14 * 3600, capacity=64, base=30, daily=10)
        forecast = fit_forecast(series, "ets", 48, level=0.9)
        ledger.record_event("forecast", "demand", now=now, **forecast.to_dict())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db-url", default=None,
                        help="ledger URL (default: $GPUSCHED_DB_URL or the SQLite ledger)")
    parser.add_argument("--no-forecast", action="store_true", help="skip the (statsmodels) forecast")
    args = parser.parse_args()
    with Ledger(args.db_url) as ledger:
        ledger.migrate()
        populate(ledger, time.time(), with_forecast=not args.no_forecast)
        print(f"demo state written to {ledger!r}: {len(ledger.active())} allocations, "
              f"{len(ledger.queue())} waiting")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
