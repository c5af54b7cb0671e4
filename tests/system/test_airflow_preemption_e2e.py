"""Preemption through real Airflow (``scripts/run.sh`` on SQLite, GPUExecutor, a one-GPU
simulated fleet, ``[gpusched] preemption = priority``).

A low-priority training task holds the only GPU; a critical task arrives. The executor gives the
trainer a notice, the trainer saves a checkpoint and reports it (``gpusched.airflow.checkpoint``),
the executor clears its try (Airflow's supervisor sends SIGTERM), releases the GPU, the critical
task runs, and the trainer's next try resumes from its checkpoint and succeeds — without using a
retry (``max_tries`` raised with the try number), with a ``gpusched.preempted`` event-log row, a
``preempted`` ledger event, a line in the stopped try's log, its task-instance note and the
fleet page's ``/preemptions`` view.

A second trainer, preempted and requeued, is not preempted again by the next critical task until
its second try has saved a checkpoint (the restart protection); its three tries then count as one
run of its whole work for the duration predictor.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _run_sh_support import Airflow, run_sh_airflow
from _run_sh_support import finished_ti as _finished_ti
from _run_sh_support import healthy as _healthy
from _run_sh_support import log_text as _log_text
from _run_sh_support import login as _login
from _run_sh_support import trigger as _trigger
from _run_sh_support import wait_for as _wait

from gpusched.scheduler.keys import ti_key

pytestmark = [pytest.mark.airflow, pytest.mark.slow]

VICTIM, CRITICAL, RESTARTED = "e2e_preempt_victim", "e2e_preempt_critical", "e2e_preempt_restarted"
FLEET = """
name: one-gpu
racks:
  - name: r1
    nodes:
      - name: solo
        cpu: 8
        memory: 32GiB
        devices: {model: A100-SXM-80GB, count: 1}
