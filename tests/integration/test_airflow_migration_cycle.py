"""The executor's migrator (``[gpusched] preemption = migrate``) over its rounds, with a real
SQLite ledger: a move to a free faster device holds it at once under the next try's key and pins
that try; an exchange of two running tasks holds each target as the partner's old try releases
it; a move whose next try never comes is given up (hold released, pin removed); nothing is ever
held twice.

The Airflow-facing edges (task log file, event-log row, clearing the task instance) are recorded
instead of run; ``tests/system/test_airflow_executor_migration.py`` runs the executor's own
cycle against a migrated Airflow DB.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _core_support import StubCore

from gpusched.airflow import gpu_migration, gpu_preemption
from gpusched.airflow.gpu_migration import MIGRATION_REQUEUE_WAIT_S, Migrator
from gpusched.airflow.gpu_preemption import Preemptor
from gpusched.faults.failures import load_overrides
from gpusched.ledger import Ledger
from gpusched.model import DeviceShare
from gpusched.node_builder import make_node
from gpusched.placement import Policy
from gpusched.request import GPURequest
from gpusched.scheduler.keys import parse_ti_key, ti_key

NOW = 50_000.0
RUN = "manual__r"
TABLE = {"big": {"A100-SXM-80GB": 10.0, "T4": 1.0}, "small": {"A100-SXM-80GB": 2.0, "T4": 1.8}}
SETTINGS = {"preemption": "migrate", "preemption_grace_seconds": "20",
            "preemption_min_runtime_seconds": "60", "migration_interval_seconds": "360",
            "migration_restart_seconds": "60"}


class _Core(StubCore):
    def __init__(self, ledger: Ledger) -> None:
        super().__init__(ledger, SETTINGS)
        self.holder = "sched-1"
        self.process = None
        self.preemption = Preemptor(self)


def _key(task: str, try_number: int = 1) -> str:
    return ti_key("d", task, RUN, try_number, -1)


@pytest.fixture
def setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    calls: dict[str, list[Any]] = {"log": [], "event": [], "requeue": []}
    for module in (gpu_preemption, gpu_migration):
        monkeypatch.setattr(module, "append_task_log", lambda k, m, **kw: calls["log"].append((k, m)))
        monkeypatch.setattr(module, "save_task_event", lambda ex, **kw: calls["event"].append(kw))

    def requeue(key: Any, reason: str) -> str:
        calls["requeue"].append(key)
        return "cleared"

    monkeypatch.setattr(gpu_preemption, "requeue", requeue)
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    ledger.migrate()
    ledger.sync_inventory([make_node("fast", "A100-SXM-80GB", 1), make_node("slow", "T4", 1)], source="test")
    yield ledger, calls
    ledger.close()


def _run(core: _Core, task: str, node: str, job_type: str) -> None:
    from airflow.models.taskinstancekey import TaskInstanceKey

    device = core.ledger.snapshot().node(node).devices[0]
    core.ledger.allocate(_key(task), GPURequest.build(gpus=1, job_type=job_type),
                         [DeviceShare(device.uuid, node, 0, 1000, 0)], holder=core.holder, now=NOW - 3600)
    core.gpu_running[TaskInstanceKey("d", task, RUN, 1, -1)] = _key(task)


def _end(core: _Core, task: str, at: float) -> None:
    """Try 1 of ``task`` ended (Airflow stopped it): the executor releases its devices."""
    airflow_key = next(k for k, v in core.gpu_running.items() if v == _key(task))
    reason = core.preemption.release_reason(_key(task))
    assert reason is not None and reason.endswith("requeued")
    core.ledger.release(core.gpu_running.pop(airflow_key), reason=reason, now=at)


def _model(ledger: Ledger, key: str) -> str:
    alloc = ledger.get(key)
    assert alloc is not None and alloc.active
    return str(ledger.snapshot().device(alloc.shares[0].uuid).model)


def test_an_exchange_holds_each_target_as_the_partner_stops(setup: Any) -> None:
    ledger, calls = setup
    core = _Core(ledger)
    migrator = Migrator(core)
    policy = Policy.named("gpusched", throughput=TABLE)
    # "big" gains 10x on the A100, "small" loses little by leaving it: they swap.
    _run(core, "small", "fast", "small")
    _run(core, "big", "slow", "big")
    moving = migrator.consider(policy, NOW)
    assert sorted(m.old_key for m in moving) == [_key("big"), _key("small")]
    assert not any(m.held for m in moving)  # each target is the partner's device, still in use
    events = ledger.events(10, kinds=["migrated"])
    assert {(e.subject, e.detail["to_model"]) for e in events} == {
        (_key("big"), "A100-SXM-80GB"), (_key("small"), "T4")}
    assert len(calls["log"]) == 2 and all("does not use a retry" in m for _, m in calls["log"])
    assert [e["event"] for e in calls["event"]] == ["gpusched.migrated"] * 2
    table = load_overrides(ledger)
    assert table.pinned("d", "big", RUN, 2).models == frozenset({"A100-SXM-80GB"})  # type: ignore[union-attr]
    assert table.pinned("d", "small", RUN, 2).models == frozenset({"T4"})  # type: ignore[union-attr]
    assert migrator.consider(policy, NOW + 1) == []  # at most one round per interval

    core.preemption.advance(NOW + 21)  # grace over: both cleared
    assert sorted(k.task_id for k in calls["requeue"]) == ["big", "small"]
    _end(core, "small", NOW + 25)  # "small" stopped: the A100 is claimed for big's try 2 at once
    migrator.claim(NOW + 25)
    assert _model(ledger, _key("big", 2)) == "A100-SXM-80GB"
    assert ledger.get(_key("small", 2)) is None  # its target (the T4) is still in use
    _end(core, "big", NOW + 27)
    migrator.claim(NOW + 27)
    assert _model(ledger, _key("small", 2)) == "T4"
    assert {m.next_key for m in migrator.moving.values() if m.held} == {_key("big", 2), _key("small", 2)}
    assert migrator.held_keys() == {_key("big", 2), _key("small", 2)}  # reconcile leaves them alone

    # big's try 2 starts on its held device; small's never comes (it had finished): given up.
    from airflow.models.taskinstancekey import TaskInstanceKey

    core.gpu_running[TaskInstanceKey("d", "big", RUN, 2, -1)] = _key("big", 2)
    migrator.claim(NOW + 30)
    assert set(migrator.moving) == {_key("small", 2)}
    assert load_overrides(ledger).pinned("d", "big", RUN, 2) is None  # the spent pin is removed
    migrator.claim(NOW + 27 + MIGRATION_REQUEUE_WAIT_S + 1)
    assert migrator.moving == {}
    gone = ledger.get(_key("small", 2))
    assert gone is not None and not gone.active and str(gone.release_reason).startswith("migration abandoned")
    assert load_overrides(ledger).pinned("d", "small", RUN, 2) is None
    assert [e.subject for e in ledger.events(10, kinds=["migration_abandoned"])] == [_key("small")]


def test_nothing_moves_when_the_gain_does_not_beat_the_restart_or_the_task_is_young(setup: Any) -> None:
    ledger, _ = setup
    core = _Core(ledger)
    _run(core, "small", "slow", "small")  # 2.0 vs 1.8 on the free A100: 360 s x 0.1 < 60 s restart
    assert Migrator(core).consider(Policy.named("gpusched", throughput=TABLE), NOW) == []
    core = _Core(ledger)
    ledger.release(_key("small"), reason="done")
    _run(core, "big", "slow", "big")
    young = Migrator(core)
    young.min_runtime_s = 7200  # it has run for an hour only
    assert young.consider(Policy.named("gpusched", throughput=TABLE), NOW) == []
    moved = Migrator(core).consider(Policy.named("gpusched", throughput=TABLE), NOW)
    assert [m.held for m in moved] == [True]
    parts = parse_ti_key(moved[0].next_key)
    assert parts is not None and parts.try_number == 2
    assert ledger.events(10, kinds=["migrated"])[0].detail["held"] is True
