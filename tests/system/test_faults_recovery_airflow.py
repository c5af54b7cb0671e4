"""Full Airflow loop: an Xid on a running GPU task's device → the retry runs on a healthy GPU.

Runs ``scripts/bench_recovery_airflow.py --trials 1`` (airflow standalone with the GPU executor,
the gpusched plugin and a gpusched agent, on the simulated fleet) and checks its outcome; the
timing is reported by the script, not asserted. Twice: with the task's own Airflow retry (the
failure listener handles the fault inline), and with ``--sweep`` — a task without retries, whose
failed run the bundled ``gpusched_fault_recovery`` DAG, triggered in the same Airflow, classifies
and clears — to the same outcome.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.airflow, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path", ["inline", "sweep"])
def test_xid_fault_is_recovered_through_airflow(tmp_path: Path, path: str) -> None:
    out = tmp_path / "recovery.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_recovery_airflow.py"), "--trials", "1",
         "--out", str(out), *(["--sweep"] if path == "sweep" else [])],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    trial = result["trials"][0]
    assert trial["classified_as"] == "hardware"
    assert trial["faulty_cordoned"] is True
    assert trial["retry_device"] != trial["faulty_device"] and trial["retry_device_healthy"] is True
    assert result["summary"]["recovered_on_healthy_gpu"] == "1/1"
