"""The simulator places with the executor's quota state: budgets hold a tenant, partitions borrow."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from gpusched.placement import Policy
from gpusched.quota.policy import QuotaPolicy
from gpusched.request import PRIORITY_NAMES, GPURequest, Partition
from gpusched.sim.engine import SimJob, simulate
from gpusched.sim.fleets import fleet_from_spec

ROOT = Path(__file__).resolve().parents[2]


def _job(key: str, tenant: str, at: float, *, partition: str = "training", gpus: int = 1,
         priority: int = PRIORITY_NAMES["normal"]) -> SimJob:
    request = GPURequest(count=gpus, tenant=tenant, partition=Partition(partition),
                         expected_duration_s=3600, priority=priority)
    return SimJob(key, request, at, 3600.0)


def test_tenant_over_budget_is_held_in_the_sim_while_others_run() -> None:
    fleet = fleet_from_spec("uniform:1x8:A100")
    # vision may spend 2 A100-h a week: two 1-h jobs; the third waits for next week.
    jobs = [_job(f"v{i}", "vision", 60.0 * i) for i in range(3)] + [_job("n0", "nlp", 200.0)]
    policy = QuotaPolicy(budgets_hours={"vision": 2}, period_s=7 * 86400)
    result = simulate(jobs, fleet, Policy.named("gpusched"), quota=policy)
    starts = {r.key: r.start_s for r in result.records}
    # v2 starts when the next week's period begins: Monday 00:00 UTC, 4 days after the sim's 0.
    assert starts == {"v0": 0.0, "v1": 60.0, "n0": 200.0, "v2": 4 * 86400.0} and not result.unstarted
    report = result.quota
    assert report is not None  # the period holding the run's end: the second week
    assert report["tenants"]["vision"] == {"budget_gpu_hours": 2.0, "used_gpu_hours": 1.0}
    assert report["tenants"]["nlp"]["budget_gpu_hours"] is None
    assert report["tenants"]["nlp"]["used_gpu_hours"] == 0.0
    assert report["over_budget"]["mode"] == "finish" and report["over_budget"]["stops"] == 0
    assert report["partitions"]["training"]["gpu_hours_pct"] == 100.0
    # Without the quota the same trace runs every job: the hold came from the budget.
    free = simulate(jobs, fleet, Policy.named("gpusched"))
    assert {r.key for r in free.records} == {"v0", "v1", "v2", "n0"} and free.quota is None


def test_dev_beyond_its_share_waits_while_training_waits_then_borrows_idle_capacity() -> None:
    fleet = fleet_from_spec("uniform:1x10:A100")  # shares: training 7, burst 2, dev 1 GPU
    jobs = [_job("t0", "a", 0.0, gpus=4), _job("t1", "a", 1.0, gpus=3),
            _job("d0", "b", 1.0, partition="dev", gpus=4,
                 priority=PRIORITY_NAMES["normal"] + 1)]
    result = simulate(jobs, fleet, Policy.named("gpusched"), quota=QuotaPolicy())
    starts = {r.key: r.start_s for r in result.records}
    # 6 GPUs are free at t=1 and dev comes first (priority), but the waiting training task keeps
    # its share: dev (4 > its 1) waits; once t0 ends, training needs no more and dev borrows
    # the idle capacity.
    assert starts["t1"] == 1.0 and starts["d0"] == 3600.0
    free = simulate(jobs, fleet, Policy.named("gpusched"))
    assert {r.key: r.start_s for r in free.records}["d0"] == 1.0  # no quota: dev starts at once
    idle = simulate([_job("d0", "b", 0.0, partition="dev", gpus=4)], fleet, Policy.named("gpusched"),
                    quota=QuotaPolicy())
    assert idle.records[0].start_s == 0.0
    assert idle.quota is not None and idle.quota["partitions"]["dev"]["gpu_hours"] == 4.0


def test_simulate_quotas_json(tmp_path: Path) -> None:
    trace = tmp_path / "philly.csv"
    rows = "".join(f"2017-10-09 00:0{i}:00,600,1,600,vision\n" for i in range(8))
    trace.write_text("timestamp,duration,num_gpus,gpu_time,cluster\n" + rows
                     + "2017-10-09 00:03:30,600,2,1200,nlp\n", encoding="utf-8")
    quotas = tmp_path / "quota.yaml"
    quotas.write_text("budgets: {vision: 1}\ndefault_duration_s: 600\nperiod_s: 604800\n", encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, "-m", "gpusched.cli", "simulate", "--trace", str(trace), "--fleet",
         "uniform:1x8:A100", "--quotas", str(quotas), "--json", "--quiet"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    vision = data["quota"]["tenants"]["vision"]
    # Each vision job costs 1/6 A100-h: six fit the 1-h budget, two are held until the next
    # period: Monday 2017-10-16 00:00 UTC (periods on the trace's Mondays, as in the executor),
    # 7 days after the first arrival. The report's period is that week's.
    assert vision["budget_gpu_hours"] == 1.0 and vision["used_gpu_hours"] == round(2 / 6, 3)
    assert data["jobs_unstarted"] == 0 and data["jobs_finished"] == 9
    held_delay = (7 * 86400 - 360) + (7 * 86400 - 420)  # vision 6 and 7 arrived at 00:06, 00:07
    assert data["queue_delay_mean_s"] == round(held_delay / 9, 3)
    assert data["quota"]["tenants"]["nlp"] == {"budget_gpu_hours": None, "used_gpu_hours": 0.0}
    assert data["quota"]["over_budget"]["mode"] == "finish"
    shares = data["quota"]["partitions"]
    assert {p: shares[p]["share_pct"] for p in shares} == {"training": 70, "burst": 20, "dev": 10}
    assert sum(shares[p]["gpu_hours_pct"] for p in shares) == 100.0


def test_simulate_over_budget_stop_from_the_command_line(tmp_path: Path) -> None:
    trace = tmp_path / "philly.csv"
    # One 3-h job of vision on Monday 2017-10-09; the quota charges it 10 min, its budget is 1 A100-h.
    trace.write_text("timestamp,duration,num_gpus,gpu_time,cluster\n"
                     "2017-10-09 00:00:00,10800,1,10800,vision\n", encoding="utf-8")
    quotas = tmp_path / "quota.yaml"
    quotas.write_text("budgets: {vision: 1}\ndefault_duration_s: 600\nperiod_s: 604800\n", encoding="utf-8")
    runs = {}
    for mode in ("finish", "stop"):
        proc = subprocess.run(
            [sys.executable, "-m", "gpusched.cli", "simulate", "--trace", str(trace), "--fleet",
             "uniform:1x8:A100", "--quotas", str(quotas), "--over-budget", mode, "--json", "--quiet"],
            cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
        )
        assert proc.returncode == 0, proc.stderr
        runs[mode] = json.loads(proc.stdout)
    assert runs["finish"]["quota"]["over_budget"]["stops"] == 0 and runs["finish"]["jct_mean_s"] == 10800
    stop = runs["stop"]["quota"]["over_budget"]
    # Stopped at 1 h each week (Mondays), it finishes in the third week's period.
    assert (stop["mode"], stop["stops"], stop["jobs_stopped"]) == ("stop", 2, 1)
    assert runs["stop"]["jct_mean_s"] == 2 * 7 * 86400 + 3600
    assert runs["stop"]["quota"]["tenants"]["vision"]["used_gpu_hours"] == 1.0
