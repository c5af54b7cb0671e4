"""The multi-tenant replay harness on a tiny Philly-format trace: rules, budgets, shares, CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpusched.bench.tenants import assign_partitions, budgets_for, measure_tenants, replay_tenants
from gpusched.request import Partition

ROOT = Path(__file__).resolve().parents[2]
WINDOW = ("2017-10-09", "2017-10-10")


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    """big: 12 two-GPU 1-h jobs (6 A100-h on P100); mid: 4 one-GPU 1-h jobs; small: one 30-min job."""
    rows = [f"2017-10-09 00:{i:02d}:00,3600,2,7200,big" for i in range(12)]
    rows += [f"2017-10-09 00:{i:02d}:30,3600,1,3600,mid" for i in range(4)]
    rows += ["2017-10-09 00:05:00,1800,1,1800,small", "2017-10-10 00:00:00,60,1,60,big"]  # last: outside
    path = tmp_path / "philly.csv"
    text = "timestamp,duration,num_gpus,gpu_time,cluster\n" + "\n".join(rows) + "\n"
    path.write_text(text, encoding="utf-8")
    return path


def test_partition_rule_fills_training_then_burst_then_dev_by_demand() -> None:
    demand = {"a": 50.0, "b": 30.0, "c": 10.0, "d": 6.0, "e": 4.0}
    # a starts at 0 %, b at 50 % (< 70): training; c at 80 %: burst; d at 90 %, e at 96 %: dev.
    assert assign_partitions(demand) == {"a": Partition.TRAINING, "b": Partition.TRAINING,
                                         "c": Partition.BURST, "d": Partition.DEV, "e": Partition.DEV}
    assert budgets_for({"a": 9.9, "b": 0.4}, 0.5) == {"a": 4, "b": 1}


def test_budgets_hold_within_one_task_and_shares_add_up(trace: Path, tmp_path: Path) -> None:
    replay = replay_tenants(trace, window=WINDOW, nodes=1, out_dir=tmp_path)
    result = measure_tenants(replay)
    assert result["partition_of"] == {"big": "training", "mid": "burst", "small": "dev"}
    assert (tmp_path / result["quota_file"]).read_text(encoding="utf-8").count("'big': 3") == 1
    big = result["quota"]["tenants"]["big"]
    # Budget 3 A100-h = six 0.5-h jobs; the other six wait for next week's budget and start as
    # it begins (Monday 2017-10-16 00:00 UTC).
    assert big["budget_gpu_hours"] == 3 and big["largest_task_gpu_hours"] == 0.5
    assert big["worst_period_gpu_hours"] == 3.0 and big["jobs_waiting_at_end"] == 0
    lo, hi = replay.week
    quota_run = replay.results["quota"].records
    starts = sorted(r.start_s for r in quota_run if replay.jobs[r.key].request.tenant == "big")
    assert max(starts[:6]) < hi and starts[6] == lo + 7 * 86400 and min(starts[6:]) >= lo + 7 * 86400
    assert result["checks"]["budgets_hold"] and result["quota"]["max_overshoot_tasks"] <= 1.0
    # Without quotas big runs its whole demand: 6 A100-h, 3 over = 6 tasks' worth.
    assert result["baseline"]["tenants"]["big"]["worst_period_gpu_hours"] == 6.0
    assert result["baseline"]["max_overshoot_tasks"] == 6.0
    # Shares: each partition's GPU-hours in the window are its jobs' GPU-hours there.
    for run in ("quota", "baseline"):
        sim = replay.results[run]
        for part, row in result[run]["partitions"].items():
            hours = sum(len(r.shares) * max(0.0, min(r.end_s, hi) - max(r.start_s, lo)) / 3600
                        for r in sim.records if replay.jobs[r.key].request.partition.value == part)
            assert row["gpu_hours"] == pytest.approx(hours, abs=0.05)
            assert row["share_of_fleet_pct"] == pytest.approx(100 * hours / (8 * 24), abs=0.01)
        shares = [p["share_of_used_pct"] for p in result[run]["partitions"].values()]
        assert sum(shares) == pytest.approx(100, abs=0.05)
    # Training's share is 5.6 of 8 GPUs: its third 2-GPU job borrows idle capacity.
    assert result["quota"]["partitions"]["training"]["borrowed_gpu_hours"] > 0
    assert result["checks"]["idle_capacity_lent"]


def test_cli_prints_json_and_writes_png(trace: Path, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "gpusched.cli", "bench", "tenants", "--jobs", str(trace), "--start", WINDOW[0],
         "--end", WINDOW[1], "--nodes", "1", "--json", "--quiet", "--out-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["checks"]["budgets_hold"] and (tmp_path / data["png"]).stat().st_size > 1000
    assert set(data["quota"]["partitions"]) == {"training", "burst", "dev"}
    preempting = subprocess.run(
        [sys.executable, "-m", "gpusched.cli", "bench", "tenants", "--jobs", str(trace), "--start", WINDOW[0],
         "--end", WINDOW[1], "--nodes", "1", "--json", "--quiet", "--preemption", "partitions",
         "--out-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    assert preempting.returncode == 0, preempting.stderr
    again = json.loads(preempting.stdout)
    assert again["preemption"] == "partitions" and again["checks"]["budgets_hold"]
    assert again["quota"]["preempted"] is not None  # the replay ran with the executor's victim selection
    bad = subprocess.run(
        [sys.executable, "-m", "gpusched.cli", "bench", "tenants", "--jobs", str(trace),
         "--start", "2017-11-01", "--end", "2017-11-02", "--nodes", "1", "--quiet",
         "--out-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    assert bad.returncode == 2 and "has no jobs in the window" in bad.stderr