"""
DAGS_SOURCE = '''
from __future__ import annotations

import json
import os
import time
from datetime import datetime
from pathlib import Path

from airflow.sdk import dag, task

from gpusched.airflow.authoring import gpu


@dag(dag_id="e2e_preempt_victim", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def e2e_preempt_victim():
    @task(task_id="train", retries=0, **gpu(gpus=1, priority="low"))
    def train() -> int:
        from gpusched.airflow import checkpoint

        out = Path(os.environ["E2E_PREEMPT_DIR"])
        attempt = checkpoint.allocation_key().split("/")[4]
        checkpoint.on_preempt(lambda: (out / f"sigterm-try{attempt}").write_text("SIGTERM"))
        earlier = checkpoint.resume()
        first = earlier.step + 1 if earlier is not None else 0
        (out / f"start-try{attempt}").write_text(str(first))
        for step in range(first, 40):
            time.sleep(0.5)
            if step % 4 == 3 or checkpoint.preempted():
                (out / "state.json").write_text(json.dumps({"step": step}))
                checkpoint.report(step=step, path=str(out / "state.json"))
                if checkpoint.preempted():
                    (out / f"preempted-try{attempt}").write_text(os.environ["GPUSCHED_PREEMPTED"])
                    checkpoint.wait_for_stop()
        return first

    train()


@dag(dag_id="e2e_preempt_critical", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def e2e_preempt_critical():
    @task(task_id="urgent", **gpu(gpus=1, priority="critical"))
    def urgent() -> None:
        time.sleep(1)

    urgent()


@dag(dag_id="e2e_preempt_restarted", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def e2e_preempt_restarted():
    @task(task_id="train", retries=0, **gpu(gpus=1, priority="low"))
    def train() -> None:
        """Try 1 runs until preempted; try 2 saves no checkpoint until the test allows it; try 3
        ends four steps after its resume."""
        from gpusched.airflow import checkpoint

        out = Path(os.environ["E2E_PREEMPT_DIR"]) / "restarted"
        out.mkdir(exist_ok=True)
        attempt = int(checkpoint.allocation_key().split("/")[4])
        earlier = checkpoint.resume()
        first = step = earlier.step + 1 if earlier is not None else 0
        (out / f"start-try{attempt}").write_text(str(first))
        while step < first + 1200 and not (attempt >= 3 and step >= first + 4):
            time.sleep(0.5)
            step += 1
            may_save = attempt != 2 or (out / "allow-checkpoint").exists()
            if (may_save and step % 4 == 3) or checkpoint.preempted():
                checkpoint.report(step=step, path=str(out / "state.json"))
                (out / f"checkpoint-try{attempt}").write_text(str(step))
                if checkpoint.preempted():
                    checkpoint.wait_for_stop()

    train()


e2e_preempt_victim()
e2e_preempt_critical()
e2e_preempt_restarted()
'''


@pytest.fixture(scope="module")
def airflow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Airflow]:
    home = tmp_path_factory.mktemp("airflow_home")
    dags = tmp_path_factory.mktemp("dags")
    (dags / "e2e_preempt.py").write_text(DAGS_SOURCE)
    fleet = home / "one-gpu.yaml"
    fleet.write_text(FLEET)
    out = home / "task-files"
    out.mkdir()
    yield from run_sh_airflow(home, dags, {
        "GPUSCHED_FLEET": str(fleet), "GPUSCHED_AGENT": "0", "E2E_PREEMPT_DIR": str(out),
        "AIRFLOW__GPUSCHED__PREEMPTION": "priority",
        "AIRFLOW__GPUSCHED__PREEMPTION_GRACE_SECONDS": "30",
        "AIRFLOW__GPUSCHED__PREEMPTION_MIN_RUNTIME_SECONDS": "2",
        "AIRFLOW__GPUSCHED__REPLAN_BUDGET_MS": "0",
    })


def test_a_critical_task_preempts_a_low_priority_one_which_resumes_without_a_failed_try(
    airflow: Airflow,
) -> None:
    import httpx

    from gpusched.ledger import Ledger

    out = airflow.home / "task-files"
    _wait("the api-server, scheduler and dag-processor", lambda: _healthy(airflow), 300, airflow)
    airflow.token = _wait("a login token", lambda: _login(airflow), 60, airflow)
    _wait("the DAGs to be parsed", lambda: {VICTIM, CRITICAL} <= {
        d["dag_id"] for d in airflow.api("GET", "/dags")["dags"]}, 180, airflow)

    def trigger(dag_id: str) -> str:
        return _trigger(airflow, dag_id)

    def ti(dag_id: str, run_id: str, task_id: str) -> dict[str, object]:
        return dict(airflow.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}"))

    victim_run = trigger(VICTIM)
    # The trainer runs and has checkpointed once (step 3) before the critical task arrives.
    _wait("the trainer's first checkpoint", lambda: (out / "state.json").exists(), 180, airflow)
    critical_run = trigger(CRITICAL)
    _wait("the critical task to succeed", lambda: ti(CRITICAL, critical_run, "urgent")["state"] == "success",
          240, airflow, interval=2)
    def finished(dag_id: str, run_id: str, task_id: str) -> dict[str, object] | None:
        found = ti(dag_id, run_id, task_id)
        return found if found["state"] in ("success", "failed") else None

    final = _wait("the trainer to finish", lambda: finished(VICTIM, victim_run, "train"), 300, airflow,
                  interval=2)
    assert final["state"] == "success", final
    # Preempted once, resumed, not counted as a failure: try 2 ran with the retry budget intact
    # (retries=0: max_tries follows the try number, so no retry was used or is left).
    assert final["try_number"] == 2 and final["max_tries"] == 1, final
    assert (out / "preempted-try1").read_text() == "1"  # GPUSCHED_PREEMPTED in the task
    assert (out / "sigterm-try1").read_text() == "SIGTERM"  # Airflow's supervisor stopped it
    resumed_at = int((out / "start-try2").read_text())
    assert resumed_at >= 4, resumed_at  # the second try resumed from the first one's checkpoint
    assert "note" in final and "preempted for" in str(final["note"]), final.get("note")

    ledger = Ledger(f"sqlite:///{airflow.home / 'gpusched' / 'ledger.db'}")
    try:
        first_try = ti_key(VICTIM, "train", victim_run, 1)
        events = ledger.events(50, kinds=["preempted"])
        assert [e.subject for e in events] == [first_try]
        assert events[0].detail["by"] == ti_key(CRITICAL, "urgent", critical_run, 1)
        released = [a for a in ledger.history(0, time.time() + 1) if a.key == first_try]
        assert released and released[0].release_reason.startswith("preempted for"), released
        # The critical task ran on the GPU only after the trainer had released it.
        urgent = [a for a in ledger.history(0, time.time() + 1)
                  if a.key == ti_key(CRITICAL, "urgent", critical_run, 1)]
        assert urgent and urgent[0].created_at >= released[0].released_at
        # The executor records when each try was first queued; try 2 ages from try 1's.
        second_try = ti_key(VICTIM, "train", victim_run, 2)
        second = [a for a in ledger.history(0, time.time() + 1) if a.key == second_try]
        assert released[0].queued_at is not None and released[0].queued_at <= released[0].created_at
        assert second and second[0].queued_at is not None and second[0].queued_at >= released[0].released_at
    finally:
        ledger.close()
    rows = airflow.api("GET", "/eventLogs", params={"event": "gpusched.preempted", "dag_id": VICTIM})
    assert rows["total_entries"] == 1 and "preempted for" in rows["event_logs"][0]["extra"]
    log = _log_text(airflow, VICTIM, victim_run, "train", 1)
    assert "gpusched: preempted for" in log and "does not use a retry" in log
    view = httpx.get(f"{airflow.url}/gpusched/preemptions", headers=airflow.headers(), timeout=30).json()
    assert [(p["key"], p["task"]["try_number"]) for p in view] == [(first_try, 1)]
    assert Path(out / "state.json").exists()


def test_a_requeued_try_is_not_preempted_again_before_it_checkpoints(airflow: Airflow) -> None:
    from gpusched.ledger import Ledger

    out = airflow.home / "task-files" / "restarted"
    _wait("the api-server, scheduler and dag-processor", lambda: _healthy(airflow), 300, airflow)
    airflow.token = airflow.token or _wait("a login token", lambda: _login(airflow), 60, airflow)
    _wait("the DAGs to be parsed", lambda: RESTARTED in {
        d["dag_id"] for d in airflow.api("GET", "/dags")["dags"]}, 180, airflow)

    def trigger(dag_id: str) -> str:
        return _trigger(airflow, dag_id)

    def finished(dag_id: str, run_id: str, task_id: str) -> dict[str, object] | None:
        return _finished_ti(airflow, dag_id, run_id, task_id)

    ledger = Ledger(f"sqlite:///{airflow.home / 'gpusched' / 'ledger.db'}")
    try:
        def preempted() -> list[tuple[str, str]]:
            return [(e.subject, e.detail["by"]) for e in reversed(ledger.events(50, kinds=["preempted"]))
                    if RESTARTED in e.subject]

        run = trigger(RESTARTED)
        _wait("the trainer's first checkpoint", lambda: (out / "checkpoint-try1").exists(), 180, airflow)
        first_critical = trigger(CRITICAL)
        _wait("the trainer's second try", lambda: (out / "start-try2").exists(), 240, airflow)
        # A second critical task arrives while try 2 has saved nothing since its restart: stopping
        # it would lose all its work again, so it is no victim (the critical task waits) ...
        second_critical = trigger(CRITICAL)
        time.sleep(12)  # many cycles, well past preemption_min_runtime_seconds (2 s)
        first = (ti_key(RESTARTED, "train", run, 1), ti_key(CRITICAL, "urgent", first_critical, 1))
        assert preempted() == [first]
        assert finished(CRITICAL, second_critical, "urgent") is None
        # ... until it has checkpointed: then it is preempted as any low-priority task.
        (out / "allow-checkpoint").write_text("1")
        urgent = _wait("the second critical task", lambda: finished(CRITICAL, second_critical, "urgent"),
                       240, airflow, interval=2)
        assert urgent["state"] == "success", urgent
        final = _wait("the trainer to finish", lambda: finished(RESTARTED, run, "train"), 300, airflow,
                      interval=2)
        assert (final["state"], final["try_number"], final["max_tries"]) == ("success", 3, 2), final
        second_try = ti_key(RESTARTED, "train", run, 2)
        assert preempted() == [first, (second_try, ti_key(CRITICAL, "urgent", second_critical, 1))]
        (notice,) = ledger.events(5, kinds=["preempted"], subject=second_try)
        saved = int((out / "checkpoint-try2").read_text())
        assert int((out / "start-try3").read_text()) == saved + 1  # resumed from try 2's checkpoint
        allowed_at = (out / "allow-checkpoint").stat().st_mtime
        assert notice.at >= allowed_at, (notice.at, allowed_at)  # not before try 2 could checkpoint

        # What the duration predictor learns from this instance: its whole work, i.e. try 3's run
        # plus each earlier try's time from its start to its last checkpoint.
        from gpusched.scheduler.durations import carried_work, finished_runs

        allocations = [a for a in ledger.history(0, time.time() + 1) if f"/{RESTARTED}/" in a.key]
        by_try = {int(a.key.split("/")[4]): a for a in allocations}
        assert sorted(by_try) == [1, 2, 3]
        saved = sum((out / f"checkpoint-try{n}").stat().st_mtime - by_try[n].created_at for n in (1, 2))
        third = by_try[3]
        assert third.released_at is not None
        (learned,) = finished_runs(allocations, carried_work(ledger, allocations))
        assert learned.duration_s == pytest.approx(third.released_at - third.created_at + saved, abs=2.0)
    finally:
        ledger.close()
