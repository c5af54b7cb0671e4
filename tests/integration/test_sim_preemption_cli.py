"""``gpusched simulate --preemption``: the option reaches the simulator and its report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _simulate(trace: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpusched.cli", "simulate", "--trace", str(trace), "--fleet",
         "uniform:1x8:A100", "--json", "--quiet", *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )


def test_simulate_preemption_option(tmp_path: Path) -> None:
    trace = tmp_path / "philly.csv"
    rows = "".join(f"2017-10-09 00:0{i}:00,600,4,2400,vision\n" for i in range(6))
    trace.write_text("timestamp,duration,num_gpus,gpu_time,cluster\n" + rows, encoding="utf-8")
    proc = _simulate(trace, "--preemption", "priority", "--checkpoint-minutes", "10", "--min-runtime", "60")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    # Trace jobs all have the same (normal) priority: nobody may preempt anybody.
    assert data["preemption"] == {"mode": "priority", "checkpoint_s": 600.0, "min_runtime_s": 60.0,
                                  "grace_s": 30.0, "max_unsaved_s": 600.0, "min_rerun_s": 7200.0,
                                  "preemptions": 0, "jobs_preempted": 0, "lost_gpu_hours": 0.0}
    assert data["jobs_finished"] == 6
    plain = json.loads(_simulate(trace).stdout)
    assert "preemption" not in plain and plain["jobs_finished"] == 6
    bad = _simulate(trace, "--preemption", "always")
    assert bad.returncode != 0 and "invalid choice: 'always'" in bad.stderr


def test_simulate_policy_parts(tmp_path: Path) -> None:
    trace = tmp_path / "philly.csv"
    rows = "".join(f"2017-10-09 00:0{i}:00,600,4,2400,vision\n" for i in range(6))
    trace.write_text("timestamp,duration,num_gpus,gpu_time,cluster\n" + rows, encoding="utf-8")
    proc = _simulate(trace, "--policy-parts", "score.locality=0.5, tiebreak=earliest")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["jobs_finished"] == 6
    bad = _simulate(trace, "--policy-parts", "score.local=0.5")
    assert bad.returncode != 0
    (line,) = [x for x in bad.stderr.splitlines() if "policy-parts" in x]
    assert "--policy-parts: score 'local' is not a part" in line, bad.stderr
