"""Durations learnt across tries, with a real SQLite ledger: a task preempted (or moved, or
retried) after it checkpointed is learnt with its whole work — its succeeded try plus what its
earlier tries saved up to their last checkpoint — not only its last try's run time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpusched.ledger import Ledger
from gpusched.model import DeviceShare, FleetSnapshot
from gpusched.node_builder import make_node
from gpusched.request import GPURequest
from gpusched.scheduler.durations import DurationHistory, carried_work, finished_runs
from gpusched.scheduler.keys import task_of, ti_key

NOW = 9_000_000.0
ONE = GPURequest.build(gpus=1)
FLEET = FleetSnapshot((make_node("n0", "A100-SXM-80GB", 1),))
DEVICE = DeviceShare("n0-gpu0", "n0", 0, 1000, 0)


@pytest.fixture
def ledger(tmp_path: Path) -> Any:
    led = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    led.migrate()
    led.sync_inventory(FLEET.nodes, "test", now=NOW - 86400)
    yield led
    led.close()


def _try(ledger: Ledger, run: str, number: int, start: float, end: float, reason: str,
         checkpoint: float | None = None) -> str:
    key = ti_key("d", "train", run, number, -1)
    ledger.allocate(key, ONE, [DEVICE], holder="sched", now=start)
    if checkpoint is not None:
        ledger.report_checkpoint(key, task_of(key), step=1, now=checkpoint)
    ledger.release(key, reason=reason, now=end, succeeded=reason == "task succeeded")
    return key


def test_a_preempted_task_is_learnt_with_the_work_its_earlier_tries_saved(ledger: Ledger) -> None:
    t0 = NOW - 20_000.0
    # Try 1 checkpointed after 3,000 s and was preempted at 3,500 s (500 s lost); try 2 resumed
    # and finished 1,000 s later: the task's work is 4,000 s.
    _try(ledger, "manual__a", 1, t0, t0 + 3500, "preempted for x; requeued", checkpoint=t0 + 3000)
    last = _try(ledger, "manual__a", 2, t0 + 4000, t0 + 5000, "task succeeded")
    # Another instance: try 1 never checkpointed (try 2 started over: its own time is the work),
    # and a first try that simply succeeded.
    _try(ledger, "manual__b", 1, t0, t0 + 800, "preempted for y; requeued")
    _try(ledger, "manual__b", 2, t0 + 900, t0 + 3900, "task succeeded")
    _try(ledger, "manual__c", 1, t0, t0 + 4200, "task succeeded")
    history = ledger.history(t0 - 1, NOW)
    assert carried_work(ledger, history) == {last: pytest.approx(3000.0)}
    runs = sorted(r.duration_s for r in finished_runs(history, carried_work(ledger, history)))
    assert runs == pytest.approx([3000.0, 4000.0, 4200.0])
    # The executor's predictor learns the same: the group's median is 4,000 s, not 1,000 s.
    predictor = DurationHistory(30.0, 60.0).predictor(ledger, NOW)
    assert predictor is not None
    prediction = predictor.predict(ONE, "d/train")
    assert prediction is not None and prediction.seconds == pytest.approx(4000.0)


def test_no_ledger_read_without_a_later_try(ledger: Ledger, monkeypatch: pytest.MonkeyPatch) -> None:
    _try(ledger, "manual__c", 1, NOW - 5000, NOW - 800, "task succeeded")
    monkeypatch.setattr(ledger, "history_of", lambda patterns: pytest.fail("read the tries"))
    assert carried_work(ledger, ledger.history(NOW - 6000, NOW)) == {}



def test_runs_are_learnt_from_their_recorded_outcome_not_their_wording(ledger: Ledger) -> None:
    t0 = NOW - 20_000.0
    # The outcome recorded with the release decides, whatever the reason's words.
    for run, (reason, ok) in enumerate([("finished; devices back", True), ("task succeeded", False)]):
        key = ti_key("d", "train", f"manual__{run}", 1, -1)
        ledger.allocate(key, ONE, [DEVICE], holder="sched", now=t0 + 10_000 * run)
        ledger.release(key, reason=reason, now=t0 + 10_000 * run + 1000 * (run + 1), succeeded=ok)
    history = ledger.history(t0 - 1, NOW)
    assert [a.status for a in history] == ["succeeded", "released"]
    assert [r.duration_s for r in finished_runs(history)] == pytest.approx([1000.0])
