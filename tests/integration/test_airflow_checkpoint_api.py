"""The task-side checkpoint API (``gpusched.airflow.checkpoint``) against a real SQLite ledger,
in a subprocess (as a task process): report, resume an earlier try, learn of a preemption
notice (``GPUSCHED_PREEMPTED``) and run the SIGTERM callback before the previous handler."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from gpusched.ledger import Ledger
from gpusched.scheduler.keys import task_of

ROOT = Path(__file__).resolve().parents[2]
KEY1 = "airflow/d/train/-1/1/run1"
KEY2 = "airflow/d/train/-1/2/run1"

TASK = r"""
import json, os, signal, sys
from gpusched.airflow import checkpoint

seen = []
signal.signal(signal.SIGTERM, lambda s, f: seen.append("airflow handler"))  # as Airflow's on_kill
out = {"before": checkpoint.preempted(poll_s=0)}
earlier = checkpoint.resume()
out["resume"] = None if earlier is None else [earlier.step, earlier.path]
out["report"] = checkpoint.report(step=int(sys.argv[1]), path="/ckpt/" + sys.argv[1])
checkpoint.on_preempt(lambda: seen.append("callback"))
input()  # the test writes the notice, then a line
out["after"] = checkpoint.preempted(poll_s=0)
out["marker"] = os.environ.get("GPUSCHED_PREEMPTED")
os.kill(os.getpid(), signal.SIGTERM)
out["seen"] = seen
print(json.dumps(out))
"""


def _task(tmp_path: Path, key: str, step: int, notify: bool) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GPUSCHED_DB_URL": f"sqlite:///{tmp_path / 'l.db'}",
           "GPUSCHED_ALLOCATION": json.dumps({"key": key})}
    proc = subprocess.Popen([sys.executable, "-c", TASK, str(step)], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ledger = Ledger(env["GPUSCHED_DB_URL"])
    try:
        if notify:
            import time

            deadline = time.time() + 60
            while ledger.checkpoint(key) is None and time.time() < deadline:  # reported
                time.sleep(0.1)
            ledger.notify_preemption(key, task_of(key), "preempted for a test")
    finally:
        ledger.close()
    stdout, stderr = proc.communicate("go\n", timeout=120)
    assert proc.returncode == 0, stderr
    return dict(json.loads(stdout))


def test_report_resume_and_the_preemption_notice(tmp_path: Path) -> None:
    with Ledger(f"sqlite:///{tmp_path / 'l.db'}") as ledger:
        ledger.migrate()
    first = _task(tmp_path, KEY1, 12, notify=True)
    assert first["before"] is False and first["resume"] is None and first["report"] is True
    assert first["after"] is True and first["marker"] == "1"
    assert first["seen"] == ["callback", "airflow handler"]  # checkpoint first, then Airflow's
    second = _task(tmp_path, KEY2, 20, notify=False)
    assert second["resume"] == [12, "/ckpt/12"]  # the earlier try's checkpoint
    assert second["after"] is False and second["marker"] is None
    with Ledger(f"sqlite:///{tmp_path / 'l.db'}") as ledger:
        row = ledger.checkpoint(KEY2)
        assert row is not None and row.step == 20 and row.notice_at is None
        assert set(ledger.checkpoint_times([KEY1, KEY2, "other"])) == {KEY1, KEY2}


def test_outside_an_allocation_every_call_is_a_no_op() -> None:
    from gpusched.airflow import checkpoint

    os.environ.pop("GPUSCHED_ALLOCATION", None)
    assert checkpoint.allocation_key() is None
    assert checkpoint.report(step=1) is False and checkpoint.resume() is None
