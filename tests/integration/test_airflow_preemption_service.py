"""``[gpusched] preemption = service`` in the executor's cycle, with a real SQLite ledger: the
run-time distributions come from the ledger's finished allocations (``DurationHistory``); the
queue is ordered by the Gittins index; a held task preempts a running task of its own priority
that has outlived most runs of its kind, and never one whose index is not lower by the margin.

The Airflow-facing edges (task log, event-log row, clearing) are recorded instead of run, as in
``test_airflow_preemption_cycle.py``; ``tests/system/test_airflow_preemption_e2e.py`` runs them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _core_support import StubCore

from gpusched.airflow import gpu_preemption
from gpusched.airflow.gpu_cycle import CycleRequest, PendingWork, decide
from gpusched.airflow.gpu_durations import DurationHistory
from gpusched.airflow.gpu_preemption import Preemptor
from gpusched.airflow.keys import parse_ti_key, ti_key
from gpusched.ledger import Ledger
from gpusched.model import DeviceShare, FleetSnapshot
from gpusched.node_builder import make_node
from gpusched.placement import Policy, RunningTask
from gpusched.quota.policy import QuotaState
from gpusched.request import GPURequest

NOW = 5_000_000.0
ONE = GPURequest.build(gpus=1)
FLEET = FleetSnapshot((make_node("n0", "A100-SXM-80GB", 1),))
DEVICE = DeviceShare("n0-gpu0", "n0", 0, 1000, 0)
SETTINGS = {"preemption": "service", "preemption_grace_seconds": "20",
            "preemption_min_runtime_seconds": "60"}


class _Core(StubCore):
    def __init__(self, ledger: Ledger) -> None:
        super().__init__(ledger, SETTINGS)
        self.durations = DurationHistory(30.0, 60.0, service_history=True)


@pytest.fixture
def ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(gpu_preemption, "append_task_log", lambda k, m, **kw: None)
    monkeypatch.setattr(gpu_preemption, "save_task_event", lambda ex, **kw: None)
    led = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    led.migrate()
    led.sync_inventory(FLEET.nodes, "test", now=NOW - 30 * 86400)
    # The past: d/train ran 30 times, 27 of them a minute, 3 ten hours; d/long always ten hours.
    runs = [("train", 60.0)] * 27 + [("train", 36_000.0)] * 3 + [("long", 36_000.0)] * 20
    for i, (task, run) in enumerate(runs):
        key, start = ti_key("d", task, f"scheduled__{i}", 1, -1), NOW - 86400.0 * 20 + i * 20_000.0
        led.allocate(key, ONE, [DEVICE], holder="old", now=start)
        led.release(key, reason="task succeeded", now=start + run)
    yield led
    led.close()


def _cycle(core: _Core, running_for_s: float, *waiting: str) -> tuple[CycleRequest, Any, Preemptor]:
    from airflow.models.taskinstancekey import TaskInstanceKey

    key = ti_key("d", "train", "manual__now", 1, -1)
    running = RunningTask(key, ONE, (DEVICE,), NOW - running_for_s, None)
    parts = parse_ti_key(key)
    assert parts is not None
    core.gpu_running[TaskInstanceKey("d", "train", "manual__now", 1, -1)] = key
    pending = tuple(PendingWork(ti_key("d", task, "manual__w", 1, -1), ONE, NOW - 10 + n)
                    for n, task in enumerate(waiting))
    preemptor = Preemptor(core)
    core.durations.predictor(core.ledger, NOW)  # the cycle reads the history (DurationHistory.apply)
    cycle = preemptor.rank(CycleRequest(pending, FLEET.with_usage([DEVICE]), Policy.named("gpusched"),
                                        (running,), NOW, QuotaState.unlimited()))
    return cycle, decide(cycle), preemptor


def test_a_task_that_outlived_its_kind_is_preempted_by_a_fresh_one(ledger: Ledger) -> None:
    core = _Core(ledger)
    # The running d/train has had 2 h: longer than 90 % of d/train's runs. A fresh d/train
    # (90 % chance to end within a minute) preempts it; a fresh d/long (always ten hours) may not.
    cycle, reply, preemptor = _cycle(core, 7200.0, "long", "train")
    assert cycle.policy.queue_order.value == "ranked"
    assert [w.key.split("/")[2] for w in sorted(cycle.pending, key=lambda w: w.rank)] == ["train", "long"]
    after = preemptor.consider(cycle, reply)
    victim = ti_key("d", "train", "manual__now", 1, -1)
    assert list(preemptor.evictions) == [victim]
    assert preemptor.evictions[victim].beneficiary == ti_key("d", "train", "manual__w", 1, -1)
    (event,) = ledger.events(10, kinds=["preempted"])
    assert event.subject == victim and "expected-service index" in event.detail["reason"]
    holds = {h.key.split("/")[2]: h.reason for h in after.holds}
    assert holds["train"].startswith("preempting ")


def test_never_for_an_index_that_is_not_higher_by_the_margin(ledger: Ledger) -> None:
    core = _Core(ledger)
    cycle, reply, preemptor = _cycle(core, 7200.0, "long")
    assert preemptor.consider(cycle, reply) == reply and preemptor.evictions == {}
    assert ledger.events(10, kinds=["preempted"]) == []
    # A running task younger than the minimum run time is never a victim either.
    cycle, reply, preemptor = _cycle(_Core(ledger), 30.0, "train")
    assert preemptor.consider(cycle, reply) == reply and preemptor.evictions == {}
